"""Per-token log-probabilities and entropies from causal-LM logits, in the protocol's alignment.

With ``z = logits / temperature`` in float32 for one prediction (a row of ``V`` values), the
target token ``y``, ``log p = log_softmax(z)`` and ``p = exp(log p)``:

- ``logprob = log p_y``;
- ``entropy H = -sum_v p_v log p_v``;
- their gradients with respect to ``z`` (``g_lp``, ``g_H``: the gradients arriving at them):
  ``d/dz_v = g_lp (1[v = y] - p_v) - g_H p_v (log p_v + H)``, and ``d/dlogits = d/dz / temperature``.

Rows are processed in chunks of at most :data:`CHUNK_ELEMENTS` values, and only the logits (which
the model produced anyway, in their own dtype) and per-row values are kept for backward: backward
recomputes ``log p`` chunk by chunk. The vocabulary-sized float32 tensors of a direct autograd
formulation (the float32 copy, ``log p``, ``p`` and their products: 4 x 4 bytes per vocabulary
entry per token, 2.4 MB per token for a 152k vocabulary) never exist for more than one chunk.
Values equal a direct ``log_softmax`` over the whole tensor (the same operations on each row);
gradients agree with autograd's to float rounding (``core_rl.testing.reference.token_logprobs``
is that formulation, for tests).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: the most logits one chunk turns into float32 temporaries (each such temporary is 4 bytes a
#: value: 256 MiB at this size); rows per chunk = CHUNK_ELEMENTS // vocabulary
CHUNK_ELEMENTS = 2**26


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) ``[b, t]`` float32 aligned with ``input_ids``.

    With ``z_{t-1} = logits[:, t-1] / temperature`` (the prediction of token ``t``), for ``t >= 1``:

    - ``logprob[:, t] = log_softmax(z_{t-1})[input_ids[:, t]]``
    - ``entropy[:, t] = -sum_v p_v log p_v`` with ``p = softmax(z_{t-1})``

    Position 0 (no prediction) and padding (``attention_mask == 0``) hold 0; padding is zeroed
    with ``where`` (not a product) so a non-finite value there cannot leak into sums.
    ``entropy_grad=False`` gives the entropy without gradient (a metric only). Computed in chunks,
    keeping for backward only the logits and per-token values (module docstring).
    """
    logprob, entropy = prediction_stats(
        logits, next_tokens(input_ids), temperature, with_entropy=with_entropy, entropy_grad=entropy_grad
    )
    logprobs = align_to_tokens(logprob[:, :-1], attention_mask)
    if entropy is None:
        return logprobs, None
    return logprobs, align_to_tokens(entropy[:, :-1], attention_mask)


def next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """The token each position of ``input_ids`` ``[b, T]`` predicts: ``input_ids[:, t + 1]``; the last
    position's target is a filler (``input_ids[:, 0]``), whose values callers drop."""
    return torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)


def prediction_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p_y`` (and ``H``) ``[b, t]`` float32 of each prediction ``logits`` ``[b, t, V]`` for its
    target ``targets`` ``[b, t]``, at the prediction's own position (not yet aligned to tokens:
    :func:`token_logprobs` does that). Differentiable when ``logits`` needs a gradient, computed in
    chunks (module docstring)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows, width, vocab = logits.shape
    flat, flat_targets = logits.reshape(rows * width, vocab), targets.reshape(-1)
    if torch.is_grad_enabled() and logits.requires_grad:
        logprob, entropy = _ChunkedLogprobs.apply(flat, flat_targets, float(temperature), with_entropy, entropy_grad)
    else:
        logprob, entropy = _chunked_stats(flat, flat_targets, float(temperature), with_entropy)
    return logprob.view(rows, width), (entropy.view(rows, width) if with_entropy else None)


def align_to_tokens(per_prediction: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b, T-1]`` values of the predictions made at positions ``0..T-2`` (of tokens ``1..T-1``)
    placed on the tokens they predict: ``[b, T]`` with column 0 and padding set to 0 (with
    ``where``, so a non-finite value on padding cannot leak). Engines that compute log-probs their
    own way (e.g. on vocabulary-parallel logits) use it to keep the same alignment. Trailing
    dimensions (``[b, T-1, k]``: several values per prediction) are carried along."""
    real = attention_mask[:, 1:] != 0
    real = real.view(*real.shape, *([1] * (per_prediction.ndim - 2)))
    zero_col = per_prediction.new_zeros(per_prediction.shape[0], 1, *per_prediction.shape[2:])
    return torch.cat([zero_col, torch.where(real, per_prediction, torch.zeros_like(per_prediction))], dim=1)


def chunk_rows(vocab: int) -> int:
    """Rows of a ``vocab``-wide logits matrix per chunk: :data:`CHUNK_ELEMENTS` values, at least one row."""
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def chunk_slices(count: int, vocab: int) -> Iterator[slice]:
    """Slices of ``count`` rows of a ``vocab``-wide matrix, :func:`chunk_rows` rows each (the last
    one shorter)."""
    step = chunk_rows(vocab)
    for start in range(0, count, step):
        yield slice(start, start + step)


def scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` in float32, rows of one chunk (at most one float32
    temporary besides the result: the scaled copy, divided in place when it is a copy; no division
    at temperature 1, which would change no value)."""
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature if scaled.data_ptr() == logits.data_ptr() else scaled.div_(temperature)
    return torch.log_softmax(scaled, dim=-1)


