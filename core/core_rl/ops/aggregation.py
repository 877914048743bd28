"""How per-token losses are aggregated into one loss: per-token weights computed once on the global
batch, so the loss does not depend on how the batch is split into micro-batches or ranks."""

from __future__ import annotations

import torch

from core_rl.ops.names import AGGREGATIONS


def aggregation_weights(mask: torch.Tensor, mode: str, *, norm_length: float | None = None) -> torch.Tensor:
    """Per-token weights ``w`` such that the aggregated loss is ``sum_{i,t} w_{i,t} * l_{i,t}``.

    Computed once on the *global* batch, so summing ``w * l`` over any split into micro-batches or
    data-parallel ranks gives the same loss. With ``N`` sequences, ``L_i = sum_t mask_{i,t}``:

    - ``token-mean``:               w = mask / sum_{i,t} mask
    - ``seq-mean-token-mean``:      w = mask / (N * L_i)
    - ``seq-mean-token-sum``:       w = mask / N
    - ``seq-mean-token-sum-norm``:  w = mask / (N * C), C = ``norm_length``, a constant: Dr. GRPO's
      response budget (``rollout.sampling.max_new_tokens``), so the weight of a token does not
      depend on the lengths in the batch. Required for this mode.

    Sequences with no tokens in ``mask`` get weight 0 (and still count in ``N``).
    """
    mask = mask.float()
    n_seq = mask.shape[0]
    if mode == "token-mean":
        return mask / mask.sum().clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        return mask / (lengths * n_seq)
    if mode == "seq-mean-token-sum":
        return mask / n_seq
    if mode == "seq-mean-token-sum-norm":
        if norm_length is None or not norm_length > 0:
            raise ValueError(
                f"seq-mean-token-sum-norm needs a positive norm_length (the response budget), got {norm_length!r}"
            )
        return mask / (n_seq * float(norm_length))
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}")
