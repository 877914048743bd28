"""The ``math`` reward agrees with math-verify's own verdicts and with a careful grader on the
hand-written table in cases.py (equivalent forms, units, fractions, intervals, sets, extraction
variants, wrong answers)."""

from __future__ import annotations

import pytest
from cases import CASES
from core_rl.testing import make_reward_input
from core_rl_reward_math.config import MathConfig
from core_rl_reward_math.extract import as_latex_answer
from core_rl_reward_math.reward import MathReward
from math_verify import parse, verify


def test_the_table_is_large_and_mixed():
    assert len(CASES) >= 50
    verdicts = [expected for _, _, expected in CASES]
    assert 10 <= verdicts.count(False) <= len(CASES) - 10


@pytest.mark.parametrize(("gold", "response", "expected"), CASES)
def test_math_verify_itself_agrees_with_the_grader(gold, response, expected):
    assert verify(parse(as_latex_answer(gold)), parse(response)) is expected


def test_reward_agrees_with_math_verify_on_the_whole_table(math_reward):
    items = [make_reward_input(response, {"answer": gold}) for gold, response, _ in CASES]
    scores = math_reward.score(items)
    wrong = [
        (gold, response, expected, got)
        for (gold, response, expected), got in zip(CASES, scores)
        if got != (1.0 if expected else 0.0)
    ]
    assert not wrong


@pytest.fixture(scope="module")
def math_reward():
    reward = MathReward(MathConfig(num_workers=2))
    yield reward
    reward.close()
