"""Registration of the ``swanlab`` logger (entry point group ``core_rl.loggers``); imports no swanlab."""

from __future__ import annotations

import attrs
from core_rl.config.validators import one_of
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Logger

#: core-rl's mode names -> swanlab's
MODES = {"cloud": "online", "local": "local", "offline": "offline", "disabled": "disabled"}


@attrs.define
class SwanlabConfig:
    """See the package README."""

    project: str = "core-rl"
    experiment_name: str | None = None
    workspace: str | None = None
    mode: str = attrs.field(default="offline", validator=one_of(tuple(MODES)))
    log_dir: str | None = None
    tags: list[str] = attrs.field(factory=list)
    description: str | None = None
    system_monitor: bool = False


def make_swanlab_logger(config: SwanlabConfig) -> Logger:
    from core_rl_swanlab.logger import SwanlabLogger

    return SwanlabLogger(config)


@hookimpl
def core_rl_register_loggers(register: Register) -> None:
    register(
        "swanlab",
        make_swanlab_logger,
        description="SwanLab: metrics and sample tables (cloud, local, offline or disabled; log_dir)",
        config_cls=SwanlabConfig,
    )
