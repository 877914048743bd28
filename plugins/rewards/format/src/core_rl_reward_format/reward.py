"""The ``format`` reward: does a response have the required shape?

Checks (each passes or fails):

- ``tags`` (e.g. ``[think, answer]``): the response is ``<think>...</think>`` then
  ``<answer>...</answer>``, each tag pair exactly once, in this order, with non-empty content;
  with ``allow_outside_text: false`` nothing but whitespace may stand outside the tags;
- each of ``patterns``: the regex is found in the response (``re.search``);
- ``fullmatch``: the whole response (stripped) matches this regex.

``score = 1.0`` if every configured check passes, else ``0.0``; with ``partial_credit``,
``score = passed / checks``. A response that hit the length limit scores 0 with ``require_stop``.
Parts: ``checks_passed`` (the fraction of checks passed).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import attrs
from core_rl.config.validators import FieldValueError
from core_rl.interfaces import Reward, RewardScores
from core_rl.protocol import RewardInput

_FLAGS = {"IGNORECASE": re.IGNORECASE, "MULTILINE": re.MULTILINE, "DOTALL": re.DOTALL}
_TAG_NAME = re.compile(r"^[A-Za-z_][\w.-]*$")


def _compile(pattern: str, flags: int, field: str, value: Any) -> re.Pattern[str]:
    try:
        return re.compile(pattern, flags)
    except re.error as exc:
        raise FieldValueError(field, value, f"must be a valid regular expression ({exc})") from None


@attrs.define
class FormatConfig:
    """See the module docstring. ``flags``: regex flags for ``patterns`` and ``fullmatch``
    (``IGNORECASE``, ``MULTILINE``, ``DOTALL``)."""

    tags: list[str] = attrs.field(factory=list)
    allow_outside_text: bool = False
    patterns: list[str] = attrs.field(factory=list)
    fullmatch: str | None = None
    flags: list[str] = attrs.field(factory=list)
    partial_credit: bool = False
    require_stop: bool = False

    def __attrs_post_init__(self) -> None:
        unknown = [f for f in self.flags if f not in _FLAGS]
        if unknown:
            raise FieldValueError("flags", self.flags, f"must only name {', '.join(_FLAGS)} (unknown: {unknown})")
        bad_tags = [t for t in self.tags if not _TAG_NAME.match(t)]
        if bad_tags:
            raise FieldValueError("tags", self.tags, f"must be tag names like 'think' (not {bad_tags})")
        self.compile()
        if not (self.tags or self.patterns or self.fullmatch is not None):
            raise FieldValueError("tags", self.tags, "or patterns or fullmatch must be set (nothing to check)")

    def compile(self) -> tuple[list[re.Pattern[str]], re.Pattern[str] | None]:
        """The compiled ``patterns`` and ``fullmatch`` (a bad regex is a :class:`FieldValueError`)."""
        flags = 0
        for f in self.flags:
            flags |= _FLAGS[f]
        patterns = [_compile(p, flags, f"patterns[{i}]", p) for i, p in enumerate(self.patterns)]
        full = None if self.fullmatch is None else _compile(self.fullmatch, flags, "fullmatch", self.fullmatch)
        return patterns, full


def tag_structure_ok(text: str, tags: Sequence[str], *, allow_outside_text: bool = False) -> bool:
    """Whether ``text`` holds ``<t>...</t>`` for each of ``tags``, in order, each exactly once,
    each with non-blank content; without ``allow_outside_text`` only whitespace may stand
    before, between and after them."""
    position = 0
    outside: list[str] = []
    for tag in tags:
        opening, closing = f"<{tag}>", f"</{tag}>"
        if text.count(opening) != 1 or text.count(closing) != 1:
            return False
        start = text.find(opening, position)
        end = text.find(closing, start + len(opening)) if start >= 0 else -1
        if start < 0 or end < 0 or not text[start + len(opening) : end].strip():
            return False
        outside.append(text[position:start])
        position = end + len(closing)
    outside.append(text[position:])
    return allow_outside_text or not "".join(outside).strip()


class FormatReward(Reward):
    """See the module docstring."""

    def __init__(self, config: FormatConfig) -> None:
        self.config = config
        self.patterns, self.full = config.compile()

    def checks(self, text: str) -> list[bool]:
        """The result of each configured check, in order: tags, patterns, fullmatch."""
        cfg = self.config
        results = []
        if cfg.tags:
            results.append(tag_structure_ok(text, cfg.tags, allow_outside_text=cfg.allow_outside_text))
        results.extend(p.search(text) is not None for p in self.patterns)
        if self.full is not None:
            results.append(self.full.fullmatch(text.strip()) is not None)
        return results

    def score_with_parts(self, items: Sequence[RewardInput]) -> RewardScores:
        scores, fractions = [], []
        for item in items:
            checks = self.checks(item.response_text)
            fraction = sum(checks) / len(checks)
            fractions.append(fraction)
            if self.config.require_stop and item.finish_reason != "stop":
                scores.append(0.0)
            elif self.config.partial_credit:
                scores.append(fraction)
            else:
                scores.append(1.0 if all(checks) else 0.0)
        return RewardScores(scores=scores, parts={"checks_passed": fractions})

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return self.score_with_parts(items).scores
