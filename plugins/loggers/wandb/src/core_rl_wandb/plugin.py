"""Registration of the ``wandb`` logger (entry point group ``core_rl.loggers``); imports no wandb."""

from __future__ import annotations

import attrs
from core_rl.config.validators import one_of
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Logger


@attrs.define
class WandbConfig:
    """See the package README."""

    project: str = "core-rl"
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    tags: list[str] = attrs.field(factory=list)
    mode: str = attrs.field(default="offline", validator=one_of(("online", "offline", "disabled")))
    dir: str | None = None


def make_wandb_logger(config: WandbConfig) -> Logger:
    from core_rl_wandb.logger import WandbLogger

    return WandbLogger(config)


@hookimpl
def core_rl_register_loggers(register: Register) -> None:
    register(
        "wandb",
        make_wandb_logger,
        description="Weights & Biases: metrics and sample tables (online, offline or disabled)",
        config_cls=WandbConfig,
    )
