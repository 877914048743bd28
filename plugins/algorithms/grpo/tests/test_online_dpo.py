"""``online_dpo``: the advantages whose policy gradient, through ``ppo_clip`` at ratio 1 with
``seq-mean-token-sum``, is exactly the gradient of the preference loss of each prompt's best and
worst samples (every loss type, against the loss differentiated directly), ties and unpaired
samples at 0, the metrics, the configuration checks, and a real run of the recipe."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.ops import PREFERENCE_LOSSES, preference_loss
from core_rl.protocol import TensorBatch
from core_rl_grpo.config import OnlineDPOAdvantageConfig, PPOClipConfig
from core_rl_grpo.losses import PPOClipLoss
from core_rl_grpo.online_dpo import OnlineDPOAdvantage

SMOOTHING = {"robust": 0.1, "exo_pair": 0.1}


def pair_batch(seed: int, rewards: list[float], groups: list[int], width: int = 5) -> TensorBatch:
    g = torch.Generator().manual_seed(seed)
    n = len(rewards)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    return TensorBatch(
        {
            "response_mask": mask,
            "loss_mask": mask.clone(),
            "rewards": torch.tensor(rewards),
            "group_index": torch.tensor(groups),
            "old_logprobs": -torch.rand(n, width, generator=g) * mask,
            "ref_logprobs": -torch.rand(n, width, generator=g) * mask,
        }
    )


def policy_gradient(batch: TensorBatch, advantages: torch.Tensor) -> torch.Tensor:
    """d/d logprobs of ppo_clip (seq-mean-token-sum) at ratio 1 with these advantages."""
    loss = PPOClipLoss(PPOClipConfig(aggregation="seq-mean-token-sum"))
    lp = batch["old_logprobs"].clone().requires_grad_(True)
    run = TensorBatch({**batch, "advantages": advantages})
    out = loss(run, lp, torch.zeros_like(lp)).per_token_loss
    (out * loss.loss_weights(run["loss_mask"])).sum().backward()
    return lp.grad


@pytest.mark.parametrize("loss_type", PREFERENCE_LOSSES)
def test_the_update_gradient_is_the_preference_losss(loss_type: str) -> None:
    """Three prompts of two samples: the PG gradient equals d/d logprobs of
    mean_p L(sum_t (lp - ref) of the better sample, ... of the worse)."""
    options = {"loss_type": loss_type, "beta": 0.5, "label_smoothing": SMOOTHING.get(loss_type, 0.0)}
    batch = pair_batch(0, [1.0, 0.0, 0.2, 0.7, 0.0, 1.0], [5, 5, 8, 8, 9, 9])
    estimator = OnlineDPOAdvantage(OnlineDPOAdvantageConfig(**options))
    got = policy_gradient(batch, estimator(batch))

    lp = batch["old_logprobs"].clone().requires_grad_(True)
    r = ((lp - batch["ref_logprobs"]) * batch["loss_mask"]).sum(dim=1)
    chosen, rejected = torch.tensor([0, 3, 5]), torch.tensor([1, 2, 4])
    options.pop("loss_type")
    preference_loss(r[chosen], r[rejected], loss_type=loss_type, **options).mean().backward()
    torch.testing.assert_close(got, lp.grad, atol=1e-6, rtol=1e-5)
    assert got.abs().sum() > 0


def test_ties_and_unpaired_rows_neither_dilute_nor_enlarge_the_step() -> None:
    """A tied group and an unpaired sample added to the batch leave the update's gradient the DPO
    gradient of the real pairs."""
    pairs = pair_batch(4, [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])
    extended = pair_batch(4, [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.3], [0, 0, 1, 1, 2, 2, 0])
    for key in ("old_logprobs", "ref_logprobs", "loss_mask", "response_mask"):
        extended[key][:4] = pairs[key]
    estimator = OnlineDPOAdvantage(OnlineDPOAdvantageConfig(beta=0.3))
    small = policy_gradient(pairs, estimator(pairs))
    large = policy_gradient(extended, estimator(extended))
    torch.testing.assert_close(large[:4], small, atol=1e-6, rtol=1e-5)
    assert torch.equal(large[4:], torch.zeros_like(large[4:])) and estimator.metrics()["ties"] == 1.0


def test_ties_and_unpaired_samples_get_nothing_and_the_metrics_describe_the_pairs() -> None:
    # group 0: three samples, the middle one unpaired; group 1: a tie
    batch = pair_batch(1, [0.5, 1.0, 0.0, 0.3, 0.3], [0, 0, 0, 1, 1])
    estimator = OnlineDPOAdvantage(OnlineDPOAdvantageConfig(beta=0.2))
    adv = estimator(batch)
    assert torch.equal(adv[[0, 3, 4]], torch.zeros_like(adv[[0, 3, 4]]))
    r = ((batch["old_logprobs"] - batch["ref_logprobs"]) * batch["loss_mask"]).sum(dim=1)
    h = float(r[1] - r[2])
    weight = 5 * 0.2 * (1 - 1 / (1 + math.exp(-0.2 * h)))  # (B / P) beta sigmoid(-beta h), B = 5 rows, P = 1 pair
    mask = batch["loss_mask"]
    torch.testing.assert_close(adv[1], weight * mask[1])
    torch.testing.assert_close(adv[2], -weight * mask[2])
    metrics = estimator.metrics()
    assert metrics["ties"] == 1.0 and metrics["accuracy"] == float(h > 0)
    assert metrics["margin"] == pytest.approx(0.2 * h) and metrics["loss"] == pytest.approx(
        math.log1p(math.exp(-0.2 * h))
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"loss_type": "robust"}, r"label_smoothing: .*loss_type robust models label noise"),
        ({"loss_type": "hinge", "label_smoothing": 0.1}, r"label_smoothing: .*loss_type hinge does not read it"),
        ({"discopop_tau": 0.3}, r"discopop_tau: .*only loss_type discopop reads it"),
        ({"loss_type": "simpo"}, r"loss_type"),
    ],
)
def test_configuration_mistakes(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.advantage\." + message):
        structure(options, OnlineDPOAdvantageConfig, path="algorithm.advantage")


def test_a_real_run_of_the_recipe(tmp_path: Path) -> None:
    """``core-rl train`` (fsdp + hf, algorithm online_dpo, 2 samples per prompt, 2 steps): the
    update builds the reference, the pairs' metrics are logged, the policy moves; one sample
    per prompt is refused before the run."""
    for dist in ("core_rl_fsdp", "core_rl_hf", "core_rl_reward_match"):
        pytest.importorskip(dist)
    from core_rl.builtin.loggers import read_metrics
    from core_rl.testing.launch import run_train, write_grpo_config
    from core_rl.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", alphabet="ab=", hidden_size=16, num_heads=2, seed=0)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s}) + "\n" for s in ("ab", "ba")))
    config = write_grpo_config(
        tmp_path,
        model,
        [str(data)],
        algorithm={"name": "online_dpo", "advantage": {"name": "online_dpo", "beta": 0.5}},
        reward={"name": "char_match"},
        trainer={"total_steps": 2},
        saver={"export_hf": False},
        loggers=[{"name": "jsonl"}],
    )
    run_train(config, cpu=True)
    rows = read_metrics(next((tmp_path / "runs").rglob("metrics.jsonl")))
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        pairs = 2 - row["advantage/ties"]
        if pairs:
            assert 0.0 <= row["advantage/accuracy"] <= 1.0 and math.isfinite(row["advantage/loss"])
            assert row["actor/grad_norm"] > 0
    assert any(2 - row["advantage/ties"] for row in rows), "no step had a pair with different rewards"
    refused = run_train(config, "rollout.sampling.n=1", "algorithm.adv_norm={mean_level: batch}", expect=2, cpu=True)
    assert "rollout.sampling.n is 1" in refused.stderr and "algorithm.adv_norm: 'online_dpo' sets" in refused.stderr
