"""Registration of the ``hf`` rollout engine (entry point group ``core_rl.rollout_engines``).

Importing this module does not import transformers; the engine loads it when it is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from core_rl.hookspecs import Register, hookimpl

from core_rl_hf.config import HFRolloutConfig

if TYPE_CHECKING:
    from core_rl.config.schema import RolloutConfig

    from core_rl_hf.engine import HFRolloutEngine


def make_engine(
    rollout: RolloutConfig,
    engine_config: HFRolloutConfig | None,
    *,
    model_path: str,
    run_dir: Path | None = None,
    trust_remote_code: bool = False,
) -> HFRolloutEngine:
    """The registered factory (:func:`core_rl_hf.engine.make_engine`), importing the engine, and
    with it torch and transformers, only when a run builds it."""
    from core_rl_hf.engine import make_engine as build

    return build(rollout, engine_config, model_path=model_path, run_dir=run_dir, trust_remote_code=trust_remote_code)


@hookimpl
def core_rl_register_rollout_engines(register: Register) -> None:
    register(
        "hf",
        make_engine,
        description="In-process transformers generation with a KV cache (embedded, no server)",
        config_cls=HFRolloutConfig,
    )
