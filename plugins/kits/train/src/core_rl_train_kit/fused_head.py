"""Log-probs and entropies straight from the last hidden states and the output head's weight, the
logits never whole (``actor.fused_head``).

With ``h`` the final hidden states ``[N, H]``, ``W`` the head's weight ``[V, H]`` (no bias) and the
targets ``y``, rows are taken a chunk at a time (:func:`core_rl_train_kit.logprobs.chunk_rows`):
``logits = h_c W^T`` in the compute dtype, then the log-probs and entropies of
:mod:`core_rl_train_kit.logprobs` (the same float32 softmax). Backward recomputes each chunk's
logits and, with ``dz`` the gradient with respect to them
(:func:`~core_rl_train_kit.logprobs.logit_gradient_`), gives ``dh_c = dz W`` and
``dW = sum_c dz^T h_c`` (each product and the sum in float32). Kept for backward: ``h`` and ``W``
(which the model holds anyway) and a few values per token; the ``[N, V]`` logits and their
gradient (``4 V`` bytes per token in bf16, 0.6 MB for a 152k vocabulary) never exist beyond one
chunk. The cost: the head's matrix product runs once more in backward.

The compute dtype is the autocast dtype where autocast is on, else the weight's; backward runs in
the same dtype (autograd runs it outside autocast). The model's forward must hand the head's output
on unchanged (no soft-capping or scaling of the logits): :func:`check_fusable` says which models
cannot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from core_rl.config.fused_head import logit_transform
from core_rl.errors import ConfigError
from core_rl.roles.hf import inner_model
from torch import nn

from core_rl_train_kit.logprobs import (
    chunk_slices,
    keep_for_backward,
    logit_gradient_,
    scaled_log_softmax,
    write_chunk_stats,
)


def output_head(model: nn.Module) -> nn.Module:
    """The causal LM's output head (``get_output_embeddings()``), through engine wrappers that
    keep the model as ``.module`` (DeepSpeed) and peft's."""
    inner = model
    while not hasattr(inner, "get_output_embeddings") and hasattr(inner, "module"):
        inner = inner.module
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output head (get_output_embeddings())")
    return head


def check_fusable(model: nn.Module) -> str | None:
    """Why ``model``'s log-probs cannot be computed from its hidden states and head weight (a
    sentence naming the model's setting), or ``None`` where they can: the head must be a plain
    linear layer without bias (not an adapter-wrapped or quantised one), and the model must not
    transform the logits after it (:data:`core_rl.config.fused_head.LOGIT_TRANSFORMS`)."""
    try:
        head = output_head(model)
    except ValueError as exc:
        return str(exc)
    if not isinstance(head, nn.Linear) or hasattr(head, "base_layer"):
        return f"its output head is a {type(head).__name__}, not a plain linear layer"
    if head.bias is not None:
        return "its output head has a bias"
    transform = logit_transform(getattr(inner_model(model), "config", None))  # DeepSpeed's engine has a config too
    if transform is not None:
        return f"its config sets {transform}, which transforms the logits after the head"
    return None


