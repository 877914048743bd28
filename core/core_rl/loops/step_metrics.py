"""Per-step training metrics of a train engine: sums over micro-batches, reduced over ranks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from core_rl.launch import distributed as dist_utils
from core_rl.protocol import TensorBatch

#: a token metric whose name ends so is reduced as its maximum over response tokens, not its mean
MAX_SUFFIX = "_max"


class StepMetrics:
    """Per-step sums of one rank's micro-batches on the device, reduced over all ranks in one
    all-reduce by :meth:`reduce` (every rank must call it); token metrics named ``*_max`` are
    reduced by a second all-reduce as maxima."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.loss = zero.clone()
        self.entropy = zero.clone()
        self.response_tokens = zero.clone()
        self.tokens = zero.clone()
        self.metrics: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}

    def add(
        self, mb: TensorBatch, loss: torch.Tensor, entropy: torch.Tensor, token_metrics: Mapping[str, torch.Tensor]
    ) -> None:
        on = mb["response_mask"] != 0
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self.loss += loss.double()
        self.entropy += torch.where(on, entropy.double(), zero).sum()
        self.response_tokens += on.sum().double()
        self.tokens += (mb["attention_mask"] != 0).sum().double()
        for name, value in token_metrics.items():
            # where, not a product: a metric may be non-finite off the response (e.g. a ratio)
            if name.endswith(MAX_SUFFIX):
                low = torch.full((), float("-inf"), dtype=torch.float64, device=self.device)
                values = torch.where(on, value.detach().double(), low)  # -inf off the response
                top = values.max() if values.numel() else low  # a shape, not a value: no device sync
                self.maxima[name] = torch.maximum(self.maxima[name], top) if name in self.maxima else top
                continue
            total = torch.where(on, value.detach().double(), zero).sum()
            self.metrics[name] = self.metrics[name] + total if name in self.metrics else total

    def reduce(self) -> dict[str, float]:
        """``loss`` and ``tokens`` as global sums; ``entropy`` and each token metric as global means
        over response tokens (0 when the batch has none); ``*_max`` token metrics as global maxima
        over response tokens (absent when the batch has none)."""
        names: Sequence[str] = dist_utils.union_of_names(list(self.metrics))
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        parts = [self.loss, self.entropy, self.response_tokens, self.tokens]
        parts += [self.metrics.get(name, zero) for name in names]
        values = dist_utils.all_reduce(torch.stack(parts)).tolist()
        loss, entropy, count, tokens = values[:4]
        denom = max(count, 1.0)
        out = {name: value / denom for name, value in zip(names, values[4:])}
        out.update(loss=loss, entropy=entropy / denom, tokens=tokens)
        max_names: Sequence[str] = dist_utils.union_of_names(list(self.maxima))
        if max_names:
            low = torch.full((), float("-inf"), dtype=torch.float64, device=self.device)
            maxima = torch.stack([self.maxima.get(name, low) for name in max_names])
            reduced = dist_utils.all_reduce(maxima, dist_utils.ReduceOp.MAX).tolist()
            out.update({name: value for name, value in zip(max_names, reduced) if value != float("-inf")})
        return out
