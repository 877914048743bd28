"""``keyword_reward``: the fraction of required keywords a response mentions.

For each sample the required keywords are the configured ``keywords`` plus, when ``row_key`` is set,
those in that column of the sample's data row (a string or a list of strings), with duplicates
removed (case-insensitively unless ``case_sensitive``). A keyword is found when it occurs in the
response text; with ``whole_words`` (the default) it must not be preceded or followed by a letter,
digit or underscore, so ``paris`` matches ``"Paris."`` but not ``"parisian"``. The score is::

    mode: fraction   ->  (keywords found) / (keywords required)
    mode: all        ->  1.0 if every keyword is found, else 0.0

A sample with no required keywords (an empty list in its row, and none configured) scores 1.0.
Scores are in ``[0, 1]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from core_rl.errors import DataError
from core_rl.interfaces import Reward
from core_rl.protocol import RewardInput

from core_rl_example_plugin.config import KeywordRewardConfig


class KeywordReward(Reward):
    """Scores each response by the keywords it mentions (see the module docstring for the rule)."""

    def __init__(self, config: KeywordRewardConfig) -> None:
        self.config = config
        self._flags = 0 if config.case_sensitive else re.IGNORECASE
        self._static = self._unique(config.keywords)

    def _key(self, keyword: str) -> str:
        return keyword if self.config.case_sensitive else keyword.casefold()

    def _unique(self, keywords: Sequence[str]) -> list[str]:
        """``keywords`` without duplicates (under the configured case rule), in first-seen order."""
        seen: dict[str, str] = {}
        for keyword in keywords:
            seen.setdefault(self._key(keyword), keyword)
        return list(seen.values())

    def _row_keywords(self, row: Mapping[str, Any]) -> list[str]:
        key = self.config.row_key
        if key is None:
            return []
        if key not in row:
            raise DataError(
                f"keyword_reward: the data row has no column {key!r} (reward.row_key); columns: "
                f"{', '.join(sorted(map(str, row))) or 'none'}"
            )
        value = row[key]
        if isinstance(value, str):
            return [value] if value.strip() else []
        if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
            return [v for v in value if v.strip()]
        raise DataError(f"keyword_reward: column {key!r} must hold a string or a list of strings, got {value!r}")

    def required_keywords(self, item: RewardInput) -> list[str]:
        """The keywords ``item``'s response must mention: configured ones, then its row's."""
        return self._unique([*self._static, *self._row_keywords(item.row)])

    def _found(self, keyword: str, text: str) -> bool:
        pattern = re.escape(keyword)
        if self.config.whole_words:
            pattern = rf"(?<!\w){pattern}(?!\w)"
        return re.search(pattern, text, self._flags) is not None

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        """One score in ``[0, 1]`` per item, in order."""
        scores = []
        for item in items:
            required = self.required_keywords(item)
            if not required:
                scores.append(1.0)
                continue
            found = sum(self._found(keyword, item.response_text) for keyword in required)
            if self.config.mode == "all":
                scores.append(1.0 if found == len(required) else 0.0)
            else:
                scores.append(found / len(required))
        return scores
