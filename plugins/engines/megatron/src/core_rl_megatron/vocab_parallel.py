"""Log-probs and entropies from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds the logits of a contiguous slice ``[start, start + V_r)`` of the
(padded) vocabulary. With ``z = logits / temperature`` and vocabulary entries ``>= vocab_size``
(padding) excluded:

- ``m = max_v z_v`` (all-reduce max; a constant shift, so it carries no gradient),
- ``S = sum_v exp(z_v - m)`` (all-reduce sum), ``lse = m + log S``,
- ``logprob = z_target - lse`` (``z_target`` from the one rank holding the target, all-reduce sum),
- ``entropy = lse - E / S`` with ``E = sum_v exp(z_v - m) z_v`` (all-reduce sum), which is
  ``lse - sum_v p_v z_v`` for ``p = softmax(z)``.

Sums go through Megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward,
identity backward): every rank computes the same loss from the reduced values, so each rank's
gradient with respect to its own slice is already the full gradient of that loss. Only
``[b, s]``-sized tensors cross ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def vocab_parallel_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` and (optionally) the entropy, ``[b, s]`` float32, from this rank's
    logits slice ``[b, s, V_r]`` (position ``i`` scores ``targets[:, i]``). ``vocab_start``: the
    global index of this rank's first column; ``vocab_size``: the real (unpadded) vocabulary;
    ``group``: the tensor-parallel group (``None``: no tensor parallelism); ``entropy_grad=False``:
    the entropy without gradient (a metric; nothing of it is kept for backward)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    parallel = _group_size(group) > 1

    def total(x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(x, group) if parallel else x

    z = logits.float() / temperature
    width = z.shape[-1]
    columns = torch.arange(vocab_start, vocab_start + width, device=z.device)
    real = columns < vocab_size
    if not bool(real.all()):
        z = z.masked_fill(~real, float("-inf"))
    shift = z.detach().amax(dim=-1)
    if parallel:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    exp = torch.exp(z - shift.unsqueeze(-1))
    sum_exp = total(exp.sum(dim=-1))
    lse = shift + torch.log(sum_exp)
    local = targets - vocab_start
    mine = (local >= 0) & (local < width)
    picked = z.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    logprob = total(torch.where(mine, picked, torch.zeros_like(picked))) - lse
    if not with_entropy:
        return logprob, None
    # sum_v p_v z_v = E / S with E = sum_v exp(z_v - m) z_v: E and S are sums of rank-local terms,
    # so lse, E and S enter the entropy only after their reductions and the identity backward of
    # each reduction hands every rank the complete gradient (a replicated value such as lse used
    # inside rank-local terms would get only the local part of its gradient). Padded columns:
    # exp(-inf) = 0 times z written as 0, not as -inf.
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        expected_z = total((exp * z.masked_fill(~real, 0.0)).sum(dim=-1)) / sum_exp
        entropy = lse - expected_z
    return logprob, entropy
