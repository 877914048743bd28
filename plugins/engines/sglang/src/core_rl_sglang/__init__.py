"""core-rl-sglang: the ``sglang`` rollout engine, generating through SGLang servers over HTTP.

SGLang never enters the trainer's environment: the servers run from the ``sglang`` server
environment (:mod:`core_rl_sglang.env`, built by ``core-rl server-env create sglang``), a given
interpreter, or are reached at given URLs. See :class:`core_rl_sglang.engine.SGLangRolloutEngine`.
"""

from core_rl_sglang.config import SGLangConfig

__all__ = ["SGLangConfig"]
