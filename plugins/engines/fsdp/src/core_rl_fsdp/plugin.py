"""Registers the ``fsdp`` train engine (heavy imports happen only when an engine is built)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core_rl.hookspecs import Register, hookimpl

from core_rl_fsdp.config import FSDPConfig

if TYPE_CHECKING:
    from core_rl.config.schema import ActorConfig

    from core_rl_fsdp.engine import FSDPEngine


def build_engine(
    actor: ActorConfig, engine_config: FSDPConfig | None, *, trainable: bool, head: str = "lm"
) -> FSDPEngine:
    """The factory core-rl calls: an :class:`~core_rl_fsdp.engine.FSDPEngine` for ``actor`` (or any
    role section); ``head="value"`` builds a value model (a critic)."""
    from core_rl_fsdp.engine import FSDPEngine

    return FSDPEngine(actor, engine_config, trainable=trainable, head=head)


@hookimpl
def core_rl_register_train_engines(register: Register) -> None:
    register(
        "fsdp",
        build_engine,
        description="PyTorch FSDP2 (fully_shard) on Hugging Face models; CPU/gloo and GPU/NCCL",
        config_cls=FSDPConfig,
    )
