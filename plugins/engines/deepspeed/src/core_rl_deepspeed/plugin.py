"""Registers the ``deepspeed`` train engine (DeepSpeed itself is imported only when an engine is built)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core_rl.hookspecs import Register, hookimpl

from core_rl_deepspeed.config import DeepSpeedConfig

if TYPE_CHECKING:
    from core_rl.config.schema import ActorConfig

    from core_rl_deepspeed.engine import DeepSpeedEngine


def build_engine(
    actor: ActorConfig, engine_config: DeepSpeedConfig | None, *, trainable: bool, head: str = "lm"
) -> DeepSpeedEngine:
    """The factory core-rl calls: a :class:`~core_rl_deepspeed.engine.DeepSpeedEngine` for ``actor``
    (or any role section); ``head="value"`` builds a value model (a critic)."""
    from core_rl_deepspeed.engine import DeepSpeedEngine

    return DeepSpeedEngine(actor, engine_config, trainable=trainable, head=head)


@hookimpl
def core_rl_register_train_engines(register: Register) -> None:
    register(
        "deepspeed",
        build_engine,
        description="DeepSpeed ZeRO stages 1/2/3 on Hugging Face models; CPU/gloo and GPU/NCCL",
        config_cls=DeepSpeedConfig,
    )
