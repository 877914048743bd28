"""Sample filters over a generation batch, and the steps they leave with nothing to train.

A sample filter (:class:`core_rl.interfaces.SampleFilter`, ``algorithm.filters[i]``) sees a scored
generation batch before reward shaping and advantages: the keys of
:func:`core_rl.protocol.samples_to_batch` plus ``rewards`` (raw, ``[B]``); ``group_index`` ``[B]``
labels each sample's prompt. It returns a bool ``[B]`` keep-mask; every filter sees the whole
batch, and a sample trains only if every filter keeps it. A filter keeps or drops *whole groups*
(all the ``rollout.sampling.n`` samples of a prompt): group-relative advantages (GRPO, RLOO, Dr.
GRPO) and group-level normalisation compare each sample with the rest of its group, so a partial
group would shift the baseline of the samples that stay, and dynamic sampling counts groups. A
mask that is not a bool ``[B]`` tensor, or that keeps part of a group, is a
:class:`SampleFilterError` naming the filter and its distribution (:func:`check_mask`).

Without over-sampling (``algorithm.max_num_gen_batches: 1``) a step whose filters left no sample
trains nothing: an *empty step* (:class:`EmptySteps`). Each prints a warning naming each filter and
what it dropped, and counts in the metrics ``filter/empty_step`` (1 on such a step, else 0) and
``filter/empty_steps_total``; ``algorithm.max_consecutive_empty_steps`` of them in a row end the
run (:class:`EmptyStepsError`; 0: no limit). With over-sampling, running out of generation
batches is :class:`core_rl.loops.rl.batching.DynamicSamplingError` instead.

Each filter's call runs under ``algorithm.filter_timeout_s`` (:func:`apply_filters`): a filter that
blocks stops the run with one line naming it, its distribution, the call and the wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from core_rl import ops
from core_rl.config.schema import PluginSpec
from core_rl.errors import CoreRLError, warn
from core_rl.interfaces import SampleFilter
from core_rl.loops.errors import RunFailed
from core_rl.loops.streaks import StreakCounter
from core_rl.protocol import TensorBatch
from core_rl.reliability.deadlines import call_with_deadline


class SampleFilterError(CoreRLError):
    """A sample filter broke its contract: its mask is not a bool ``[B]`` tensor, or it kept part
    of a prompt's group."""


class EmptyStepsError(RunFailed):
    """``algorithm.max_consecutive_empty_steps`` steps in a row had nothing to train on."""


@attrs.frozen
class NamedFilter:
    """A built filter with what names it: ``label`` for messages (``sample filter 'x'
    (algorithm.filters[0], distribution d)``) and ``metric`` for its metric keys."""

    filter: SampleFilter
    label: str
    metric: str


def named_filters(filters: Sequence[SampleFilter], specs: Sequence[PluginSpec]) -> list[NamedFilter]:
    """``filters`` with their names: from ``specs`` (``algorithm.filters``, the sections they were
    built from) when there is one per filter, else from their class."""
    from_specs = len(specs) == len(filters)
    names = [s.name for s in specs] if from_specs else [type(f).__name__ for f in filters]
    out = []
    for i, (f, name) in enumerate(zip(filters, names)):
        entry = specs[i].entry if from_specs else None
        where = f"algorithm.filters[{i}]" + (f", distribution {entry.distribution}" if entry is not None else "")
        metric = name if names.count(name) == 1 else f"{name}[{i}]"
        out.append(NamedFilter(f, f"sample filter {name!r} ({where})", metric))
    return out


@attrs.frozen
class Dropped:
    """What one filter dropped of a generation batch: its ``samples`` and whole ``groups``."""

    label: str
    metric: str
    samples: int
    groups: int


