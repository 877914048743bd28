"""The evaluation's metrics (:mod:`core_rl.eval.metrics`): pass@k against counting every draw
of k answers, and the whole metric set on a hand-computed example."""

from __future__ import annotations

import itertools
import math

import pytest
from core_rl.eval.metrics import ScoredPrompt, eval_metrics, k_values, pass_at_k
from hypothesis import given
from hypothesis import strategies as st


def _enumerated_pass_at_k(correct: list[bool], k: int) -> float:
    """The fraction of all k-subsets of the answers that hold a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@given(st.lists(st.booleans(), min_size=1, max_size=9), st.data())
def test_pass_at_k_is_the_fraction_of_k_draws_holding_a_correct_answer(correct: list[bool], data) -> None:
    k = data.draw(st.integers(1, len(correct)))
    got = pass_at_k(len(correct), sum(correct), k)
    assert got == pytest.approx(_enumerated_pass_at_k(correct, k), abs=1e-12)


def test_pass_at_k_by_hand() -> None:
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(3, 0, 3) == 0.0 and pass_at_k(3, 3, 1) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_k_values() -> None:
    assert k_values(1) == [1]
    assert k_values(4) == [1, 2, 4]
    assert k_values(6) == [1, 2, 4, 6]


def test_eval_metrics_by_hand() -> None:
    prompts = [
        ScoredPrompt(rewards=[1.0, 0.0], lengths=[3, 5], truncated=[False, True], parts={"fmt": [1.0, 0.5]}, group="a"),
        ScoredPrompt(
            rewards=[0.5, 0.25], lengths=[2, 2], truncated=[False, False], parts={"fmt": [0.0, 1.0]}, group="b"
        ),
        # one answer dropped by a failing reward: pass@2 cannot be estimated for it
        ScoredPrompt(rewards=[1.0], lengths=[4], truncated=[False], parts={"fmt": [math.nan]}, group="a", dropped=1),
    ]
    m = eval_metrics(prompts, n=2, pass_reward=1.0, group_by="src")
    assert m["eval/prompts"] == 3 and m["eval/samples"] == 5 and m["eval/dropped"] == 1
    assert m["eval/reward/mean"] == pytest.approx((1 + 0 + 0.5 + 0.25 + 1) / 5)
    assert m["eval/reward/max"] == 1.0 and m["eval/reward/min"] == 0.0
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert m["eval/pass@2"] == pytest.approx((1.0 + 0.0) / 2)  # the prompts with 2 answers
    assert m["eval/best_reward/mean"] == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert m["eval/response_length/mean"] == pytest.approx(16 / 5)
    assert m["eval/truncated"] == pytest.approx(1 / 5)
    assert m["eval/parts/fmt/mean"] == pytest.approx(2.5 / 4)  # the NaN of a failed item left out
    assert m["eval/src=a/prompts"] == 2 and m["eval/src=b/prompts"] == 1
    assert m["eval/src=a/reward/mean"] == pytest.approx(2 / 3)
    assert m["eval/src=a/pass@1"] == pytest.approx(0.75) and m["eval/src=a/pass@2"] == 1.0
    assert m["eval/src=b/pass@1"] == 0.0


def test_one_greedy_answer_has_no_best_of_and_group_names_are_made_safe() -> None:
    prompts = [ScoredPrompt(rewards=[1.0], lengths=[1], truncated=[False], group="gsm 8k/test")]
    m = eval_metrics(prompts, n=1, pass_reward=0.5, group_by="source")
    assert "eval/best_reward/mean" not in m and m["eval/pass@1"] == 1.0
    assert m["eval/source=gsm_8k_test/prompts"] == 1


def test_majority_vote_by_hand() -> None:
    """maj@n: the most frequent answer found (spaces ignored; a tie to the first given) decides."""
    prompts = [
        # "1 / 2" twice (wrong), "3" once (right): the majority is wrong
        ScoredPrompt(rewards=[0.0, 1.0, 0.0], lengths=[1] * 3, truncated=[False] * 3, answers=["1/2", "3", "1 / 2"]),
        # a tie between "7" (right, first) and "8": the first wins; the unfound answer does not vote
        ScoredPrompt(rewards=[1.0, 0.0, 0.0], lengths=[1] * 3, truncated=[False] * 3, answers=["7", "8", None]),
        # nothing found: wrong
        ScoredPrompt(rewards=[0.0, 0.0, 0.0], lengths=[1] * 3, truncated=[False] * 3, answers=[None, None, None]),
        # a reward that reads no answers: not counted
        ScoredPrompt(rewards=[1.0, 1.0, 1.0], lengths=[1] * 3, truncated=[False] * 3),
    ]
    m = eval_metrics(prompts, n=3, pass_reward=1.0)
    assert m["eval/maj@n"] == pytest.approx(1 / 3)
    assert "eval/maj@n" not in eval_metrics(prompts[:1], n=1, pass_reward=1.0)  # one answer: no vote
    assert "eval/maj@n" not in eval_metrics(prompts[3:], n=3, pass_reward=1.0)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), min_size=1, max_size=9))
def test_majority_vote_against_counting(votes: list[tuple[str, bool]]) -> None:
    """With answers that decide correctness, maj@n is right iff the most voted answer is a right one."""
    right = {a for a, ok in votes if ok}
    answers = [a for a, _ in votes]
    rewards = [1.0 if a in right else 0.0 for a in answers]
    prompt = ScoredPrompt(rewards=rewards, lengths=[1] * len(votes), truncated=[False] * len(votes), answers=answers)
    top = max(answers.count(a) for a in answers)
    first_top = next(a for a in answers if answers.count(a) == top)
    expected = 1.0 if first_top in right else 0.0
    if len(votes) > 1:
        assert eval_metrics([prompt], n=len(votes), pass_reward=1.0)["eval/maj@n"] == expected
