"""Multi-turn trajectories: tokens a workflow inserts (tool output, environment replies) never
train. A batch masks them (``response_mask``, log-probs, versions); their gradient through the real
``fsdp`` engine and the ``ppo_clip`` loss is exactly zero; the loss and GRPO/GAE advantages equal
those of the same trajectories with the inserted tokens dropped (a second formulation); GAE over
interleaved masks matches a hand computation; ``train_turns`` and per-turn reward reductions."""

from __future__ import annotations

import random

import pytest
import torch
from core_rl import ops
from core_rl.builtin.environment_workflow import mask_turns, reduce_turn_rewards
from core_rl.protocol import Sample, TensorBatch, samples_to_batch
from core_rl.rollout.workflows import append_observation, extend_turn

grpo_losses = pytest.importorskip("core_rl_grpo.losses")
grpo_adv = pytest.importorskip("core_rl_grpo.advantages")

PAD = 0


def turn(ids: list[int], version: int, rng: random.Random, prompt: list[int]) -> Sample:
    return Sample(
        prompt_ids=prompt,
        response_ids=ids,
        logprobs=[-rng.uniform(0.1, 3.0) for _ in ids],
        weight_version=version,
        finish_reason="stop",
    )


def trajectory(rng: random.Random, prompt: list[int], turns: int) -> Sample:
    """A trajectory of ``turns`` model turns with observations of random length (1-4) between them."""
    sample = turn([rng.randrange(4, 30) for _ in range(rng.randint(1, 5))], 0, rng, prompt)
    for t in range(1, turns):
        sample = append_observation(sample, [rng.randrange(4, 30) for _ in range(rng.randint(1, 4))])
        sample = extend_turn(sample, turn([rng.randrange(4, 30) for _ in range(rng.randint(1, 5))], t, rng, prompt))
    return sample


def dropped(sample: Sample) -> Sample:
    """The same trajectory with its inserted tokens removed."""
    keep = [i for i, m in enumerate(sample.token_mask or [1] * len(sample.response_ids)) if m]
    return Sample(
        prompt_ids=sample.prompt_ids,
        response_ids=[sample.response_ids[i] for i in keep],
        logprobs=[sample.logprobs[i] for i in keep],
        weight_version=sample.weight_version,
        finish_reason=sample.finish_reason,
        token_weight_versions=[sample.versions[i] for i in keep],
    )


def compact(values: torch.Tensor, mask: torch.Tensor, prompt_lengths: list[int], width: int) -> torch.Tensor:
    """``values [B, T]`` with each row's positions off ``mask`` in its response dropped (the prompt kept)."""
    out = torch.zeros(values.shape[0], width, dtype=values.dtype)
    for i, p in enumerate(prompt_lengths):
        keep = torch.cat([torch.arange(p), p + torch.nonzero(mask[i, p:]).flatten()])
        out[i, : len(keep)] = values[i, keep]
    return out


@pytest.fixture
def batches() -> tuple[TensorBatch, TensorBatch, list[int]]:
    rng = random.Random(3)
    prompts = [[1, *[rng.randrange(4, 30) for _ in range(rng.randint(2, 4))]] for _ in range(3)]
    samples = [trajectory(rng, prompts[g], turns=rng.randint(1, 3)) for g in range(3) for _ in range(2)]
    group = [g for g in range(3) for _ in range(2)]
    full = samples_to_batch(samples, group, PAD)
    short = samples_to_batch([dropped(s) for s in samples], group, PAD)
    rewards = torch.tensor([rng.uniform(0, 1) for _ in samples])
    for batch in (full, short):
        batch["rewards"] = rewards
        batch["loss_mask"] = batch["response_mask"].clone()
        batch["advantages"] = grpo_adv.grpo_advantages(rewards, batch["group_index"], batch["response_mask"])
    return full, short, [len(s.prompt_ids) for s in samples]


