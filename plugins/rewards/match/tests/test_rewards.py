"""Normalisation, scoring formulas, configuration and data errors of the match rewards."""

from __future__ import annotations

import pytest
from core_rl.config.loader import structure
from core_rl.errors import ConfigError, DataError
from core_rl.testing import make_reward_input
from core_rl_reward_match.rewards import (
    CharMatchReward,
    ExactMatchReward,
    MatchConfig,
    char_match_score,
    cut_at,
)


def _config(**options: object) -> MatchConfig:
    return structure(options, MatchConfig, path="reward")


@pytest.mark.parametrize(
    ("text", "markers", "expected"),
    [
        ("abc\ndef", ["\n"], "abc"),
        ("a.b\nc", ["\n", "."], "a"),  # the earliest marker wins, whatever its order in the list
        ("a.b\nc", [".", "\n"], "a"),
        ("abc", ["\n"], "abc"),
        ("abc", [], "abc"),
        ("x</a>y</a>", ["</a>"], "x"),  # multi-character markers
    ],
)
def test_cut_at(text: str, markers: list[str], expected: str) -> None:
    assert cut_at(text, markers) == expected


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("", "", 1.0),
        ("", "ab", 0.0),
        ("ab", "", 0.0),
        ("abc", "abc", 1.0),
        ("abd", "abc", 2 / 3),
        ("ab", "abc", 2 / 3),
        ("abcd", "abc", 3 / 4),
        ("cba", "abc", 1 / 3),
    ],
)
def test_char_match_score(response: str, answer: str, expected: float) -> None:
    assert char_match_score(response, answer) == pytest.approx(expected, abs=1e-12)


def test_char_match_is_one_only_on_exact_match() -> None:
    exact, char = ExactMatchReward(), CharMatchReward()
    items = [make_reward_input(r, {"answer": a}) for r in ("", "a", "ab", "ba", "abc") for a in ("", "a", "ab", "abc")]
    for e, c in zip(exact.score(items), char.score(items)):
        assert (c == 1.0) == (e == 1.0)
        assert 0.0 <= c <= 1.0


def test_case_insensitive_uses_casefold() -> None:
    reward = ExactMatchReward(_config(case_sensitive=False))
    assert reward.score([make_reward_input("STRASSE", {"answer": "straße"})]) == [1.0]


def test_stop_at_applies_to_response_only() -> None:
    reward = ExactMatchReward(_config(stop_at=["|"]))
    assert reward.score([make_reward_input("a|b", {"answer": "a|b"}), make_reward_input("a|b", {"answer": "a"})]) == [
        0.0,
        1.0,
    ]


def test_strip_off_keeps_whitespace() -> None:
    reward = ExactMatchReward(_config(strip=False))
    assert reward.score([make_reward_input(" 42", {"answer": "42"}), make_reward_input("42", {"answer": "42"})]) == [
        0.0,
        1.0,
    ]


@pytest.mark.parametrize("cls", [ExactMatchReward, CharMatchReward])
def test_missing_answer_column_names_key_and_row_keys(cls: type) -> None:
    reward = cls(_config(answer_key="solution"))
    item = make_reward_input("42", {"prompt": "q", "answer": "42"})
    with pytest.raises(DataError, match=r"no 'solution' column \(its keys: 'prompt', 'answer'\).*reward\.answer_key"):
        reward.score([item])
    with pytest.raises(DataError, match="its keys: none"):
        reward.score([make_reward_input("42", {})])


def test_null_answer_is_a_data_error() -> None:
    with pytest.raises(DataError, match="'answer' is null"):
        ExactMatchReward().score([make_reward_input("42", {"answer": None})])


def test_missing_answer_raises_even_when_require_stop_would_score_zero() -> None:
    reward = ExactMatchReward(_config(require_stop=True))
    with pytest.raises(DataError, match="answer"):
        reward.score([make_reward_input("42", {"q": 1}, finish_reason="length")])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"answer_key": ""}, "reward.answer_key: must not be empty"),
        ({"stop_at": ["\n", ""]}, "reward.stop_at: must not contain an empty string"),
        ({"stop_at": 3}, "reward.stop_at"),
        ({"case_sensitive": "no"}, "reward.case_sensitive: expected true or false"),
    ],
)
def test_invalid_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**options)


def test_scores_are_floats_in_input_order() -> None:
    reward = CharMatchReward()
    scores = reward.score([make_reward_input(r, {"answer": "ab"}) for r in ("ab", "a", "xb", "zz")])
    assert scores == [1.0, 0.5, 0.5, 0.0]
    assert all(type(s) is float for s in scores)


def test_declares_the_answer_column_it_reads() -> None:
    assert _config().required_columns() == ["answer"]
    assert _config(answer_key="solution").required_columns() == ["solution"]
