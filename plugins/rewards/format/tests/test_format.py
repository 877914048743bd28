"""The ``format`` reward: conformance kit, tag structure, patterns, partial credit, config errors."""

from __future__ import annotations

from typing import Any, ClassVar

import core_rl_reward_format.plugin
import pytest
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.protocol import RewardInput
from core_rl.testing import RewardContract, make_reward_input
from core_rl_reward_format import FormatConfig, FormatReward, tag_structure_ok


class TestTagsContract(RewardContract):
    plugin = core_rl_reward_format.plugin
    name = "format"
    distribution = "core-rl-reward-format"
    options: ClassVar[dict[str, Any]] = {"tags": ["think", "answer"]}
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("<think>hmm</think>\n<answer>4</answer>"), 1.0),
        (make_reward_input("<answer>4</answer><think>hmm</think>"), 0.0),  # wrong order
        (make_reward_input("<think>hmm</think> so <answer>4</answer>"), 0.0),  # text outside
        (make_reward_input("<think></think><answer>4</answer>"), 0.0),  # empty think
        (make_reward_input("<think>a</think><answer>4</answer><answer>5</answer>"), 0.0),  # twice
        (make_reward_input(""), 0.0),
    ]


class TestPatternsPartialContract(RewardContract):
    plugin = core_rl_reward_format.plugin
    name = "format"
    distribution = "core-rl-reward-format"
    options: ClassVar[dict[str, Any]] = {
        "patterns": ["\\\\boxed\\{", "^therefore"],
        "fullmatch": ".*\\.",
        "flags": ["IGNORECASE", "MULTILINE", "DOTALL"],
        "partial_credit": True,
    }
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("x\nTherefore \\boxed{2}."), 1.0),
        (make_reward_input("x\nTherefore \\boxed{2}"), 2 / 3),
        (make_reward_input("so 2."), 1 / 3),
        (make_reward_input("so 2", finish_reason="length"), 0.0),  # require_stop is off: 0 checks pass
    ]


@pytest.mark.parametrize(
    ("text", "allow", "expected"),
    [
        ("<a>1</a><b>2</b>", False, True),
        ("  <a>1</a>\n <b>2</b>\n", False, True),
        ("pre <a>1</a><b>2</b> post", False, False),
        ("pre <a>1</a><b>2</b> post", True, True),
        ("<a>1</a>", False, False),  # missing <b>
        ("<a>1<b>2</b></a>", True, False),  # b nested in a: b does not follow a's close
        ("<a>1</a></b>2<b>", True, False),  # closing before opening
        ("<a> </a><b>2</b>", False, False),  # blank content
    ],
)
def test_tag_structure(text, allow, expected):
    assert tag_structure_ok(text, ["a", "b"], allow_outside_text=allow) is expected


def test_require_stop_and_parts():
    reward = FormatReward(structure({"fullmatch": "[a-f]{3,4}", "require_stop": True}, FormatConfig, path="reward"))
    items = [
        make_reward_input("abc"),
        make_reward_input(" dcba\n"),
        make_reward_input("abcg"),
        make_reward_input("abc", finish_reason="length"),
    ]
    result = reward.score_with_parts(items)
    assert result.scores == [1.0, 1.0, 0.0, 0.0]
    assert result.parts == {"checks_passed": [1.0, 1.0, 0.0, 1.0]}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"patterns": ["ok", "(unclosed"]}, "reward.patterns[1]: must be a valid regular expression"),
        ({"fullmatch": "*"}, "reward.fullmatch: must be a valid regular expression"),
        ({"tags": ["think", "<answer>"]}, "reward.tags: must be tag names like 'think'"),
        ({"patterns": ["x"], "flags": ["VERBOSE"]}, "reward.flags: must only name IGNORECASE, MULTILINE, DOTALL"),
        ({}, "reward.tags: or patterns or fullmatch must be set"),
        ({"patterns": "x"}, "reward.patterns: expected a list"),
    ],
)
def test_invalid_options(options, message):
    with pytest.raises(ConfigError) as info:
        structure(options, FormatConfig, path="reward")
    assert any(p.startswith(message) for p in info.value.problems), info.value.problems