@contextlib.contextmanager
def fused_head(
    model: nn.Module, targets: torch.Tensor, temperature: float, *, with_entropy: bool, entropy_grad: bool = True
) -> Iterator[list[torch.Tensor]]:
    """While inside, ``model``'s output head returns ``[..., 2]`` per position: the log-prob of
    ``targets`` (same shape as the positions, the token each position predicts) and the entropy
    (0 without ``with_entropy``), float32, in place of the logits. The head is still called by the
    model's forward (so wrappers that gather or shard its weight around that call keep doing so);
    only its ``forward`` is replaced, and restored on leaving. Yields the list of what the head
    returned (for :func:`check_handed_on`)."""
    head = output_head(model)
    if "forward" in vars(head):
        raise RuntimeError("the output head's forward is already replaced (a fused head inside another)")

    produced: list[torch.Tensor] = []

    def stats(hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape[:-1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        lp, ent = fused_head_stats(
            flat,
            head.weight,
            targets.reshape(-1),
            temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
        ent = ent if ent is not None else torch.zeros_like(lp)
        out = torch.stack([lp.view(shape), ent.view(shape)], dim=-1)  # not a view (FSDP hooks its output)
        produced.append(out)
        return out

    head.forward = stats  # type: ignore[method-assign]
    try:
        yield produced
    finally:
        del head.forward


def check_handed_on(output: torch.Tensor, produced: list[torch.Tensor]) -> None:
    """The model's output (its ``logits``) must be what the fused head returned, unchanged: a model
    that soft-caps, scales or otherwise transforms the head's output after it (one
    :data:`~core_rl.config.fused_head.LOGIT_TRANSFORMS` does not list) would otherwise get log-probs
    without that transform. Compared by storage (an engine's hooks may hand on a detached alias)."""
    if len(produced) == 1 and output.shape == produced[0].shape and output.data_ptr() == produced[0].data_ptr():
        return
    raise ConfigError(
        "fused_head: the model's forward did not hand the output head's result on unchanged (it transforms "
        "the logits after the head, or calls the head more than once), so log-probs cannot come from the head's "
        "weight alone; set fused_head: false for this model"
    )


def fused_head_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log p_y, H or None)``, each ``[N]`` float32, of the logits ``hidden [N, H] @ weight[V, H]^T``
    at ``temperature`` (module docstring), computed in chunks."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = _compute_dtype(hidden, weight)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _FusedHeadStats.apply(hidden, weight, targets, float(temperature), dtype, with_entropy, entropy_grad)
    return _stats(hidden, weight, targets, float(temperature), dtype, with_entropy)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The values of :func:`fused_head_stats`, without autograd."""
    count = hidden.shape[0]
    logprob = torch.empty(count, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty_like(logprob) if with_entropy else None
    with torch.no_grad(), _no_autocast(hidden):
        w = weight.to(dtype)
        for part in chunk_slices(count, weight.shape[0]):
            logp = scaled_log_softmax(hidden[part].to(dtype) @ w.T, temperature)
            write_chunk_stats(logp, targets, part, logprob, entropy)
    return logprob, entropy


#: vocabulary rows of the weight's gradient per product (bounds the product's float32 temporary:
#: ``VOCAB_BLOCK x H`` values)
VOCAB_BLOCK = 8192


def _accumulate_products(total: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """``total += dz^T h`` (``total`` float32 ``[V, H]``; ``dz`` ``[n, V]`` and ``h`` ``[n, H]`` in
    the compute dtype): in place when that is float32, else a block of :data:`VOCAB_BLOCK` rows at
    a time, each product float32 before it is added: 16-bit inputs with a float32 result on CUDA
    (cuBLAS accumulates in float32 either way), inputs widened elsewhere. A product rounded to 16
    bits once a chunk would add one rounding a chunk, where autograd's single product has one."""
    if dz.dtype == total.dtype:
        total.addmm_(dz.T, h)
        return
    native = dz.is_cuda and dz.dtype in (torch.float16, torch.bfloat16)
    if not native:
        h = h.float()
    for start in range(0, total.shape[0], VOCAB_BLOCK):
        block = slice(start, start + VOCAB_BLOCK)
        if native:
            total[block] += torch.mm(dz[:, block].T, h, out_dtype=torch.float32)
        else:
            total[block].addmm_(dz[:, block].T.float(), h)


def _no_autocast(tensor: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Autocast off for ``tensor``'s device: the chunks' dtypes are set explicitly."""
    return torch.autocast(tensor.device.type, enabled=False)


class _FusedHeadStats(torch.autograd.Function):
    """:func:`_stats` with the gradient of the module docstring, recomputed chunk by chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        dtype: torch.dtype,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logprob, entropy = _stats(hidden, weight, targets, temperature, dtype, with_entropy)
        ctx.temperature, ctx.dtype = temperature, dtype
        keep_for_backward(ctx, entropy, entropy_grad, hidden, weight, targets)
        return logprob, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        # autograd hands zeros for an output the loss did not use (materialised gradients)
        hidden, weight, targets, entropy = ctx.saved_tensors
        temperature, dtype, use_entropy = ctx.temperature, ctx.dtype, ctx.entropy_grad
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # accumulated in float32 (a 16-bit sum rounded once a chunk drifts several times further
        # from autograd's single product), through vocabulary blocks (no weight-sized temporary)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        with _no_autocast(hidden):
            w = weight.to(dtype)
            for part in chunk_slices(hidden.shape[0], weight.shape[0]):
                h = hidden[part].to(dtype)
                weight_lp = grad_logprob[part].float()
                dz = logit_gradient_(
                    scaled_log_softmax(h @ w.T, temperature),
                    targets[part],
                    weight_lp,
                    grad_entropy[part].float() if use_entropy else None,
                    entropy[part] if use_entropy else None,
                    temperature,
                ).to(dtype)
                if grad_hidden is not None:
                    grad_hidden[part] = dz @ w
                if grad_weight is not None:
                    _accumulate_products(grad_weight, dz, h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None
