"""The train/rollout mismatch math (:mod:`core_rl.ops.mismatch`) against hand-computed values, and
the update's ``drift_metrics`` reporting it from recomputed log-probs."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl import ops
from core_rl.loops.rl.update import drift_metrics
from core_rl.protocol import TensorBatch

# d = trainer - behave on three tokens: log 3, 0, log 0.25 (ratios 3, 1, 0.25)
TRAINER = torch.tensor([[math.log(3.0), -1.0, math.log(0.25) - 2.0]])
BEHAVE = torch.tensor([[0.0, -1.0, -2.0]])


def test_per_token_values_by_hand():
    values = ops.mismatch_values(TRAINER, BEHAVE, ratio_bound=2.0)
    assert values["abs_logprob_diff"][0].tolist() == pytest.approx([math.log(3.0), 0.0, math.log(4.0)], abs=1e-6)
    # k3: r - 1 - log r
    k3 = [3.0 - 1.0 - math.log(3.0), 0.0, 0.25 - 1.0 + math.log(4.0)]
    assert values["kl_behave_trainer"][0].tolist() == pytest.approx(k3, abs=1e-6)
    assert values["ratio_out_of_bounds"].tolist() == [[1.0, 0.0, 1.0]]  # 3 > 2, 0.25 < 1/2
    assert ops.mismatch_values(TRAINER, BEHAVE, ratio_bound=4.0)["ratio_out_of_bounds"].tolist() == [[0.0, 0.0, 0.0]]


def test_means_over_the_mask_only():
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is not a loss token
    means = ops.mismatch_means(TRAINER, BEHAVE, mask, ratio_bound=2.0)
    assert means["abs_logprob_diff"] == pytest.approx(math.log(3.0) / 2)
    assert means["kl_behave_trainer"] == pytest.approx((2.0 - math.log(3.0)) / 2)
    assert means["ratio_out_of_bounds"] == pytest.approx(0.5)
    assert ops.mismatch_means(TRAINER, BEHAVE, torch.zeros_like(mask), ratio_bound=2.0) == {}


def test_sums_add_up_over_parts_to_the_whole_mean():
    """Micro-batches and ranks add their sums; the mean of the sums is the whole batch's mean."""
    g = torch.Generator().manual_seed(0)
    trainer, behave = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    whole = ops.mismatch_means(trainer, behave, mask, 1.5)
    parts = [ops.mismatch_sums(trainer[r], behave[r], mask[r], 1.5) for r in (slice(0, 2), slice(2, 6))]
    total = {k: parts[0][k] + parts[1][k] for k in parts[0]}
    assert total["tokens"] == mask.sum()
    assert ops.means_of_sums(total) == pytest.approx(whole)


def test_an_infinite_value_off_the_mask_does_not_leak():
    trainer = torch.tensor([[0.5, 0.0]])
    behave = torch.tensor([[0.0, 200.0]])  # k3 overflows to inf on the second token, off the mask
    means = ops.mismatch_means(trainer, behave, torch.tensor([[1.0, 0.0]]), 2.0)
    assert means["kl_behave_trainer"] == pytest.approx(math.exp(0.5) - 1.5)


def test_drift_metrics_report_the_mismatch_of_the_recomputed_logprobs():
    batch = TensorBatch(
        {
            "old_logprobs": TRAINER.clone(),
            "behave_logprobs": BEHAVE.clone(),
            "loss_mask": torch.ones(1, 3),
            "train_version": torch.tensor([2]),
            "versions": torch.ones(1, 3, dtype=torch.long),
        }
    )
    metrics = drift_metrics(batch, ratio_bound=2.0)
    expected = ops.mismatch_means(TRAINER, BEHAVE, torch.ones(1, 3), 2.0)
    assert {k.removeprefix("mismatch/"): v for k, v in metrics.items() if k.startswith("mismatch/")} == expected
    assert metrics["mismatch/abs_logprob_diff"] == pytest.approx((math.log(3.0) + math.log(4.0)) / 3)
    assert metrics["offpolicy/kl_behave_old"] == metrics["mismatch/kl_behave_trainer"]
    assert metrics["offpolicy/staleness_mean"] == 0.0
