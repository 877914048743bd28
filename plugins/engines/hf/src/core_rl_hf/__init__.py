"""core-rl-hf: the ``hf`` rollout engine, generating in-process with Hugging Face transformers.

See :class:`core_rl_hf.engine.HFRolloutEngine` for the engine and :mod:`core_rl_hf.generation` for
the batched sampling loop.
"""

from core_rl_hf.config import HFRolloutConfig

__all__ = ["HFRolloutConfig"]
