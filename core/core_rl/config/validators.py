"""attrs validators for configuration classes, the core's and every plugin's.

Each raises :class:`FieldValueError` naming the field, so the loader can report the full key path
(``actor.optimizer.lr: must be in (0, 10], got 50.0``). Numeric validators also refuse NaN and
infinities, and the loader refuses them for every ``float`` field before any validator runs.

Bounds shared across config classes, so that sizes are bounded by what can exist rather than by
the memory that runs out minutes into a run:

- :data:`MAX_STEPS`: optimiser steps, checkpoint intervals, warm-up lengths;
- :data:`MAX_COUNT`: counts of prompts, samples and sequences (batch sizes, group sizes);
- :data:`MAX_TOKENS`: token lengths (prompt and response lengths, micro-batch token budgets);
- :data:`MAX_SEED`: seeds (every RNG core-rl seeds accepts ``[0, 2**32 - 1]``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import PurePath
from typing import Any

import attrs

MAX_STEPS = 10**9
MAX_COUNT = 2**20
MAX_TOKENS = 2**24
MAX_SEED = 2**32 - 1


class FieldValueError(ValueError):
    """A field holds a value out of range; ``field`` is its name, ``value`` the offending value."""

    def __init__(self, field: str, value: Any, requirement: str) -> None:
        self.field = field
        self.value = value
        self.requirement = requirement
        super().__init__(f"{field}: {requirement}, got {value!r}")


Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _is_finite_number(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def _check(pred: Callable[[Any], bool], requirement: str, *, numeric: bool = True) -> Validator:
    def validate(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if numeric and not _is_finite_number(value):
            raise FieldValueError(attribute.name, value, f"must be a finite number ({requirement})")
        if not pred(value):
            raise FieldValueError(attribute.name, value, requirement)

    return described(validate, requirement)


def described(validator: Validator, requirement: str) -> Validator:
    """``validator`` with its ``requirement`` in words attached, which the configuration reference
    (:mod:`core_rl.config.reference`) shows beside the key."""
    validator.requirement = requirement  # type: ignore[attr-defined]
    return validator


def _bracket(low: float, high: float, low_open: bool, high_open: bool) -> str:
    return f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def finite() -> Validator:
    """Any finite number (not NaN, not an infinity)."""
    return _check(lambda _v: True, "any finite number")


def in_range(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Validator:
    """``low <= value <= high``; ``low_open`` / ``high_open`` make that end strict."""

    def ok(v: float) -> bool:
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

    return _check(ok, f"must be in {_bracket(low, high, low_open, high_open)}")


def positive(high: float | None = None) -> Validator:
    """``value > 0`` (and ``<= high`` when given)."""
    if high is not None:
        return in_range(0, high, low_open=True)
    return _check(lambda v: v > 0, "must be > 0")


def non_negative(high: float | None = None) -> Validator:
    """``value >= 0`` (and ``<= high`` when given)."""
    if high is not None:
        return in_range(0, high)
    return _check(lambda v: v >= 0, "must be >= 0")


def one_of(choices: Sequence[str]) -> Validator:
    """One of ``choices`` (compared with ``==``)."""
    return _check(lambda v: v in choices, f"must be one of {', '.join(map(repr, choices))}", numeric=False)


def auto_or(validator: Validator) -> Validator:
    """The string ``auto`` (a value chosen when the run starts), or a value ``validator`` accepts."""

    def validate(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value != "auto":
            validator(inst, attribute, value)

    inner = getattr(validator, "requirement", "")
    return described(validate, f"'auto', or {inner.removeprefix('must be ')}" if inner else "'auto' or a value")


def not_empty() -> Validator:
    """A non-empty string (or collection)."""
    return _check(lambda v: len(v) > 0, "must not be empty", numeric=False)


def each(validator: Validator) -> Validator:
    """Apply ``validator`` to every item of a list or tuple; the error names the item
    (``betas[1]``)."""

    def validate(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        for i, item in enumerate(value):
            try:
                validator(inst, attribute, item)
            except FieldValueError as exc:
                raise FieldValueError(f"{attribute.name}[{i}]", item, exc.requirement) from None

    inner = getattr(validator, "requirement", "")
    return described(validate, f"each item {inner.removeprefix('must be ')}" if inner else "")


def regular_expression() -> Validator:
    """A non-empty regular expression (an empty one would match everything)."""

    def validate(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not value:
            raise FieldValueError(attribute.name, value, "must not be empty (it would match everything)")
        try:
            re.compile(value)
        except re.error as exc:
            raise FieldValueError(attribute.name, value, f"must be a regular expression ({exc})") from None

    return described(validate, "must be a non-empty regular expression")


def inside_directory() -> Validator:
    """A relative path that stays inside the directory it is joined to: not empty, not absolute,
    no ``..`` component (``team/run1`` is fine, ``../x`` and ``/tmp/x`` are not)."""

    def ok(value: str) -> bool:
        path = PurePath(value)
        return "\0" not in value and not path.is_absolute() and bool(path.parts) and ".." not in path.parts

    return _check(
        ok, "must be a relative path that stays inside the output directory (no '..', not absolute)", numeric=False
    )
