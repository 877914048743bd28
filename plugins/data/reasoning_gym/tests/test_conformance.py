"""The core conformance kits run against the ``reasoning_gym`` data source and reward, with scores
from reasoning-gym's own scorers on hand-picked answers."""

from __future__ import annotations

from typing import Any, ClassVar

import core_rl_reasoning_gym.plugin
import pytest
from core_rl.config.validators import FieldValueError
from core_rl.errors import DataError
from core_rl.protocol import RewardInput
from core_rl.testing import DataSourceContract, RewardContract, make_reward_input
from core_rl_reasoning_gym.reward import ReasoningGymReward, ReasoningGymRewardConfig
from core_rl_reasoning_gym.source import ReasoningGymSource, ReasoningGymSourceConfig

SMALL_SUMS = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


class TestSource(DataSourceContract):
    plugin = core_rl_reasoning_gym.plugin
    name = "reasoning_gym"
    distribution = "core-rl-reasoning-gym"
    options: ClassVar[dict[str, Any]] = {"tasks": ["chain_sum", "arc_agi"], "size": 3, "seed": 5}
    expected_rows = 6
    columns: ClassVar[list[str]] = ["answer", "metadata", "task"]


def _rows() -> list[dict[str, Any]]:
    config = ReasoningGymSourceConfig(tasks=["chain_sum"], size=2, seed=1, task_options=SMALL_SUMS)
    return list(ReasoningGymSource(config).rows())


ROWS = _rows()
GOLD = [str(row["answer"]) for row in ROWS]
WRONG = str(int(GOLD[0]) + 1)


class TestReward(RewardContract):
    plugin = core_rl_reasoning_gym.plugin
    name = "reasoning_gym"
    distribution = "core-rl-reasoning-gym"
    nullable_columns = ("answer",)  # null for tasks scored from the metadata alone
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input(f"<answer>{GOLD[0]}</answer>", ROWS[0]), 1.0),
        (make_reward_input(f"thinking... <answer>{WRONG}</answer> <answer>{GOLD[1]}</answer>", ROWS[1]), 1.0),
        (make_reward_input(f"<answer>{WRONG}</answer>", ROWS[0]), 0.0),
        (make_reward_input(GOLD[0], ROWS[0]), 0.0),  # no <answer> tags: no answer
    ]


class TestRewardWholeResponse(RewardContract):
    plugin = core_rl_reasoning_gym.plugin
    name = "reasoning_gym"
    distribution = "core-rl-reasoning-gym"
    nullable_columns = ("answer",)  # null for tasks scored from the metadata alone
    options: ClassVar[dict[str, Any]] = {"answer_tag": ""}
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input(f" {GOLD[0]}\n", ROWS[0]), 1.0),
        (make_reward_input(WRONG, ROWS[0]), 0.0),
    ]


def test_a_misspelled_task_gets_a_did_you_mean() -> None:
    with pytest.raises(FieldValueError, match=r"is no reasoning-gym task \(did you mean 'leg_counting'\)"):
        ReasoningGymSourceConfig(tasks=["chain_sum", "leg_countin"])


def test_task_options_reasoning_gym_refuses_are_refused_with_the_config() -> None:
    with pytest.raises(
        FieldValueError, match=r"task_options.chain_sum.*ChainSumConfig.*max_terms must be >= min_terms"
    ):
        ReasoningGymSourceConfig(tasks=["chain_sum"], task_options={"chain_sum": {"min_terms": 5, "max_terms": 2}})
    with pytest.raises(FieldValueError, match=r"unexpected keyword argument 'no_such'"):
        ReasoningGymSourceConfig(tasks=["chain_sum"], task_options={"chain_sum": {"no_such": 1}})


def test_a_row_without_the_answer_column_is_a_data_error_naming_the_key() -> None:
    """A null answer is valid (tasks scored from the metadata); no answer column at all is a
    misnamed ``reward.answer_key``, said as such instead of failing inside the task's scorer."""
    reward = ReasoningGymReward(ReasoningGymRewardConfig(answer_key="gold"))
    with pytest.raises(DataError, match=r"no 'gold' column \(its keys: .*'answer'.*\); set reward.answer_key"):
        reward.score([make_reward_input(f"<answer>{GOLD[0]}</answer>", ROWS[0])])
