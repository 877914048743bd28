"""Registration of the ``hf`` rollout engine (entry point group ``core_rl.rollout_engines``).

Importing this module does not import transformers; the engine loads it when it is built.
"""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl

from core_rl_hf.config import HFRolloutConfig
from core_rl_hf.engine import make_engine


@hookimpl
def core_rl_register_rollout_engines(register: Register) -> None:
    register(
        "hf",
        make_engine,
        description="In-process transformers generation with a KV cache (embedded, no server)",
        config_cls=HFRolloutConfig,
    )
