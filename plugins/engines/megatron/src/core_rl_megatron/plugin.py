"""Registers the ``megatron`` train engine (megatron-core is imported only when an engine is built)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core_rl.hookspecs import Register, hookimpl

from core_rl_megatron.config import MegatronConfig

if TYPE_CHECKING:
    from core_rl.config.schema import ActorConfig

    from core_rl_megatron.engine import MegatronEngine


def build_engine(
    actor: ActorConfig, engine_config: MegatronConfig | None, *, trainable: bool, head: str = "lm"
) -> MegatronEngine:
    """The factory core-rl calls: a :class:`~core_rl_megatron.engine.MegatronEngine` for ``actor`` (or
    any role section); ``head="value"`` builds a value model (a critic), ``"score"`` a reward model."""
    from core_rl_megatron.engine import MegatronEngine

    return MegatronEngine(actor, engine_config, trainable=trainable, head=head)


@hookimpl
def core_rl_register_train_engines(register: Register) -> None:
    register(
        "megatron",
        build_engine,
        description="Megatron-core GPTModel (tensor/pipeline/context parallel) for Llama and Qwen2/3 checkpoints",
        config_cls=MegatronConfig,
    )
