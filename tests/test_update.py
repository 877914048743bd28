"""The policy update of one RL step (core_rl.loops.rl.update) with the real fsdp engine on a tiny
model: recomputed old log-probs, behaviour log-probs kept, minibatches x epochs optimiser steps with
per-minibatch aggregation weights, the loss's whole-batch preparation, and max-reduced metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_rl.config.loader import structure
from core_rl.config.schema import ActorConfig, AlgorithmConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput, PolicyLoss
from core_rl.loops.rl.update import PolicyUpdate, combine_step_metrics, minibatch_rows
from core_rl.ops import aggregation_weights
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import TRAIN_ENGINE
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from core_rl.testing.tiny import build_tiny_model

pytest.importorskip("core_rl_fsdp")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("update") / "model", seed=0)


def engine(model_path: Path):
    host = PluginHost()
    entry = host.get(TRAIN_ENGINE, "fsdp")
    actor = ActorConfig(
        model_path=str(model_path), engine=PluginSpec(name="fsdp"), optimizer=OptimizerConfig(name="sgd", lr=0.05)
    )
    return entry.factory(actor, structure({}, entry.config_cls), trainable=True)


class RecordingLoss(PolicyLoss):
    """-A * logprob per token; records what each call saw. ``prepare`` drops row 0 from the loss."""

    def __init__(self, *, recompute: bool = False) -> None:
        self.requires_recompute = recompute
        self.calls: list[TensorBatch] = []
        self.prepared: list[TensorBatch] = []

    def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:
        return aggregation_weights(response_mask, "token-mean")

    def prepare(self, batch: TensorBatch) -> dict[str, float]:
        self.prepared.append(batch)
        batch["loss_mask"][0] = 0.0
        return {"prepared": 1.0}

    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        self.calls.append(batch)
        ratio = torch.exp(logprobs - batch["old_logprobs"])
        return LossOutput(
            per_token_loss=-batch["advantages"] * logprobs,
            token_metrics={"ratio": ratio.detach(), "ratio_max": ratio.detach()},
        )


def update(model_path: Path, loss: PolicyLoss, **algorithm: object) -> tuple[PolicyUpdate, object]:
    eng = engine(model_path)
    return (
        PolicyUpdate(
            engine=eng,
            ref=None,
            loss=loss,
            algorithm=AlgorithmConfig(**algorithm),
            temperature=1.0,
            shard=lambda b: b.rows(slice(0, None, 1)),
            world_size=1,
        ),
        eng,
    )


def test_minibatch_rows_and_step_metrics():
    assert [r.tolist() for r in minibatch_rows(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [r.tolist() for r in minibatch_rows(2, 4)] == [[0], [1]]
    combined = combine_step_metrics([{"loss": 1.0, "ratio_max": 2.0}, {"loss": 3.0, "ratio_max": 1.5, "x": 4.0}])
    assert combined == {"loss": 2.0, "ratio_max": 2.0, "x": 4.0}


def test_recompute_replaces_old_logprobs_and_keeps_behaviour(model_path):
    loss = RecordingLoss(recompute=True)
    step, eng = update(model_path, loss, ppo_n_minibatches=3, ppo_epochs=2)
    batch = make_rl_batch(batch_size=6, seed=1)
    behave = batch["behave_logprobs"].clone()
    expected_old = eng.compute_logprobs(batch)  # the weights the update starts from
    metrics = step(batch, train_version=4)
    torch.testing.assert_close(loss.prepared[0]["old_logprobs"], expected_old)
    assert torch.equal(loss.prepared[0]["behave_logprobs"], behave)
    # 3 minibatches x 2 epochs = 6 optimiser steps of 2 rows each
    assert eng.step == 6 and metrics["actor/optimizer_steps"] == 6.0 and len(loss.calls) == 6
    assert [c.batch_size for c in loss.calls] == [2] * 6
    for call in loss.calls:
        assert (call["train_version"] == 4).all()
        # aggregation weights normalised within each minibatch, from the prepared loss mask
        assert call["loss_weight"].sum().item() == pytest.approx(1.0)
        assert torch.equal(call["loss_weight"] != 0, call["loss_mask"] != 0)
    assert loss.calls[0]["loss_mask"][0].sum() == 0  # prepare dropped row 0 for every step
    assert metrics["actor/prepared"] == 1.0
    assert {"offpolicy/kl_behave_old", "offpolicy/behave_ratio_max", "offpolicy/staleness_mean"} <= set(metrics)
    # the first step sees ratio 1 (the policy has not moved); later steps see the moved policy
    assert metrics["actor/ratio_max"] >= 1.0
    eng.close()


def test_without_recompute_old_logprobs_are_the_behaviour_ones(model_path):
    loss = RecordingLoss()
    step, eng = update(model_path, loss)
    batch = make_rl_batch(batch_size=4, seed=2)
    old = batch["old_logprobs"].clone()
    metrics = step(batch, train_version=1)
    assert torch.equal(loss.calls[0]["old_logprobs"].cpu(), old)  # the loss sees the batch on the engine's device
    assert eng.step == 1 and metrics["actor/optimizer_steps"] == 1.0
    assert not any(k.startswith("offpolicy/") for k in metrics)
    eng.close()


def test_max_metrics_are_maxima(model_path):
    # ratio_max is reduced as a maximum over response tokens, ratio as a mean
    loss = RecordingLoss()
    step, eng = update(model_path, loss)
    batch = make_rl_batch(batch_size=4, seed=3)
    # pi_old below the model's own log-probs by 0.5 .. 1 on every response token: every ratio > 1
    shift = 0.5 + 0.5 * torch.rand(batch["old_logprobs"].shape, generator=torch.Generator().manual_seed(0))
    batch["old_logprobs"] = (eng.compute_logprobs(batch) - shift) * batch["response_mask"]
    metrics = step(batch, train_version=1)
    on = batch["response_mask"] != 0
    assert metrics["actor/ratio_max"] == pytest.approx(float(shift[on].exp().max()), rel=1e-5)
    assert metrics["actor/ratio"] == pytest.approx(float(shift[on].exp().mean()), rel=1e-5)
    eng.close()


class KLReportingLoss(RecordingLoss):
    """RecordingLoss that reports ``approx_kl`` as k3(pi_old || pi) per token (as ppo_clip does),
    with recomputed old log-probs so the first step measures 0."""

    def __init__(self) -> None:
        super().__init__(recompute=True)

    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        out = super().__call__(batch, logprobs, entropy)
        d = batch["old_logprobs"] - logprobs.detach()
        out.token_metrics["approx_kl"] = torch.exp(-d) - 1 + d
        return out


@pytest.mark.parametrize(("limit", "steps"), [(1e-12, 2), (None, 6)])
def test_early_stop_kl_skips_the_rest_of_the_step(model_path, limit, steps):
    """The first optimiser step measures KL 0 (the policy it starts from is pi_old); the second
    measures the moved policy's, above a tiny limit: the update stops after it."""
    loss = KLReportingLoss()
    step, eng = update(model_path, loss, ppo_n_minibatches=3, ppo_epochs=2, early_stop_kl=limit)
    metrics = step(make_rl_batch(batch_size=6, seed=4), train_version=1)
    assert eng.step == steps and metrics["actor/optimizer_steps"] == float(steps) and len(loss.calls) == steps
    assert metrics.get("actor/early_stopped") == (1.0 if limit is not None else None)
    eng.close()


def test_early_stop_kl_needs_a_loss_that_reports_the_kl(model_path):
    from core_rl.loops.errors import RunFailed

    step, eng = update(model_path, RecordingLoss(), early_stop_kl=0.1)
    with pytest.raises(RunFailed, match=r"algorithm.early_stop_kl: the policy loss reports no approx_kl"):
        step(make_rl_batch(batch_size=4, seed=5), train_version=1)
    eng.close()
