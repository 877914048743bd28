"""Registration of the ``mlflow`` logger (entry point group ``core_rl.loggers``); imports no mlflow.

Also here, since the configuration checks it: what MLflow accepts as a metric, param or tag name
(:func:`is_mlflow_name`, MLflow's own rule on POSIX, ``mlflow.utils.validation``)."""

from __future__ import annotations

import posixpath
import re
from typing import Any

import attrs
from core_rl.config.validators import FieldValueError, not_empty
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Logger

#: the characters MLflow allows in metric, param and tag names (``\w`` is Unicode, as in MLflow)
NAME_CHARS = r"/\w.\- :"
#: MLflow's limit on the length of a metric, param or tag name
MAX_NAME_LENGTH = 250


def is_mlflow_name(name: str) -> bool:
    """Whether MLflow accepts ``name`` as a metric, param or tag name: not empty, at most 250
    characters, only letters, digits, ``_ - . / :`` and space, and a normalised relative path (no
    empty, ``.`` or ``..`` segment, no leading ``/`` or ``..``)."""
    if not name or len(name) > MAX_NAME_LENGTH or not re.fullmatch(f"[{NAME_CHARS}]*", name):
        return False
    norm = posixpath.normpath(name)
    return norm == name and norm != "." and not norm.startswith(("..", "/"))


def _tag_names(_inst: Any, attribute: attrs.Attribute[Any], value: dict[str, str]) -> None:
    for key in value:
        if not is_mlflow_name(key):
            raise FieldValueError(
                attribute.name,
                key,
                "keys must be MLflow tag names: 1 to 250 letters, digits, '_', '-', '.', '/', ':' or spaces, "
                "a relative path without empty, '.' or '..' parts",
            )


@attrs.define
class MlflowConfig:
    """See the package README."""

    tracking_uri: str | None = attrs.field(default=None, validator=not_empty())
    experiment_name: str | None = attrs.field(default=None, validator=not_empty())
    run_name: str | None = attrs.field(default=None, validator=not_empty())
    tags: dict[str, str] = attrs.field(factory=dict, validator=_tag_names)
    log_config: bool = True
    artifact_location: str | None = attrs.field(default=None, validator=not_empty())


def make_mlflow_logger(config: MlflowConfig) -> Logger:
    from core_rl_mlflow.logger import MlflowLogger

    return MlflowLogger(config)


@hookimpl
def core_rl_register_loggers(register: Register) -> None:
    register(
        "mlflow",
        make_mlflow_logger,
        description="MLflow: metrics, the config as params and sample tables (local sqlite store or a server)",
        config_cls=MlflowConfig,
    )
