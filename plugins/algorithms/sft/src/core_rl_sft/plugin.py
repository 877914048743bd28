"""Hook implementations of core-rl-sft: registration only (no torch import)."""

from __future__ import annotations

from typing import Any

from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import AlgorithmRecipe, TrainingLoop

from core_rl_sft.config import SFTConfig


def make_sft_loop(cfg: Any, host: Any, *, stop: Any, data_rows: Any, config: SFTConfig) -> TrainingLoop:
    """factory: the supervised fine-tuning loop (:mod:`core_rl_sft.loop`; torch is imported there)."""
    from core_rl_sft.loop import SFTLoop

    return SFTLoop(cfg, host, stop=stop, data_rows=data_rows, config=config)


def sft_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults={"algorithm": {}, "trainer": {"loop": {"name": "sft"}}},
        description="Supervised fine-tuning (the sft loop): negative log-likelihood of the responses",
    )


@hookimpl
def core_rl_register_loops(register: Register) -> None:
    register(
        "sft",
        make_sft_loop,
        description="Supervised fine-tuning: response-token NLL with prompt masking",
        config_cls=SFTConfig,
    )


@hookimpl
def core_rl_register_algorithms(register: Register) -> None:
    register("sft", sft_recipe, description=sft_recipe().description)
