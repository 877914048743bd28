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
class HTTPServiceConfig:
    """The keys of one HTTP service (:class:`core_rl_reward_remote.http_service.HTTPService`):
    concurrency, timeout, retries with back-off, and the auth token's environment variable."""

    max_concurrent_requests: int = attrs.field(default=4, validator=in_range(1, 256))
    timeout_s: float = attrs.field(default=30.0, validator=positive())
    max_retries: int = attrs.field(default=3, validator=non_negative())
    backoff_s: float = attrs.field(default=0.5, validator=non_negative())
    backoff_max_s: float = attrs.field(default=10.0, validator=non_negative())
    auth_env: str | None = attrs.field(default=None, validator=_env_name)
    auth_header: str = "Authorization"
    auth_scheme: str = "Bearer"


@attrs.define
class RemoteConfig(HTTPServiceConfig):
    """See the package README."""

    url: str = attrs.field(default="http://127.0.0.1:8000/score", validator=_url)
    batch_size: int = attrs.field(default=64, validator=positive())
    fields: list[str] = attrs.field(factory=lambda: ["prompt", "response", "row", "finish_reason"], validator=_fields)


#: the fields a ``judge`` prompt may name: the prompt, the response and the row's reference answer
JUDGE_FIELDS = ("prompt", "response", "answer")
DEFAULT_JUDGE_PROMPT = (
    "Rate the response to the question from 0 (wrong or useless) to 10 (correct and helpful).\n\n"
    "Question:\n{prompt}\n\nResponse:\n{response}\n\nEnd your reply with 'Score: <number>'."
)


def _template_fields(template: str) -> list[str]:
    """The ``{name}`` fields of a ``str.format`` template."""
    import string

    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


@attrs.define
class JudgeConfig(HTTPServiceConfig):
    """See the package README: one chat completion per response from an OpenAI-compatible
    endpoint (``url`` up to ``/v1``; ``model``), asked with ``prompt`` (``{prompt}``,
    ``{response}``, ``{answer}``: the row's ``answer_key``) after an optional ``system`` message,
    at ``temperature`` with at most ``max_tokens``; the score is the ``score_pattern`` match
    (its first group; the ``last`` or ``first`` match in the reply) mapped from
    ``[min_score, max_score]`` to ``[0, 1]`` and clipped there."""

    url: str = attrs.field(default="http://127.0.0.1:8000/v1", validator=_url)
    model: str = attrs.field(default="judge")
    prompt: str = attrs.field(default=DEFAULT_JUDGE_PROMPT)
    system: str | None = None
    answer_key: str | None = None
    temperature: float = attrs.field(default=0.0, validator=in_range(0.0, 2.0))
    max_tokens: int = attrs.field(default=512, validator=positive())
    score_pattern: str = attrs.field(default=r"Score:\s*(-?\d+(?:\.\d+)?)")
    score_match: str = attrs.field(default="last", validator=attrs.validators.in_(("last", "first")))
    min_score: float = 0.0
    max_score: float = 10.0

    def __attrs_post_init__(self) -> None:
        unknown = [f for f in _template_fields(self.prompt) if f not in JUDGE_FIELDS]
        if unknown:
            raise FieldValueError("prompt", self.prompt[:60], f"names {unknown}; it may name {', '.join(JUDGE_FIELDS)}")
        if "answer" in _template_fields(self.prompt) and self.answer_key is None:
            raise FieldValueError("answer_key", None, "must name the row's column of reference answers ({answer})")
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as exc:
            raise FieldValueError("score_pattern", self.score_pattern, f"is not a regular expression: {exc}") from None
        if groups != 1:
            raise FieldValueError("score_pattern", self.score_pattern, "must have exactly one group: the number")
        if not self.max_score > self.min_score:
            raise FieldValueError("max_score", self.max_score, f"must be above min_score ({self.min_score})")

    def required_columns(self) -> list[str]:
        """The row columns the judge reads (the reference answer, when the prompt shows it)."""
        return [self.answer_key] if self.answer_key is not None else []
