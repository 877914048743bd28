"""Log-probs and entropies from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds the logits of a contiguous slice ``[start, start + V_r)`` of the
(padded) vocabulary; entries ``>= vocab_size`` (padding, at the end of the last slices) are left
out. With ``z = logits / temperature`` over the real vocabulary:

- each rank, on its slice: ``m_r = max z``, ``S_r = sum exp(z - m_r)``,
  ``E_r = sum exp(z - m_r) z`` and ``z_y`` where it holds the target ``y`` (0 elsewhere);
- ``m = max_r m_r`` (all-reduce max), ``S = sum_r S_r exp(m_r - m)``,
  ``E = sum_r E_r exp(m_r - m)`` and ``z_y`` (one all-reduce sum of the three);
- ``lse = m + log S``, ``logprob = z_y - lse``, ``entropy = lse - E / S``
  (``= -sum_v p_v log p_v`` for ``p = softmax(z)``).

Only ``[b, s]``-sized tensors cross ranks. Every rank then holds the same values and computes the
same loss from them, so the gradient arriving at them is the same on every rank, and each rank's
gradient with respect to its own slice is the gradient formula of
:func:`core_rl_train_kit.logprobs.logit_gradient_` over its columns, with the global ``lse``
and ``H``: backward needs no collective.

As in the core's ``token_logprobs``, rows are processed in chunks of at most
``core_rl_train_kit.logprobs.CHUNK_ELEMENTS`` values and only the logits (in their own dtype)
and per-row values are kept for backward, which recomputes ``log p`` chunk by chunk: no
vocabulary-sized float32 tensor outlives one chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from core_rl_train_kit.logprobs import chunk_slices, keep_for_backward, logit_gradient_


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
    the entropy without gradient (a metric; nothing of it is kept for backward). Padded columns
    get no gradient."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    slice_ = _Slice(vocab_start, min(max(vocab_size - vocab_start, 0), logits.shape[-1]), group)
    if torch.is_grad_enabled() and logits.requires_grad:
        logprob, entropy = _VocabParallelStats.apply(
            flat, targets.reshape(-1), slice_, float(temperature), with_entropy, entropy_grad
        )
    else:
        logprob, _, entropy = _stats(flat, targets.reshape(-1), slice_, float(temperature), with_entropy)
    return logprob.view(shape), (None if entropy is None else entropy.view(shape))


class _Slice:
    """This rank's columns: global index of the first (``start``), how many are real vocabulary
    entries (``real``; the rest are padding), and the tensor-parallel ``group``."""

    def __init__(self, start: int, real: int, group: dist.ProcessGroup | None) -> None:
        self.start, self.real, self.group = start, real, group

    def local_targets(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(column of each target within the real columns, clamped; whether this rank holds it)."""
        local = targets - self.start
        mine = (local >= 0) & (local < self.real)
        return local.clamp(0, max(self.real - 1, 0)), mine


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in float32 (a new tensor, divided in place)."""
    scaled = logits.float()
    if scaled.data_ptr() == logits.data_ptr():
        scaled = scaled.clone()
    return scaled.div_(temperature) if temperature != 1.0 else scaled


def _stats(
    logits: torch.Tensor, targets: torch.Tensor, where: _Slice, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(logprob, lse, entropy or None)``, each ``[N]`` float32, of rows ``[N, V_r]`` (no autograd;
    the module docstring's formulas, chunk by chunk, then two collectives)."""
    count, device = logits.shape[0], logits.device
    local_max = torch.full((count,), float("-inf"), device=device)
    sums = torch.zeros(3, count, device=device)  # S_r, E_r, z_y
    columns, mine = where.local_targets(targets)
    if where.real > 0:
        with torch.no_grad():
            for part in chunk_slices(count, where.real):
                z = _scaled(logits[part, : where.real], temperature)
                local_max[part] = peak = z.amax(dim=-1)
                sums[2, part] = torch.where(mine[part], z.gather(-1, columns[part, None]).squeeze(-1), 0.0)
                e = (z - peak[:, None]).exp_()
                sums[0, part] = e.sum(dim=-1)
                if with_entropy:
                    sums[1, part] = e.mul_(z).sum(dim=-1)
                del z, e
    shift = local_max.clone()
    if _group_size(where.group) > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=where.group)
    # exp(m_r - m): 0 on a rank without real columns (m_r = -inf), whose sums are 0 anyway
    sums[:2] *= torch.exp(local_max - shift)
    if _group_size(where.group) > 1:
        dist.all_reduce(sums, group=where.group)
    lse = shift + torch.log(sums[0])
    entropy = lse - sums[1] / sums[0] if with_entropy else None
    return sums[2] - lse, lse, entropy


class _VocabParallelStats(torch.autograd.Function):
    """:func:`_stats` with the gradient of :func:`~core_rl_train_kit.logprobs.logit_gradient_`
    on this rank's real columns, recomputed chunk by chunk (no collective)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        where: _Slice,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logprob, lse, entropy = _stats(logits, targets, where, temperature, with_entropy)
        ctx.where, ctx.temperature = where, temperature
        keep_for_backward(ctx, entropy, entropy_grad, logits, targets, lse)
        return logprob, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None, None, None]:
        # autograd hands zeros for an output the loss did not use (materialised gradients)
        logits, targets, lse, entropy = ctx.saved_tensors
        where, temperature, use_entropy = ctx.where, ctx.temperature, ctx.entropy_grad
        grad = torch.zeros_like(logits)  # padded columns keep 0
        if where.real == 0:
            return grad, None, None, None, None, None
        columns, mine = where.local_targets(targets)
        for part in chunk_slices(logits.shape[0], where.real):
            weight = grad_logprob[part].float()
            logp = _scaled(logits[part, : where.real], temperature).sub_(lse[part, None])
            grad[part, : where.real] = logit_gradient_(
                logp,
                columns[part],
                torch.where(mine[part], weight, 0.0),
                grad_entropy[part].float() if use_entropy else None,
                entropy[part] if use_entropy else None,
                temperature,
                grad_logprob=weight,
            )
        return grad, None, None, None, None, None
