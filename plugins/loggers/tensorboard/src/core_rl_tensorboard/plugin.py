"""Registration of the ``tensorboard`` logger (entry point group ``core_rl.loggers``); imports no torch."""

from __future__ import annotations

import attrs
from core_rl.config.validators import positive
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Logger


@attrs.define
class TensorboardConfig:
    """``log_dir``: default ``<run dir>/tensorboard``; ``flush_secs``: how often events reach disk."""

    log_dir: str | None = None
    flush_secs: int = attrs.field(default=30, validator=positive())


def make_tensorboard_logger(config: TensorboardConfig) -> Logger:
    from core_rl_tensorboard.logger import TensorboardLogger

    return TensorboardLogger(config)


@hookimpl
def core_rl_register_loggers(register: Register) -> None:
    register(
        "tensorboard",
        make_tensorboard_logger,
        description="TensorBoard event files: metrics as scalars, samples as a text table",
        config_cls=TensorboardConfig,
    )
