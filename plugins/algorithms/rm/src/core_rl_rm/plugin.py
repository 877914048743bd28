"""Hook implementations of core-rl-rm: registration only (no torch import)."""

from __future__ import annotations

from typing import Any

from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import AlgorithmRecipe, TrainingLoop

from core_rl_rm.config import RMConfig


def make_rm_loop(cfg: Any, host: Any, *, stop: Any, data_rows: Any, config: RMConfig) -> TrainingLoop:
    """factory: the reward-model training loop (:mod:`core_rl_rm.loop`; torch is imported there)."""
    from core_rl_rm.loop import RMLoop

    return RMLoop(cfg, host, stop=stop, data_rows=data_rows, config=config)


def rm_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults={"algorithm": {}, "trainer": {"loop": {"name": "rm"}}},
        description="Reward-model training (the rm loop): pairwise Bradley-Terry loss on a scalar score head",
    )


@hookimpl
def core_rl_register_loops(register: Register) -> None:
    register(
        "rm",
        make_rm_loop,
        description="Pairwise Bradley-Terry reward-model training; exports a sequence-classification model",
        config_cls=RMConfig,
    )


@hookimpl
def core_rl_register_algorithms(register: Register) -> None:
    register("rm", rm_recipe, description=rm_recipe().description)
