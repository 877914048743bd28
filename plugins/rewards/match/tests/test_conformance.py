"""The core conformance kit run against ``exact_match`` and ``char_match``, with hand-computed scores."""

from __future__ import annotations

from typing import Any, ClassVar

import core_rl_reward_match.plugin
from core_rl.protocol import RewardInput
from core_rl.testing import RewardContract, make_reward_input

ROW = {"prompt": "12+30=", "answer": "42"}


class TestExactMatch(RewardContract):
    plugin = core_rl_reward_match.plugin
    name = "exact_match"
    distribution = "core-rl-reward-match"
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("42", ROW), 1.0),
        (make_reward_input("  42\n", ROW), 1.0),  # strip is on by default
        (make_reward_input("43", ROW), 0.0),
        (make_reward_input("420", ROW), 0.0),
        (make_reward_input("4", ROW), 0.0),
        (make_reward_input("", ROW), 0.0),
        (make_reward_input("42", ROW, finish_reason="length"), 1.0),  # require_stop is off by default
        (make_reward_input("7", {"answer": 7}), 1.0),  # non-string answers compare as str(value)
        (make_reward_input("Yes", {"answer": "yes"}), 0.0),  # case-sensitive by default
    ]


class TestExactMatchNormalised(RewardContract):
    plugin = core_rl_reward_match.plugin
    name = "exact_match"
    distribution = "core-rl-reward-match"
    options: ClassVar[dict[str, Any]] = {
        "answer_key": "label",
        "case_sensitive": False,
        "stop_at": ["\n", "."],
        "require_stop": True,
    }
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("YES\nbecause", {"label": " yes "}), 1.0),
        (make_reward_input("yes. and more", {"label": "Yes"}), 1.0),
        (make_reward_input("no\nyes", {"label": "yes"}), 0.0),
        (make_reward_input("yes", {"label": "yes"}, finish_reason="length"), 0.0),
        (make_reward_input("\nyes", {"label": ""}), 1.0),  # cut to "" before the first newline
    ]


class TestCharMatch(RewardContract):
    plugin = core_rl_reward_match.plugin
    name = "char_match"
    distribution = "core-rl-reward-match"
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("42", ROW), 1.0),
        (make_reward_input("43", ROW), 0.5),  # 1 of 2 positions
        (make_reward_input("4", ROW), 0.5),  # 1 / max(2, 1)
        (make_reward_input("4200", ROW), 0.5),  # 2 / max(2, 4)
        (make_reward_input("24", ROW), 0.0),
        (make_reward_input("", ROW), 0.0),  # 0 / 2
        (make_reward_input("abcd", {"answer": "abxd"}), 0.75),
        (make_reward_input("abc", {"answer": "xbcde"}), 0.4),  # 2 / 5
        (make_reward_input(" 42 ", ROW), 1.0),
        (make_reward_input("  ", {"answer": ""}), 1.0),  # both empty after strip
    ]


class TestCharMatchNormalised(RewardContract):
    plugin = core_rl_reward_match.plugin
    name = "char_match"
    distribution = "core-rl-reward-match"
    options: ClassVar[dict[str, Any]] = {
        "strip": False,
        "case_sensitive": False,
        "stop_at": ["\n"],
        "require_stop": True,
    }
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("AbC\nzzz", {"answer": "abc"}), 1.0),
        (make_reward_input(" abc", {"answer": "abc"}), 0.0),  # no strip: every position shifted, 0 / 4
        (make_reward_input("abc ", {"answer": "abc"}), 0.75),  # 3 / 4
        (make_reward_input("abc", {"answer": "abc"}, finish_reason="length"), 0.0),
    ]