def check_mask(label: str, mask: Any, group_index: torch.Tensor) -> None:
    """Raise :class:`SampleFilterError` naming the filter (``label``) unless its ``mask`` is a bool
    ``[B]`` tensor that keeps or drops whole groups of ``group_index``."""
    b = group_index.numel()
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (b,):
        got = f"a {mask.dtype} tensor of shape {list(mask.shape)}" if isinstance(mask, torch.Tensor) else repr(mask)
        raise SampleFilterError(
            f"{label} returned {got}; a sample filter returns a bool tensor of shape [{b}] (one per sample), "
            "True for the samples to keep"
        )
    dense, n_groups = ops.group_ids_to_dense(group_index)
    kept = ops.segment_sum(mask.float(), dense, n_groups)
    size = ops.segment_sum(torch.ones(b), dense, n_groups)
    partial = ((kept > 0) & (kept < size)).nonzero().flatten()
    if partial.numel():
        g = int(partial[0])
        raise SampleFilterError(
            f"{label} kept {int(kept[g])} of the {int(size[g])} samples of a prompt's group ({partial.numel()} of "
            f"{n_groups} groups were cut); a sample filter must keep or drop whole groups (all the samples of one "
            "prompt, the rows with equal group_index): group-relative advantages and normalisation compare each "
            "sample with the rest of its group, so a partial group would shift the baseline of the samples that "
            "stay. Make the filter decide per group (core_rl.ops.group_ids_to_dense numbers the groups), or remove "
            "it from algorithm.filters; to leave single samples out of the loss use algorithm.mask_no_eos_with_zero "
            "or algorithm.rejection_sampling"
        )


def apply_filters(
    filters: Sequence[NamedFilter], batch: TensorBatch, timeout_s: float | None = None
) -> tuple[torch.Tensor, list[Dropped]]:
    """The keep-mask of every filter together (see the module docstring) and what each dropped.
    ``timeout_s`` (``algorithm.filter_timeout_s``): each filter's call runs under that deadline
    (:func:`core_rl.reliability.deadlines.call_with_deadline`: past it,
    :class:`~core_rl.reliability.deadlines.DeadlinePassed`
    naming the filter); ``None``: called directly."""
    group_index = batch["group_index"]
    keep = torch.ones(batch.batch_size, dtype=torch.bool)
    dropped = []
    for f in filters:
        if timeout_s is None:
            mask = f.filter(batch)
        else:
            mask = call_with_deadline(f.label, "filter", timeout_s, "algorithm.filter_timeout_s", f.filter, batch)
        check_mask(f.label, mask, group_index)
        keep &= mask
        groups = int(torch.unique(group_index[~mask]).numel())
        dropped.append(Dropped(f.label, f.metric, int((~mask).sum()), groups))
    return keep, dropped


def dropped_metrics(dropped: Sequence[Dropped], n_generated: int) -> dict[str, float]:
    """``filter/<name>/dropped_fraction``: the fraction of the step's generated samples each filter
    dropped (summed over its generation batches)."""
    totals: dict[str, float] = {}
    for d in dropped:
        key = f"filter/{d.metric}/dropped_fraction"
        totals[key] = totals.get(key, 0.0) + d.samples
    return {key: value / max(n_generated, 1) for key, value in totals.items()}


def why_empty(dropped: Sequence[Dropped], n_generated: int, reward_dropped: float) -> str:
    """Why a step has nothing to train on, naming each filter and what it dropped."""
    if not n_generated:
        if reward_dropped:
            return f"the reward runner dropped all {int(reward_dropped)} samples (reward_runner.on_error=drop)"
        return "the generation batch held no sample"
    parts = [f"{d.label} dropped {d.groups} group(s), {d.samples} samples" for d in dropped if d.samples]
    if len(parts) == 1:
        return parts[0].replace(" dropped ", " dropped every sample: ", 1)
    return f"the sample filters dropped every sample ({n_generated}): " + "; ".join(parts)


class EmptySteps(StreakCounter):
    """Counts the steps with nothing to train on and ends the run at the limit (see the module
    docstring). ``total``/``streak``: such steps so far / in a row."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def check(self, step: int, why: str | None) -> dict[str, float]:
        """Account for step ``step``: ``why`` it is empty, ``None`` when it trains. Returns
        ``filter/empty_step`` and ``filter/empty_steps_total``; raises :class:`EmptyStepsError` at
        the limit."""
        self.count(why is not None)
        if why is None:
            return {"filter/empty_step": 0.0, "filter/empty_steps_total": float(self.total)}
        message = (
            f"step {step} has nothing to train on: {why}; the policy was not updated ({self.streak} such step(s) "
            f"in a row, {self.total} in all)"
        )
        remedy = (
            "draw more prompts to refill what the filters drop (algorithm.max_num_gen_batches above 1), "
            "or loosen the filters"
        )
        if self.limit and self.streak >= self.limit:
            raise EmptyStepsError(
                f"{message}; that reaches algorithm.max_consecutive_empty_steps={self.limit}, so the run ends: "
                f"{remedy}, or raise the limit (0: none)"
            )
        warn(f"{message}. To train on every step, {remedy}")
        return {"filter/empty_step": 1.0, "filter/empty_steps_total": float(self.total)}
