"""Every reasoning-gym task's gold answer scores 1.0 through the ``reasoning_gym`` reward on rows of
the ``reasoning_gym`` source, ``arc_agi`` and ``rearc`` included, whose scorers compare against
tuples in the metadata: the same rows through a JSON round trip score below 1. Tasks without a gold
answer (any valid solution counts) are pinned as such."""

from __future__ import annotations

import json
from typing import Any

import pytest
from core_rl.testing import make_reward_input
from core_rl_reasoning_gym.reward import ReasoningGymReward
from core_rl_reasoning_gym.source import ReasoningGymSource, ReasoningGymSourceConfig, task_names

#: tasks whose rows hold no gold answer (``answer`` is None): their scorers check a proposed solution
NO_GOLD_ANSWER = {"boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour"}
REWARD = ReasoningGymReward()


def rows_of(task: str, size: int = 2) -> list[dict[str, Any]]:
    return list(ReasoningGymSource(ReasoningGymSourceConfig(tasks=[task], size=size, seed=3)).rows())


def gold_scores(rows: list[dict[str, Any]]) -> list[float]:
    return REWARD.score([make_reward_input(f"<answer>{row['answer']}</answer>", row) for row in rows])


def test_the_task_list_is_reasoning_gyms() -> None:
    assert len(task_names()) >= 100 and {"arc_agi", "rearc", "chain_sum"} <= set(task_names())
    assert "composite" not in task_names()


@pytest.mark.parametrize("task", sorted(set(task_names()) - NO_GOLD_ANSWER))
def test_the_gold_answer_scores_one(task: str) -> None:
    rows = rows_of(task)
    assert [row["task"] for row in rows] == [task, task]
    assert all(row["metadata"]["source_dataset"] == task for row in rows)
    assert gold_scores(rows) == [1.0, 1.0]


@pytest.mark.parametrize("task", sorted(NO_GOLD_ANSWER))
def test_tasks_without_a_gold_answer_are_still_so(task: str) -> None:
    assert [row["answer"] for row in rows_of(task)] == [None, None]


@pytest.mark.parametrize("task", ["arc_agi", "rearc"])
def test_a_json_round_trip_would_lose_the_gold_answer(task: str) -> None:
    """Why the rows do not go through a file: their tuples become lists and the scorer disagrees."""
    rows = rows_of(task)
    assert any(isinstance(value, tuple) for value in rows[0]["metadata"].values())
    round_tripped = [json.loads(json.dumps(row)) for row in rows]
    assert all(score < 1.0 for score in gold_scores(round_tripped))
    assert gold_scores(rows) == [1.0, 1.0]
