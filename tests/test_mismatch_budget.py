"""``algorithm.mismatch_budget`` at run time (:class:`core_rl.loops.rl.mismatch_budget.MismatchBudget`):
the streak and patience, each action's line, and the state a resumed run gets back. The actions on
real runs: tests/test_mismatch_budget_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from core_rl.config.schema import MismatchBudgetConfig
from core_rl.errors import ConfigError
from core_rl.interfaces import LossOutput, PolicyLoss
from core_rl.loops.rl.loop import SyncTrainer
from core_rl.loops.rl.mismatch_budget import MismatchBudget, MismatchBudgetExceeded
from core_rl.plugins.host import PluginHost

KEY = "mismatch/abs_logprob_diff"


def _steps(budget: MismatchBudget, values: list[float]) -> list[dict[str, float]]:
    return [budget.check(step, {KEY: v}) for step, v in enumerate(values, start=1)]


def test_no_threshold_no_budget_metrics():
    budget = MismatchBudget(MismatchBudgetConfig(), is_main=True, correct=None)
    assert _steps(budget, [5.0, 5.0]) == [{}, {}]


def test_warn_after_patience_steps_in_a_row_then_again_after_as_many(capsys):
    budget = MismatchBudget(MismatchBudgetConfig(threshold=0.1, patience=2), is_main=True, correct=None)
    out = _steps(budget, [0.2, 0.05, 0.3, 0.4, 0.5, 0.6])
    assert [m["mismatch/over_budget"] for m in out] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert out[-1]["mismatch/over_budget_total"] == 5.0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2  # at step 4 (steps 3, 4) and step 6 (steps 5, 6); step 1's streak was broken
    assert f"{KEY} = 0.4 > algorithm.mismatch_budget.threshold 0.1 at step 4 for 2 steps in a row" in lines[0]
    assert "at step 6" in lines[1]


def test_only_the_main_rank_prints(capsys):
    budget = MismatchBudget(MismatchBudgetConfig(threshold=0.1), is_main=False, correct=None)
    assert _steps(budget, [0.2])[0]["mismatch/over_budget"] == 1.0
    assert capsys.readouterr().err == ""


def test_a_step_without_the_metric_is_within_budget():
    budget = MismatchBudget(MismatchBudgetConfig(threshold=0.1, patience=2), is_main=True, correct=None)
    budget.check(1, {KEY: 0.5})
    assert budget.check(2, {})["mismatch/over_budget"] == 0.0
    assert budget.streak == 0


def test_the_watched_metric_is_configurable():
    config = MismatchBudgetConfig(metric="ratio_out_of_bounds", threshold=0.05)
    budget = MismatchBudget(config, is_main=True, correct=None)
    assert budget.check(1, {KEY: 9.0, "mismatch/ratio_out_of_bounds": 0.01})["mismatch/over_budget"] == 0.0
    assert budget.check(2, {KEY: 0.0, "mismatch/ratio_out_of_bounds": 0.2})["mismatch/over_budget"] == 1.0


def test_stop_waits_for_the_step_to_be_logged():
    budget = MismatchBudget(MismatchBudgetConfig(threshold=0.1, action="stop"), is_main=True, correct=None)
    budget.check(1, {KEY: 0.05})
    budget.stop_if_exceeded()  # nothing pending
    budget.check(2, {KEY: 0.25})  # decides, raises nothing yet
    with pytest.raises(MismatchBudgetExceeded) as caught:
        budget.stop_if_exceeded()
    assert caught.value.exit_code == 1
    assert f"{KEY} = 0.25 > algorithm.mismatch_budget.threshold 0.1 at step 2" in str(caught.value)


def test_correct_once_from_the_next_step_and_again_after_a_resume(capsys):
    calls: list[int] = []
    config = MismatchBudgetConfig(threshold=0.1, action="correct", patience=1)
    budget = MismatchBudget(config, is_main=True, correct=lambda: calls.append(1))
    out = _steps(budget, [0.2, 0.3, 0.4])
    assert calls == [1]  # once
    assert [m["mismatch/correction_on"] for m in out] == [0.0, 1.0, 1.0]  # on from step 2's update
    [line] = capsys.readouterr().err.splitlines()
    assert "at step 1" in line and "'tis' (algorithm.mismatch_budget.correction) from step 2 on" in line
    resumed_calls: list[int] = []
    resumed = MismatchBudget(config, is_main=True, correct=lambda: resumed_calls.append(1))
    resumed.load_state_dict(budget.state_dict())
    assert resumed_calls == [1] and resumed.corrected and resumed.total == 3


class _PlainLoss(PolicyLoss):
    """A third-party loss with no behaviour weight: it keeps the default refusal of a sampler."""

    def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:
        return response_mask / response_mask.sum()

    def __call__(self, batch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        return LossOutput(per_token_loss=-logprobs)


def test_correct_with_a_loss_that_applies_no_correction_is_refused_before_training():
    budget = MismatchBudgetConfig(threshold=0.1, action="correct")
    trainer = SimpleNamespace(cfg=SimpleNamespace(algorithm=SimpleNamespace(mismatch_budget=budget)), loss=_PlainLoss())
    with pytest.raises(ConfigError) as info:
        SyncTrainer._budget_correction(trainer, PluginHost())
    [problem] = info.value.problems
    assert problem.startswith("algorithm.mismatch_budget.action: 'correct' needs a loss that applies a correction")
    assert "_PlainLoss does not apply rejection sampling" in problem
