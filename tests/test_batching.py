"""Batch assembly (core_rl.loops.rl.batching): over-sampling keeps the trained batch at its size,
running out is an error naming the setting, and reward shaping, the loss mask and advantage
normalisation do what the configuration says. Generation is scripted; everything else is real."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import pytest
import torch
from core_rl.config.schema import AlgorithmConfig, NormConfig, RewardShapingConfig
from core_rl.errors import CoreRLError
from core_rl.interfaces import AdvantageEstimator, SampleFilter
from core_rl.loops.rl.batching import BatchAssembler, DynamicSamplingError, Generation
from core_rl.loops.rl.filtering import EmptyStepsError, SampleFilterError
from core_rl.ops import group_is_uniform
from core_rl.protocol import Sample, TensorBatch

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


class DropAll(SampleFilter):
    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        return torch.zeros(batch.batch_size, dtype=torch.bool)


class FirstOfEachGroup(SampleFilter):
    """Keeps the first sample of each group: half of every group here, which the core refuses."""

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        return torch.arange(batch.batch_size) % N == 0


def test_a_step_the_filters_leave_empty_is_warned_counted_and_limited(capsys):
    """Without over-sampling, a step whose filters drop everything trains nothing: a warning names
    each filter and what it dropped, the metrics count it, a trained step ends the streak, and
    algorithm.max_consecutive_empty_steps such steps in a row end the run."""
    gens = iter([generation([[1, 1], [0, 0]]), generation([[0, 1], [0, 0]]), *(generation([[1, 1]]) for _ in range(3))])
    batcher = assembler(AlgorithmConfig(max_consecutive_empty_steps=2), filters=(VariedGroups(), DropAll()))
    batch, metrics = batcher.assemble(lambda: next(gens), step=1)
    assert batch is None
    assert metrics["filter/empty_step"] == 1.0 and metrics["filter/empty_steps_total"] == 1.0
    assert metrics["filter/VariedGroups/dropped_fraction"] == 1.0 and metrics["filter/DropAll/dropped_fraction"] == 1.0
    err = capsys.readouterr().err
    assert err.startswith(
        "core-rl: warning: step 1 has nothing to train on: the sample filters dropped every sample (4): sample filter "
        "'VariedGroups' (algorithm.filters[0]) dropped 2 group(s), 4 samples; sample filter 'DropAll' "
        "(algorithm.filters[1]) dropped 2 group(s), 4 samples; the policy was not updated (1 such step(s) in a row, "
        "1 in all). To train on every step, draw more prompts"
    ), err

    batcher.filters = batcher.filters[:1]  # without DropAll step 2 trains, which ends the streak
    batch, metrics = batcher.assemble(lambda: next(gens), step=2)
    assert batch is not None and metrics["filter/empty_step"] == 0.0 and metrics["filter/empty_steps_total"] == 1.0
    batcher.assemble(lambda: next(gens), step=3)
    assert batcher.empty_steps.state_dict() == {"total": 2, "streak": 1}
    with pytest.raises(EmptyStepsError) as info:
        batcher.assemble(lambda: next(gens), step=4)
    assert str(info.value).endswith(
        "the policy was not updated (2 such step(s) in a row, 3 in all); that reaches "
        "algorithm.max_consecutive_empty_steps=2, so the run ends: draw more prompts to refill what the filters drop "
        "(algorithm.max_num_gen_batches above 1), or loosen the filters, or raise the limit (0: none)"
    )
    assert EmptyStepsError.exit_code == 1


def test_no_limit_on_empty_steps_and_one_filter_names_itself(capsys):
    gens = iter([generation([[1, 1], [0, 0]]) for _ in range(20)])
    batcher = assembler(AlgorithmConfig(max_consecutive_empty_steps=0))
    for step in range(1, 21):
        assert batcher.assemble(lambda: next(gens), step=step)[0] is None
    assert batcher.empty_steps.state_dict() == {"total": 20, "streak": 20}
    assert (
        "step 20 has nothing to train on: sample filter 'VariedGroups' (algorithm.filters[0]) dropped every sample: "
        "2 group(s), 4 samples; the policy was not updated (20 such step(s) in a row, 20 in all)"
    ) in capsys.readouterr().err


def test_a_filter_must_keep_or_drop_whole_groups():
    """Group-relative advantages compare a group's samples with each other: a filter keeping part
    of a group is refused, naming it (and its distribution when the loader resolved it)."""
    from core_rl.config.schema import PluginSpec
    from core_rl.plugins.kinds import SAMPLE_FILTER
    from core_rl.plugins.registry import RegistryEntry

    spec = PluginSpec(name="first_of_group")
    spec.entry = RegistryEntry(SAMPLE_FILTER, "first_of_group", FirstOfEachGroup, "test", "my-filters", "1.0")
    gens = scripted(generation([[0, 1], [1, 0]]))
    batcher = assembler(AlgorithmConfig(filters=[spec]), filters=(FirstOfEachGroup(),))
    with pytest.raises(SampleFilterError) as info:
        batcher.assemble(lambda: next(gens), step=1)
    assert str(info.value).startswith(
        "sample filter 'first_of_group' (algorithm.filters[0], distribution my-filters) kept 1 of the 2 samples of "
        "a prompt's group (2 of 2 groups were cut); a sample filter must keep or drop whole groups"
    )
    assert SampleFilterError.exit_code == 2


@pytest.mark.parametrize(
    ("mask", "got"),
    [
        (torch.ones(4), "a torch.float32 tensor of shape [4]"),
        (torch.ones(3, dtype=torch.bool), "a torch.bool tensor of shape [3]"),
        ([True] * 4, "[True, True, True, True]"),
    ],
)
def test_a_filter_must_return_a_bool_mask_of_the_batch(mask, got):
    from core_rl.loops.rl.filtering import check_mask

    with pytest.raises(
        SampleFilterError,
        match=rf"^sample filter 'f' returned {re.escape(got)}; a sample filter returns a bool tensor of shape \[4\]",
    ):
        check_mask("sample filter 'f'", mask, torch.tensor([0, 0, 1, 1]))
    check_mask("sample filter 'f'", torch.tensor([True, True, False, False]), torch.tensor([0, 0, 1, 1]))
