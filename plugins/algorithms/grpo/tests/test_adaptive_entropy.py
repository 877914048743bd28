"""``ppo_clip``'s adaptive entropy coefficient (``entropy_target``; Skywork-OR1): the controller's
rule by hand, the loss applying the bonus only after a step at or below the target, its state in
checkpoints, the configuration checks, and a real run resumed halfway through."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from core_rl import ops
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from core_rl_grpo.config import PPOClipConfig
from core_rl_grpo.losses import PPOClipLoss


def make_loss(**options: object) -> PPOClipLoss:
    return PPOClipLoss(structure(options, PPOClipConfig, path="algorithm.loss"))


def test_the_controller_steps_up_at_or_below_the_target_and_down_above_within_bounds() -> None:
    rule = {"target": 1.0, "delta": 0.1, "low": 0.0, "high": 0.25}
    assert ops.adaptive_entropy_coef(0.1, 0.5, **rule) == pytest.approx(0.2)
    assert ops.adaptive_entropy_coef(0.1, 1.0, **rule) == pytest.approx(0.2)  # at the target: up
    assert ops.adaptive_entropy_coef(0.2, 0.5, **rule) == 0.25  # capped
    assert ops.adaptive_entropy_coef(0.1, 1.5, **rule) == pytest.approx(0.0)
    assert ops.adaptive_entropy_coef(0.05, 1.5, **rule) == 0.0  # floored


def loss_and_entropy_grad(loss: PPOClipLoss, batch: TensorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    lp = batch["old_logprobs"].clone().requires_grad_(True)
    entropy = torch.full_like(lp, 2.0, requires_grad=True)
    out = loss(batch, lp, entropy).per_token_loss
    out.sum().backward()
    return out.detach(), entropy.grad if entropy.grad is not None else torch.zeros_like(entropy)


def test_the_bonus_follows_the_last_steps_entropy_and_resumes() -> None:
    batch = make_rl_batch(seed=1)
    mask = batch["response_mask"]
    loss = make_loss(entropy_coef=0.1, entropy_target=1.0, entropy_coef_delta=0.05, entropy_coef_max=0.5)
    assert loss.entropy_grad  # the coefficient may grow from any start: engines keep the entropy's graph
    plain, _ = loss_and_entropy_grad(make_loss(), batch)
    # first step: nothing measured yet, no bonus
    out, grad = loss_and_entropy_grad(loss, batch)
    torch.testing.assert_close(out, plain)
    torch.testing.assert_close(grad, torch.zeros_like(grad))
    # a step at entropy 0.8 <= 1: the coefficient rises to 0.15 and the bonus is on
    assert loss.observe_step({"entropy": 0.8}) == {"entropy_coef": pytest.approx(0.15), "entropy_bonus_on": 1.0}
    out, grad = loss_and_entropy_grad(loss, batch)
    torch.testing.assert_close(out, plain - 0.15 * 2.0 * mask)
    torch.testing.assert_close(grad, -0.15 * mask)
    saved = loss.state_dict()
    # a step at entropy 3 > 1: the coefficient falls to 0.1 and the bonus is off
    assert loss.observe_step({"entropy": 3.0}) == {"entropy_coef": pytest.approx(0.1), "entropy_bonus_on": 0.0}
    torch.testing.assert_close(loss_and_entropy_grad(loss, batch)[0], plain)
    # a fresh loss given the saved state applies what the saving one applied
    resumed = make_loss(entropy_coef=0.1, entropy_target=1.0, entropy_coef_delta=0.05, entropy_coef_max=0.5)
    resumed.load_state_dict(json.loads(json.dumps(saved)))
    torch.testing.assert_close(loss_and_entropy_grad(resumed, batch)[0], plain - 0.15 * 2.0 * mask)


def test_a_fixed_coefficient_keeps_no_state() -> None:
    loss = make_loss(entropy_coef=0.1)
    assert loss.observe_step({"entropy": 0.1}) == {} and loss.state_dict() == {}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"entropy_coef_delta": 0.1}, r"entropy_coef_delta: .*applies only to the adaptive coefficient"),
        ({"entropy_coef_max": 2.0}, r"entropy_coef_max: .*set entropy_target"),
        ({"entropy_target": 1.0, "entropy_coef": 2.0}, r"entropy_coef: .*\[entropy_coef_min, entropy_coef_max\]"),
        ({"entropy_target": -1.0}, r"entropy_target: must be >= 0"),
    ],
)
def test_configuration_mistakes(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.loss\." + message):
        make_loss(**options)


def test_a_real_run_adapts_the_coefficient_and_a_resume_carries_it(tmp_path: Path) -> None:
    """``core-rl train`` (fsdp + hf) for 2 steps with a checkpoint each step, then extended to 3
    steps: each step's coefficient is the rule applied to the previous one and that step's logged
    entropy, across the resume too (a resume that lost the state would restart from entropy_coef)."""
    for dist in ("core_rl_fsdp", "core_rl_hf"):
        pytest.importorskip(dist)
    from core_rl.builtin.loggers import read_metrics
    from core_rl.testing.launch import run_train, write_grpo_config
    from core_rl.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", alphabet="ab=", hidden_size=16, num_heads=2, seed=0)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s}) + "\n" for s in ("ab", "ba")))
    # a target above any entropy of the tiny vocabulary (log |V| < 5 nats): the coefficient rises each step
    loss = {"entropy_coef": 0.0, "entropy_target": 5.0, "entropy_coef_delta": 0.01}
    config = write_grpo_config(
        tmp_path,
        model,
        [str(data)],
        algorithm={"name": "grpo", "loss": loss},
        trainer={"total_steps": 2},
        saver={"every_n_steps": 1, "export_hf": False},
        loggers=[{"name": "jsonl"}],
    )
    run_train(config, cpu=True)
    run_train(config, "trainer.total_steps=3", "recover.mode=auto", cpu=True)
    rows = {r["step"]: r for r in read_metrics(next((tmp_path / "runs").rglob("metrics.jsonl")))}
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["actor/entropy_coef"] for s in (1, 2, 3)] == pytest.approx([0.01, 0.02, 0.03])
    assert all(math.isfinite(rows[s]["actor/entropy"]) and rows[s]["actor/entropy"] <= 5.0 for s in rows)
    assert [rows[s]["actor/entropy_bonus_on"] for s in (1, 2, 3)] == [1.0, 1.0, 1.0]
