"""Hook implementations of core-rl-dpo: registration only (no torch import)."""

from __future__ import annotations

from typing import Any

from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import AlgorithmRecipe, TrainingLoop

from core_rl_dpo.config import DPOConfig, KTOConfig


def make_dpo_loop(cfg: Any, host: Any, *, stop: Any, data_rows: Any, config: DPOConfig) -> TrainingLoop:
    """factory: the preference-optimisation loop (:mod:`core_rl_dpo.loop`; torch is imported there)."""
    from core_rl_dpo.loop import DPOLoop

    return DPOLoop(cfg, host, stop=stop, data_rows=data_rows, config=config)


def make_kto_loop(cfg: Any, host: Any, *, stop: Any, data_rows: Any, config: KTOConfig) -> TrainingLoop:
    """factory: the Kahneman-Tversky optimisation loop (:mod:`core_rl_dpo.kto`; torch is imported there)."""
    from core_rl_dpo.kto import KTOLoop

    return KTOLoop(cfg, host, stop=stop, data_rows=data_rows, config=config)


def dpo_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults={"algorithm": {}, "trainer": {"loop": {"name": "dpo", "loss_type": "sigmoid"}}},
        description="Direct preference optimisation (the dpo loop, sigmoid loss) against a frozen reference",
    )


def ipo_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults={"algorithm": {}, "trainer": {"loop": {"name": "dpo", "loss_type": "ipo"}}},
        description="Identity preference optimisation (the dpo loop, squared loss on the log-ratio margin)",
    )


def simpo_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults={
            "algorithm": {},
            "trainer": {"loop": {"name": "dpo", "loss_type": "simpo", "reference": "none", "beta": 2.0}},
        },
        description="SimPO (the dpo loop without a reference: margin of length-normalised log-probs, beta 2)",
    )


def orpo_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults={"algorithm": {}, "trainer": {"loop": {"name": "dpo", "loss_type": "orpo", "reference": "none"}}},
        description="ORPO (the dpo loop without a reference: chosen NLL plus an odds-ratio term)",
    )


def kto_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults={"algorithm": {}, "trainer": {"loop": {"name": "kto"}}},
        description="KTO (the kto loop: unpaired completions labelled desirable or undesirable, against a reference)",
    )


@hookimpl
def core_rl_register_loops(register: Register) -> None:
    register(
        "dpo",
        make_dpo_loop,
        description="Pairwise preference optimisation (sigmoid/IPO/hinge against a reference; SimPO/ORPO without one)",
        config_cls=DPOConfig,
    )
    register(
        "kto",
        make_kto_loop,
        description="Kahneman-Tversky optimisation on unpaired (prompt, completion, label) rows against a reference",
        config_cls=KTOConfig,
    )


@hookimpl
def core_rl_register_algorithms(register: Register) -> None:
    register("dpo", dpo_recipe, description=dpo_recipe().description)
    register("ipo", ipo_recipe, description=ipo_recipe().description)
    register("simpo", simpo_recipe, description=simpo_recipe().description)
    register("orpo", orpo_recipe, description=orpo_recipe().description)
    register("kto", kto_recipe, description=kto_recipe().description)
