"""Log-probs of several tokens per prediction: a model's top-k tokens (a teacher's, for
distillation over its top-k distribution) and another model's log-probs of given tokens (the
policy's log-probs of the teacher's top-k ids, with gradient).

Both take the same float32 ``log p = log_softmax(logits / temperature)`` as
:mod:`core_rl_train_kit.logprobs`, chunk by chunk (:func:`~core_rl_train_kit.logprobs.chunk_slices`),
so nothing vocabulary-sized in float32 lives beyond one chunk; only ``[N, k]`` values leave it.
With gradient, only the logits (which the model produced anyway) and the ids are kept, and backward
recomputes each chunk's ``log p``: for ``sum_j g_j log p_{y_j}`` the gradient with respect to the
scaled logits is ``sum_j g_j (1[v = y_j] - p_v)``
(:func:`~core_rl_train_kit.logprobs.logit_gradient_`, several targets per row). The cost on the
policy's side: one more chunked log-softmax over its logits in forward and one in backward, beside
those of the sampled tokens' log-probs (:func:`~core_rl_train_kit.packed.forward_logprobs_at`).
"""

from __future__ import annotations

import torch

from core_rl_train_kit.logprobs import chunk_slices, logit_gradient_, scaled_log_softmax


def topk_logprobs(
    logits: torch.Tensor, k: int, temperature: float = 1.0, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of every prediction of ``logits`` ``[..., V]``: their ids
    ``[..., k]`` (long, most likely first) and log-probs ``[..., k]`` (float32, of the softmax at
    ``temperature`` over the whole vocabulary, or over its first ``vocab_size`` tokens: another
    model's vocabulary, which a larger embedding's padding rows exceed). No gradient; a view of
    ``logits`` is read chunk by chunk, never copied whole."""
    vocab = logits.shape[-1] if vocab_size is None else min(vocab_size, logits.shape[-1])
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}] (the vocabulary), got {k}")
    flat = logits.reshape(-1, logits.shape[-1])
    ids = torch.empty(flat.shape[0], k, dtype=torch.long, device=logits.device)
    values = torch.empty(flat.shape[0], k, dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for part in chunk_slices(flat.shape[0], vocab):
            values[part], ids[part] = scaled_log_softmax(flat[part, :vocab], temperature).topk(k, dim=-1)
    shape = (*logits.shape[:-1], k)
    return ids.view(shape), values.view(shape)


def logprobs_at(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log p`` of the tokens ``ids`` ``[..., k]`` under each prediction of ``logits`` ``[..., V]``
    (float32 ``[..., k]``, the softmax over the whole vocabulary at ``temperature``);
    differentiable when ``logits`` needs a gradient (module docstring)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab, k = logits.shape[-1], ids.shape[-1]
    flat, flat_ids = logits.reshape(-1, vocab), ids.reshape(-1, k)
    if torch.is_grad_enabled() and logits.requires_grad:
        out = _ChunkedLogprobsAt.apply(flat, flat_ids, float(temperature))
    else:
        out = _gather_chunks(flat, flat_ids, float(temperature))
    return out.view(ids.shape)


def _gather_chunks(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for part in chunk_slices(logits.shape[0], logits.shape[-1]):
            out[part] = scaled_log_softmax(logits[part], temperature).gather(-1, ids[part])
    return out


class _ChunkedLogprobsAt(torch.autograd.Function):
    """:func:`_gather_chunks` with the gradient of the module docstring, recomputed chunk by chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, logits: torch.Tensor, ids: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        ctx.temperature = temperature
        ctx.save_for_backward(logits, ids)
        return _gather_chunks(logits, ids, temperature)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        logits, ids = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for part in chunk_slices(logits.shape[0], logits.shape[-1]):
            logp = scaled_log_softmax(logits[part], ctx.temperature)
            grad[part] = logit_gradient_(logp, ids[part], grad_out[part].float(), None, None, ctx.temperature)
        return grad, None, None
