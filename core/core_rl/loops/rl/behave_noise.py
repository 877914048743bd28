"""Test hook: ``CORE_RL_TEST_BEHAVE_NOISE=STD`` adds Gaussian noise of standard deviation ``STD``
to the behaviour log-probs of every batch as it is built from the samples (``behave_logprobs``
and the ``old_logprobs`` copied from them, on the response tokens), as a rollout engine whose
numbers differ from the trainer's would. Tests use it to force a train/rollout mismatch of a
known size (``algorithm.mismatch_budget``) where the real engines agree too well; unset, nothing
changes. The noise is seeded, so a run is reproducible."""

from __future__ import annotations

import os

import torch

from core_rl.protocol import TensorBatch

NOISE_VARIABLE = "CORE_RL_TEST_BEHAVE_NOISE"

_generator: torch.Generator | None = None


def with_test_noise(batch: TensorBatch) -> TensorBatch:
    """``batch`` with ``behave_logprobs`` and ``old_logprobs`` plus ``N(0, STD^2)`` noise on the
    ``response_mask`` tokens when :data:`NOISE_VARIABLE` is set (module docstring)."""
    global _generator
    value = os.environ.get(NOISE_VARIABLE)
    if not value:
        return batch
    if _generator is None:
        _generator = torch.Generator().manual_seed(1234)
    std = float(value)
    mask = batch["response_mask"]
    noise = torch.randn(mask.shape, generator=_generator) * std * mask
    batch["behave_logprobs"] = batch["behave_logprobs"] + noise
    batch["old_logprobs"] = batch["old_logprobs"] + noise
    return batch
