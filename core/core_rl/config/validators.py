"""attrs validators whose errors carry the field name, so messages can name the full key path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import PurePath
from typing import Any

import attrs


class FieldValueError(ValueError):
    """A field holds a value out of range; ``field`` is its name, ``value`` the offending value."""

    def __init__(self, field: str, value: Any, requirement: str) -> None:
        self.field = field
        self.value = value
        self.requirement = requirement
        super().__init__(f"{field}: {requirement}, got {value!r}")


Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _check(pred: Callable[[Any], bool], requirement: str) -> Validator:
    def validate(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not pred(value):
            raise FieldValueError(attribute.name, value, requirement)

    return validate


def positive() -> Validator:
    return _check(lambda v: v > 0, "must be > 0")


def non_negative() -> Validator:
    return _check(lambda v: v >= 0, "must be >= 0")


def in_range(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Validator:
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")

    def ok(v: float) -> bool:
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

    return _check(ok, f"must be in {lo}{low}, {high}{hi}")


def one_of(choices: Sequence[str]) -> Validator:
    return _check(lambda v: v in choices, f"must be one of {', '.join(map(repr, choices))}")


def inside_directory() -> Validator:
    """A relative path that stays inside the directory it is joined to: not empty, not absolute,
    no ``..`` component (``team/run1`` is fine, ``../x`` and ``/tmp/x`` are not)."""

    def ok(value: str) -> bool:
        path = PurePath(value)
        return "\0" not in value and not path.is_absolute() and bool(path.parts) and ".." not in path.parts

    return _check(ok, "must be a relative path that stays inside the output directory (no '..', not absolute)")
