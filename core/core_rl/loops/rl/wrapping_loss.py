"""A policy loss that wraps another (``base``) and adds a term of its own: what the update asks of
a loss (what it needs, aggregation weights, preparation, rejection sampling, per-step observation
and state) is the base's unless the wrapper says otherwise. The distillation and ptx losses
(:mod:`core_rl.loops.rl.distill`, :mod:`core_rl.loops.rl.ptx`) build on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from core_rl.interfaces import PolicyLoss, RejectionSampler
from core_rl.protocol import TensorBatch


class WrappingLoss(PolicyLoss):
    """``base``'s contract, forwarded; subclasses implement ``__call__`` and override what differs.
    ``logprobs_at_key`` (extra token ids whose log-probs the engine computes,
    :data:`core_rl.interfaces.LOGPROBS_AT`) and ``entropy_grad`` are read from the base."""

    def __init__(self, base: PolicyLoss) -> None:
        self.base = base
        self.requires_reference = base.requires_reference
        self.entropy_grad = getattr(base, "entropy_grad", True)
        self.logprobs_at_key = getattr(base, "logprobs_at_key", None)

    @property
    def requires_recompute(self) -> bool:
        return self.base.requires_recompute

    def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:
        return self.base.loss_weights(response_mask)

    def prepare(self, batch: TensorBatch) -> dict[str, float]:
        return self.base.prepare(batch)

    def set_rejection_sampler(self, sampler: RejectionSampler | None) -> None:
        self.base.set_rejection_sampler(sampler)

    def has_gradient(self, batch: TensorBatch) -> bool:
        """``True``: the wrapper's own term has a gradient whatever the base's advantages (a
        subclass whose term can vanish says when)."""
        return True

    def observe_step(self, metrics: Mapping[str, float]) -> dict[str, float]:
        return self.base.observe_step(metrics)

    def state_dict(self) -> dict[str, Any]:
        return self.base.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.base.load_state_dict(state)
