"""The ``reward`` section of ``math`` (no heavy imports)."""

from __future__ import annotations

from typing import Any

import attrs
from core_rl.config.validators import FieldValueError, in_range, positive

#: answer extraction strategies, see :func:`core_rl_reward_math.extract.extract_answer`
STRATEGIES = ("boxed", "answer_is", "last_number")


def _strategies(_inst: Any, attribute: attrs.Attribute, value: list[str]) -> None:
    if not value:
        raise FieldValueError(attribute.name, value, f"must list at least one of {', '.join(STRATEGIES)}")
    unknown = [v for v in value if v not in STRATEGIES]
    if unknown:
        raise FieldValueError(attribute.name, value, f"must only name {', '.join(STRATEGIES)} (unknown: {unknown})")


@attrs.define
class MathConfig:
    """See the package README. ``extract``: strategies tried in order, the first that finds an
    answer wins; ``timeout_s``: wall time allowed to verify one item (its worker is killed and
    the item scores 0 past it); ``num_workers``: verifier processes; ``float_rounding`` and
    ``strict``: passed to math-verify's ``verify``."""

    answer_key: str = "answer"
    extract: list[str] = attrs.field(factory=lambda: list(STRATEGIES), validator=_strategies)
    timeout_s: float = attrs.field(default=5.0, validator=positive())
    num_workers: int = attrs.field(default=1, validator=in_range(1, 64))
    float_rounding: int = attrs.field(default=6, validator=in_range(0, 15))
    strict: bool = True

    def required_columns(self) -> list[str]:
        """Every data row must hold the reference answer (checked before the run starts)."""
        return [self.answer_key]