def _chunked_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log p_y, H or None)`` per row of ``logits`` ``[N, V]``, each ``[N]`` float32 (no autograd)."""
    count = logits.shape[0]
    logprob = torch.empty(count, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logprob) if with_entropy else None
    with torch.no_grad():
        for part in chunk_slices(count, logits.shape[-1]):
            write_chunk_stats(scaled_log_softmax(logits[part], temperature), targets, part, logprob, entropy)
    return logprob, entropy


def write_chunk_stats(
    logp: torch.Tensor, targets: torch.Tensor, part: slice, logprob: torch.Tensor, entropy: torch.Tensor | None
) -> None:
    """Write ``log p_y`` and (into ``entropy`` unless ``None``) ``H = -sum_v p_v log p_v`` of the
    chunk ``part``'s rows, from their float32 ``log p`` ``[n, V]``."""
    logprob[part] = logp.gather(-1, targets[part, None]).squeeze(-1)
    if entropy is not None:
        entropy[part] = logp.exp().mul_(logp).sum(-1).neg_()


class _ChunkedLogprobs(torch.autograd.Function):
    """:func:`_chunked_stats` with the gradient of the module docstring, recomputed chunk by chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logprob, entropy = _chunked_stats(logits, targets, temperature, with_entropy)
        ctx.temperature = temperature
        keep_for_backward(ctx, entropy, entropy_grad, logits, targets)
        return logprob, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None, None]:
        # autograd hands zeros for an output the loss did not use (materialised gradients)
        logits, targets, entropy = ctx.saved_tensors
        temperature, use_entropy = ctx.temperature, ctx.entropy_grad
        grad = torch.empty_like(logits)
        for part in chunk_slices(logits.shape[0], logits.shape[-1]):
            weight = grad_logprob[part].float()
            grad[part] = logit_gradient_(
                scaled_log_softmax(logits[part], temperature),
                targets[part],
                weight,
                grad_entropy[part].float() if use_entropy else None,
                entropy[part] if use_entropy else None,
                temperature,
            )
        return grad, None, None, None, None


def keep_for_backward(
    ctx: torch.autograd.function.FunctionCtx, entropy: torch.Tensor | None, entropy_grad: bool, *tensors: torch.Tensor
) -> None:
    """Save ``tensors`` and then the entropy (``None`` in its place unless it was computed and its
    gradient is wanted: ``ctx.entropy_grad``); an entropy without gradient is marked
    non-differentiable."""
    ctx.entropy_grad = entropy is not None and entropy_grad
    ctx.save_for_backward(*tensors, entropy if ctx.entropy_grad else None)
    if entropy is not None and not ctx.entropy_grad:
        ctx.mark_non_differentiable(entropy)


def logit_gradient_(
    logp: torch.Tensor,
    targets: torch.Tensor,
    target_weight: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
    temperature: float,
    grad_logprob: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient with respect to the logits of ``sum(g_lp log p_y + g_H H)`` for rows of one
    chunk, computed in place in ``logp`` (``[n, V]`` float32 ``log p``, consumed):
    ``(g_lp (1[v = y] - p_v) - g_H p_v (log p_v + H)) / temperature``.

    ``targets`` ``[n]`` (column of ``y``), ``target_weight`` ``[n]`` (``g_lp`` where ``y`` is one
    of these columns, 0 where it is not: a vocabulary slice), ``grad_logprob`` ``[n]`` (``g_lp``;
    ``None``: ``target_weight``), ``grad_entropy``/``entropy`` ``[n]`` (``None``: no entropy
    term). The columns may be a slice of the vocabulary: ``log p`` and ``H`` are then the full
    vocabulary's, and the result is the gradient of that slice. Several targets per row
    (``targets`` and ``target_weight`` ``[n, k]``, log-probs of several tokens of one prediction)
    sum their terms: ``sum_j g_j (1[v = y_j] - p_v)``."""
    if targets.ndim == 1:
        targets, target_weight = targets[:, None], target_weight[:, None]
    weight = (target_weight.sum(-1) if grad_logprob is None else grad_logprob)[:, None]
    dz = logp.exp()  # p, then d/dz = g_lp 1[v = y] - p (g_lp + g_H (log p + H)), in place
    if grad_entropy is not None and entropy is not None:
        dz.mul_(logp.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(weight))
    else:
        dz.mul_(weight)
    dz.neg_().scatter_add_(-1, targets, target_weight)
    return dz.div_(temperature)
