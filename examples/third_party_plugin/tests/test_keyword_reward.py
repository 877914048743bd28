"""Tests of ``keyword_reward``: the conformance contract with hand-computed scores, for configured
keywords and for keywords read from the data row, plus the matching rules and config validation."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from core_rl.config.loader import structure
from core_rl.errors import ConfigError, DataError
from core_rl.protocol import RewardInput
from core_rl.testing import RewardContract, installed_distribution, make_reward_input
from core_rl_example_plugin import plugin
from core_rl_example_plugin.config import KeywordRewardConfig
from core_rl_example_plugin.reward import KeywordReward


class TestKeywordRewardContract(RewardContract):
    plugin = plugin
    name = "keyword_reward"
    distribution = installed_distribution("core-rl-example-plugin")
    options: ClassVar[dict[str, Any]] = {"keywords": ["paris", "France"]}
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("The capital of France is Paris."), 1.0),  # both, any case
        (make_reward_input("paris!"), 0.5),  # 1 of 2
        (make_reward_input("Parisian food in FRANCE"), 0.5),  # 'parisian' is not the word 'paris'
        (make_reward_input("frances paris"), 0.5),  # 'frances' is not the word 'france'
        (make_reward_input("Berlin"), 0.0),
        (make_reward_input(""), 0.0),
    ]


class TestKeywordRewardFromRowContract(RewardContract):
    plugin = plugin
    name = "keyword_reward"
    distribution = installed_distribution("core-rl-example-plugin")
    options: ClassVar[dict[str, Any]] = {"row_key": "keywords", "mode": "all"}
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("2 + 2 = 4", {"keywords": ["4"]}), 1.0),
        (make_reward_input("I think 5", {"keywords": ["4"]}), 0.0),
        (make_reward_input("x = 3 and y = 7", {"keywords": ["x = 3", "y = 7"]}), 1.0),
        (make_reward_input("x = 3 and y = 70", {"keywords": ["x = 3", "y = 7"]}), 0.0),  # all or nothing
        (make_reward_input("answer: 42", {"keywords": "42"}), 1.0),  # a string column is one keyword
        (make_reward_input("anything", {"keywords": []}), 1.0),  # nothing required
    ]


def reward(**options: Any) -> KeywordReward:
    return KeywordReward(structure(options, KeywordRewardConfig, path="reward"))


def score(r: KeywordReward, text: str, row: dict[str, Any] | None = None) -> float:
    return r.score([make_reward_input(text, row)])[0]


def test_case_sensitive_matching() -> None:
    r = reward(keywords=["Paris"], case_sensitive=True)
    assert score(r, "Paris") == 1.0
    assert score(r, "paris") == 0.0


def test_substring_matching_without_whole_words() -> None:
    r = reward(keywords=["paris", "cat"], whole_words=False)
    assert score(r, "parisian concatenation") == 1.0
    assert score(reward(keywords=["paris", "cat"]), "parisian concatenation") == 0.0


def test_regex_characters_in_keywords_are_literal() -> None:
    r = reward(keywords=["c++", "a.b"])
    assert score(r, "I write C++ and a.b") == 1.0
    assert score(r, "I write c and axb") == 0.0


def test_configured_and_row_keywords_combine_without_duplicates() -> None:
    r = reward(keywords=["Paris"], row_key="extra")
    item = make_reward_input("paris", {"extra": ["paris", "Seine"]})
    assert r.required_keywords(item) == ["Paris", "Seine"]
    assert r.score([item]) == [0.5]
    sensitive = reward(keywords=["Paris"], row_key="extra", case_sensitive=True)
    assert sensitive.required_keywords(item) == ["Paris", "paris", "Seine"]
    assert sensitive.score([item]) == [pytest.approx(1 / 3)]


def test_scores_keep_input_order() -> None:
    r = reward(keywords=["a", "b", "c", "d"])
    texts = ["a", "a b", "a b c", "a b c d", ""]
    assert r.score([make_reward_input(t) for t in texts]) == [0.25, 0.5, 0.75, 1.0, 0.0]


def test_missing_row_column_names_it() -> None:
    r = reward(row_key="keywords")
    with pytest.raises(DataError, match=r"no column 'keywords' \(reward\.row_key\); columns: answer"):
        score(r, "x", {"answer": "4"})


def test_row_column_of_the_wrong_type_is_rejected() -> None:
    with pytest.raises(DataError, match="must hold a string or a list of strings, got 4"):
        score(reward(row_key="keywords"), "x", {"keywords": 4})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "reward.keywords: must list at least one keyword when row_key is not set"),
        ({"keywords": ["a", " "]}, "reward.keywords: must not contain empty or blank keywords"),
        ({"keywords": ["a"], "mode": "most"}, "reward.mode: must be one of 'fraction', 'all'"),
        ({"keywords": ["a"], "whole_words": "yes"}, "reward.whole_words: expected true or false"),
        ({"keywords": ["a"], "keyword": ["b"]}, "reward.keyword: unknown key; did you mean 'keywords'?"),
    ],
)
def test_invalid_config_names_the_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        structure(options, KeywordRewardConfig, path="reward")
    assert any(problem.startswith(message) for problem in info.value.problems), info.value.problems


def test_declares_the_row_column_it_reads() -> None:
    """core-rl checks every data row for these columns before a run starts."""
    assert structure({"keywords": ["a"]}, KeywordRewardConfig).required_columns() == []
    assert structure({"row_key": "keywords"}, KeywordRewardConfig).required_columns() == ["keywords"]
