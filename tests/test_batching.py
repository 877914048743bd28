"""Batch assembly (core_rl.trainer.batching): over-sampling keeps the trained batch at its size,
running out is an error naming the setting, and reward shaping, the loss mask and advantage
normalisation do what the configuration says. Generation is scripted; everything else is real."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from core_rl.config.schema import AlgorithmConfig, NormConfig, RewardShapingConfig
from core_rl.errors import CoreRLError
from core_rl.interfaces import AdvantageEstimator, SampleFilter
from core_rl.ops import group_is_uniform
from core_rl.protocol import Sample, TensorBatch
from core_rl.trainer.batching import BatchAssembler, DynamicSamplingError, Generation

PAD = 0
N = 2  # samples per prompt


class VariedGroups(SampleFilter):
    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        return ~group_is_uniform(batch["rewards"], batch["group_index"])


class RewardAdvantage(AdvantageEstimator):
    """A_{i,t} = reward_i on the response (so shaping is visible in the advantages)."""

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        return batch["rewards"][:, None] * batch["response_mask"]


def generation(rewards: list[list[float]], *, response_len: int = 2, version: int = 0) -> Generation:
    """One generation batch: a prompt per inner list, a sample per reward (responses of
    ``response_len`` tokens, the last truncated when its reward is negative)."""
    samples, groups, flat = [], [], []
    for g, group in enumerate(rewards):
        for r in group:
            reason = "length" if r < 0 else "stop"
            samples.append(Sample([1, 2], list(range(5, 5 + response_len)), [-0.5] * response_len, version, reason))
            groups.append(g)
            flat.append(r)
    return Generation(samples=samples, group_index=groups, rewards=flat, metrics={"timing/generate_s": 0.5})


def scripted(*batches: Generation) -> Iterator[Generation]:
    return iter(batches)


VARIED = (VariedGroups(),)


def assembler(algorithm: AlgorithmConfig, *, prompts: int = 3, filters=VARIED) -> BatchAssembler:
    return BatchAssembler(
        algorithm,
        filters=list(filters),
        advantage=RewardAdvantage(),
        prompts_per_step=prompts,
        max_new_tokens=4,
        pad_token_id=PAD,
    )


def test_over_sampling_fills_exactly_the_configured_number_of_groups():
    # batch 1 keeps 1 of 3 groups, batch 2 keeps 2 (with longer responses), batch 3 is never drawn
    gens = scripted(
        generation([[0, 1], [1, 1], [0, 0]]),
        generation([[1, 0], [0.5, 0.5], [0, 0.25]], response_len=3),
        generation([[0, 1], [0, 1], [0, 1]]),
    )
    batch, metrics = assembler(AlgorithmConfig(max_num_gen_batches=5)).assemble(lambda: next(gens))
    assert batch is not None
    assert metrics["dynamic_sampling/gen_batches"] == 2.0
    assert metrics["batch/groups"] == 3.0 and metrics["batch/samples"] == 3 * N
    assert batch["group_index"].tolist() == [0, 0, 3, 3, 5, 5]  # labels unique across generation batches
    assert batch["rewards"].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 0.25]
    assert metrics["filter/kept_fraction"] == pytest.approx(6 / 12)
    assert metrics["timing/generate_s"] == pytest.approx(1.0)  # summed over generation batches
    assert metrics["reward/mean"] == pytest.approx((1 + 2 + 1 + 1 + 0.25) / 12)  # all generated samples
    # batch 1's rows are padded to batch 2's width: ids with the pad id, versions with -1
    assert batch["input_ids"].shape[1] == 5 and batch["input_ids"][0, 4] == PAD
    assert batch["versions"][0].tolist() == [-1, -1, 0, 0, -1]
    assert batch["response_mask"][0].tolist() == [0, 0, 1, 1, 0]


def test_surplus_groups_are_trimmed_to_the_earliest():
    gens = scripted(generation([[0, 1], [1, 1], [0, 0]]), generation([[0, 1], [0, 1], [1, 0]]))
    batch, metrics = assembler(AlgorithmConfig(max_num_gen_batches=3), prompts=2).assemble(lambda: next(gens))
    assert batch["group_index"].tolist() == [0, 0, 3, 3]
    assert metrics["batch/groups"] == 2.0


def test_running_out_of_generation_batches_is_an_error_naming_the_setting():
    gens = scripted(generation([[1, 1], [0, 1], [0, 0]]), generation([[1, 1], [1, 1], [0, 0]]))
    with pytest.raises(DynamicSamplingError, match=r"algorithm\.max_num_gen_batches=2\) the sample filters left 1 of"):
        assembler(AlgorithmConfig(max_num_gen_batches=2)).assemble(lambda: next(gens))
    assert issubclass(DynamicSamplingError, CoreRLError)


def test_without_over_sampling_the_step_trains_on_what_is_left():
    gens = scripted(generation([[0, 1], [1, 1], [0, 0]]))
    batch, metrics = assembler(AlgorithmConfig()).assemble(lambda: next(gens))
    assert batch["group_index"].tolist() == [0, 0] and "dynamic_sampling/gen_batches" not in metrics
    gens = scripted(generation([[1, 1], [0, 0]]))
    batch, metrics = assembler(AlgorithmConfig()).assemble(lambda: next(gens))
    assert batch is None and metrics["filter/kept_fraction"] == 0.0


def test_reward_shaping_order_and_values():
    # response lengths 4 (the budget) and 3; overlong window 2 -> penalties -1 and -0.5, factor 0.5
    # -> r + [-0.5, -0.25]; then (r + 1) * 2, clipped to +-2.5
    shaping = RewardShapingConfig(scale=2.0, bias=1.0, clip=2.5, overlong_tokens=2, overlong_penalty_factor=0.5)
    gens = scripted(
        Generation(
            samples=[Sample([1], [5, 6, 7, 8], [0.0] * 4, 0, "length"), Sample([1], [5, 6, 7], [0.0] * 3, 0, "stop")],
            group_index=[0, 0],
            rewards=[1.0, 0.0],
        )
    )
    batch, metrics = assembler(AlgorithmConfig(reward_shaping=shaping), prompts=1, filters=()).assemble(
        lambda: next(gens)
    )
    # sample 0: (1 - 0.5 + 1) * 2 = 3 -> 2.5;  sample 1: (0 - 0.25 + 1) * 2 = 1.5
    assert batch["rewards"].tolist() == pytest.approx([2.5, 1.5])
    assert metrics["batch/reward_mean"] == pytest.approx(2.0)
    torch.testing.assert_close(batch["advantages"], batch["rewards"][:, None] * batch["response_mask"])


def test_reward_norm_and_advantage_norm():
    norm = NormConfig(mean_level="group", std_level="none")
    gens = scripted(generation([[0, 1], [2, 4]]))
    algorithm = AlgorithmConfig(
        reward_shaping=RewardShapingConfig(norm=norm), adv_norm=NormConfig(mean_level="batch", std_level="batch")
    )
    batch, _ = assembler(algorithm, prompts=2, filters=()).assemble(lambda: next(gens))
    assert batch["rewards"].tolist() == pytest.approx([-0.5, 0.5, -1.0, 1.0])
    # advantages -0.5, 0.5, -1, 1 on 2 tokens each: mean 0, unbiased std sqrt((2*.25*2 + 2*1*2)/7)
    std = math.sqrt((4 * 0.25 + 4 * 1.0) / 7)
    adv = batch["advantages"][batch["response_mask"] != 0].view(4, 2)[:, 0]
    assert adv.tolist() == pytest.approx([-0.5 / std, 0.5 / std, -1 / std, 1 / std], rel=1e-4)


def test_truncated_samples_leave_the_loss():
    # a negative reward marks a truncated sample in these scripts
    gens = scripted(generation([[-1, 1], [0, 1]]))
    batch, metrics = assembler(AlgorithmConfig(mask_no_eos_with_zero=True), prompts=2, filters=()).assemble(
        lambda: next(gens)
    )
    assert batch["truncated"].tolist() == [True, False, False, False]
    assert batch["loss_mask"].sum(1).tolist() == [0.0, 2.0, 2.0, 2.0]
    assert metrics["batch/loss_token_fraction"] == pytest.approx(6 / 8)
    assert batch["response_mask"].sum(1).tolist() == [2.0, 2.0, 2.0, 2.0]
