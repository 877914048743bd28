"""The ``reward`` section of ``remote`` (no heavy imports)."""

from __future__ import annotations

import re
from typing import Any

import attrs
from core_rl.config.validators import FieldValueError, in_range, non_negative, positive

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FIELDS = ("prompt", "response", "row", "finish_reason", "prompt_ids", "response_ids", "info", "workflow_reward")


def _url(_inst: Any, attribute: attrs.Attribute, value: str) -> None:
    if not value.startswith(("http://", "https://")):
        raise FieldValueError(attribute.name, value, "must be an http:// or https:// URL")


def _env_name(_inst: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and not _ENV_NAME.match(value):
        raise FieldValueError(
            attribute.name,
            "<hidden>",
            "must be the NAME of an environment variable holding the token (letters, digits, _), "
            "never the token itself",
        )


def _fields(_inst: Any, attribute: attrs.Attribute, value: list[str]) -> None:
    unknown = [v for v in value if v not in FIELDS]
    if unknown or not value:
        raise FieldValueError(attribute.name, value, f"must list some of {', '.join(FIELDS)}")


@attrs.define
class RemoteConfig:
    """See the package README."""

    url: str = attrs.field(default="http://127.0.0.1:8000/score", validator=_url)
    batch_size: int = attrs.field(default=64, validator=positive())
    max_concurrent_requests: int = attrs.field(default=4, validator=in_range(1, 256))
    timeout_s: float = attrs.field(default=30.0, validator=positive())
    max_retries: int = attrs.field(default=3, validator=non_negative())
    backoff_s: float = attrs.field(default=0.5, validator=non_negative())
    backoff_max_s: float = attrs.field(default=10.0, validator=non_negative())
    auth_env: str | None = attrs.field(default=None, validator=_env_name)
    auth_header: str = "Authorization"
    auth_scheme: str = "Bearer"
    fields: list[str] = attrs.field(factory=lambda: ["prompt", "response", "row", "finish_reason"], validator=_fields)
