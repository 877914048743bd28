"""core-rl-vllm: the ``vllm`` rollout engine, generating through vLLM servers over HTTP.

vLLM never enters the trainer's environment: the servers run from the ``vllm`` server environment
(:mod:`core_rl_vllm.env`, built by ``core-rl server-env create vllm``), a given interpreter, or are
reached at given URLs. See :class:`core_rl_vllm.engine.VLLMRolloutEngine`.
"""

from core_rl_vllm.config import VLLMConfig

__all__ = ["VLLMConfig"]
