"""Registration of the ``trackio`` logger (entry point group ``core_rl.loggers``); imports no trackio."""

from __future__ import annotations

import attrs
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Logger


@attrs.define
class TrackioConfig:
    """See the package README."""

    project: str = "core-rl"
    name: str | None = None
    group: str | None = None
    log_dir: str | None = None
    space_id: str | None = None


def make_trackio_logger(config: TrackioConfig) -> Logger:
    from core_rl_trackio.logger import TrackioLogger

    return TrackioLogger(config)


@hookimpl
def core_rl_register_loggers(register: Register) -> None:
    register(
        "trackio",
        make_trackio_logger,
        description="Trackio: metrics and sample tables in a local project database (optionally synced to a Space)",
        config_cls=TrackioConfig,
    )