def test_a_batch_masks_inserted_tokens() -> None:
    rng = random.Random(0)
    first = turn([5, 6], 3, rng, [1, 2])
    sample = extend_turn(append_observation(first, [7, 8, 9]), turn([10], 4, rng, [1, 2]))
    batch = samples_to_batch([sample], [0], PAD)
    assert batch["input_ids"][0].tolist() == [1, 2, 5, 6, 7, 8, 9, 10]
    assert batch["response_mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1]
    assert batch["versions"][0].tolist() == [-1, -1, 3, 3, -1, -1, -1, 4]
    assert batch["old_logprobs"][0, 4:7].tolist() == [0.0, 0.0, 0.0]
    assert batch["old_logprobs"][0, 7].item() == pytest.approx(sample.logprobs[5])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_loss_equals_the_loss_with_inserted_tokens_dropped(batches, aggregation) -> None:
    full, short, prompt_lengths = batches
    torch.manual_seed(0)
    current = full["old_logprobs"] + 0.3 * torch.randn(full["old_logprobs"].shape)  # a moved policy
    current_short = compact(current, full["response_mask"], prompt_lengths, short["input_ids"].shape[1])
    loss = grpo_losses.PPOClipLoss(grpo_losses.PPOClipConfig(eps_clip=0.2, aggregation=aggregation))
    totals = []
    for batch, logprobs in ((full, current), (short, current_short)):
        batch["loss_weight"] = loss.loss_weights(batch["loss_mask"])
        out = loss(batch, logprobs * batch["response_mask"], torch.zeros_like(logprobs))
        totals.append(float((out.per_token_loss * batch["loss_weight"]).sum()))
    assert totals[0] == pytest.approx(totals[1], rel=1e-6, abs=1e-7)
    assert totals[0] != 0.0
    # and the advantages on the model's tokens are the same
    kept = compact(full["advantages"], full["response_mask"], prompt_lengths, short["input_ids"].shape[1])
    torch.testing.assert_close(kept, short["advantages"])


def test_gae_over_interleaved_masks_by_hand() -> None:
    """mask 1 1 0 0 1 0 1 (inserted tokens at 2, 3, 5): GAE runs over positions 0, 1, 4, 6."""
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 0, 1]])
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.4, 9.0, 0.1]])  # 9s: values on inserted tokens, ignored
    rewards = ops.token_level_rewards(torch.tensor([1.0]), mask)
    assert rewards[0].tolist() == [0, 0, 0, 0, 0, 0, 1]
    g, lam = 0.9, 0.8
    adv, returns = ops.gae_advantages(rewards, values, mask, discount=g, gae_lambda=lam)
    d6 = 1.0 + g * 0.0 - 0.1
    d4 = 0.0 + g * 0.1 - 0.4
    d1 = 0.0 + g * 0.4 - 0.2
    d0 = 0.0 + g * 0.2 - 0.5
    a6 = d6
    a4 = d4 + g * lam * a6
    a1 = d1 + g * lam * a4
    a0 = d0 + g * lam * a1
    expected = torch.tensor([[a0, a1, 0, 0, a4, 0, a6]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, (expected + values) * mask)
    # second formulation: the same trajectory with the inserted tokens dropped
    keep = mask[0] != 0
    short, _ = ops.gae_advantages(rewards[:, keep], values[:, keep], mask[:, keep], discount=g, gae_lambda=lam)
    torch.testing.assert_close(short, adv[:, keep])


def test_gae_on_random_trajectories_equals_gae_with_inserted_tokens_dropped(batches) -> None:
    full, short, prompt_lengths = batches
    torch.manual_seed(1)
    values = torch.randn(full["response_mask"].shape)
    values_short = compact(values, full["response_mask"], prompt_lengths, short["input_ids"].shape[1])
    width = short["input_ids"].shape[1]
    outs = []
    for batch, v in ((full, values), (short, values_short)):
        rewards = ops.token_level_rewards(batch["rewards"], batch["response_mask"])
        outs.append(ops.gae_advantages(rewards, v, batch["response_mask"], discount=0.95, gae_lambda=0.9)[0])
    torch.testing.assert_close(compact(outs[0], full["response_mask"], prompt_lengths, width), outs[1])


def test_inserted_tokens_get_exactly_zero_gradient_through_the_fsdp_engine(batches, tmp_path) -> None:
    """One real ``train_step`` of the fsdp engine with the ppo_clip loss: the gradient reaching each
    token's log-prob is exactly 0 on inserted tokens (and on the prompt), non-zero on model tokens."""
    fsdp = pytest.importorskip("core_rl_fsdp.engine")
    from core_rl.config.schema import ActorConfig, MicroBatchConfig, OptimizerConfig, PluginSpec
    from core_rl.testing.tiny import build_tiny_model
    from core_rl_fsdp.config import FSDPConfig

    full = batches[0]
    model = build_tiny_model(tmp_path / "model", seed=0)
    actor = ActorConfig(
        model_path=str(model),
        engine=PluginSpec(name="fsdp"),
        optimizer=OptimizerConfig(name="sgd", lr=0.1),
        micro_batch=MicroBatchConfig(max_tokens_per_mb=24),  # several micro-batches
    )
    engine = fsdp.FSDPEngine(actor, FSDPConfig(), trainable=True)
    loss = grpo_losses.PPOClipLoss(grpo_losses.PPOClipConfig(eps_clip=0.2))
    full["loss_weight"] = loss.loss_weights(full["loss_mask"])
    grads: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording_loss(batch, logprobs, entropy):
        logprobs.register_hook(lambda g, m=batch["response_mask"]: grads.append((g.detach().clone(), m.clone())))
        return loss(batch, logprobs, entropy)

    engine.train_step(full, recording_loss)
    assert len(grads) >= 2
    inserted = on_model = 0
    for grad, mask in grads:
        assert (grad[mask == 0] == 0).all()  # exactly zero: inserted tokens, prompt, padding
        on_model += int((grad[mask != 0] != 0).sum())
        inserted += int((mask == 0).sum())
    assert on_model > 0 and inserted > 0


def test_train_turns_last_masks_the_earlier_turns() -> None:
    rng = random.Random(1)
    sample = extend_turn(append_observation(turn([5, 6], 0, rng, [1]), [7]), turn([8, 9, 10], 0, rng, [1]))
    spans = [(0, 2), (3, 6)]
    assert mask_turns(sample, spans, "all") is sample
    last = mask_turns(sample, spans, "last")
    assert last.token_mask == [0, 0, 0, 1, 1, 1]
    assert last.logprobs[:3] == [0.0, 0.0, 0.0] and last.logprobs[3:] == sample.logprobs[3:]
    assert samples_to_batch([last], [0], PAD)["response_mask"][0].tolist() == [0, 0, 0, 0, 1, 1, 1]


def test_turn_reward_reductions() -> None:
    assert reduce_turn_rewards([0.0, 0.5, 1.0], "sum") == 1.5
    assert reduce_turn_rewards([0.0, 0.5, 1.0], "last") == 1.0
    assert reduce_turn_rewards([], "last") == 0.0
