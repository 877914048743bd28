"""What the model sees of a micro-batch, and where its positions live under context parallelism.

Micro-batches are padded ``[b, w]`` rows (:mod:`core_rl_train_kit.microbatch`). Hook for
sequence packing: a packed micro-batch would build its inputs here instead (one ``[1, total]`` row,
positions restarting per sequence, and a block-diagonal mask, or Megatron's ``PackedSeqParams``
for Transformer Engine's THD layout); everything downstream consumes :class:`ModelInputs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
import torch.distributed as dist
from core_rl.protocol import TensorBatch
from core_rl_train_kit.microbatch import placeholder_micro_batch


@attrs.frozen
class MicroBatch:
    """One micro-batch: ``batch`` (its rows, cut to ``width`` columns), or ``None`` for a
    placeholder that keeps the collectives of ranks with fewer rows in step (see
    :func:`core_rl_train_kit.microbatch.placeholder_micro_batch`)."""

    batch: TensorBatch | None
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    #: indices of its rows in the batch it was cut from (empty for a placeholder)
    rows: tuple[int, ...] = ()

    @classmethod
    def of(cls, batch: TensorBatch, rows: Sequence[int]) -> MicroBatch:
        return cls(batch, batch["input_ids"], batch["attention_mask"], tuple(rows))

    @classmethod
    def placeholder(cls, pad_token_id: int) -> MicroBatch:
        dummy = placeholder_micro_batch(pad_token_id)
        return cls(None, dummy["input_ids"], dummy["attention_mask"])

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]


@attrs.frozen
class ModelInputs:
    """Arguments of ``GPTModel.forward`` for this rank, plus the positions (columns of the padded
    micro-batch) whose logits this rank computes and the padded width."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    positions: torch.Tensor
    padded_width: int

    def forward_kwargs(self) -> dict[str, torch.Tensor | None]:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": self.attention_mask}


def width_multiple(tp_size: int, sequence_parallel: bool, cp_size: int) -> int:
    """Sequence lengths must divide evenly: by the tensor-parallel size under sequence
    parallelism, and into ``2 * cp`` chunks under context parallelism."""
    return math.lcm(tp_size if sequence_parallel else 1, 2 * cp_size if cp_size > 1 else 1)


def cp_positions(width: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Columns held by context-parallel rank ``cp_rank``: the sequence is cut into ``2 * cp_size``
    equal chunks and rank ``r`` takes chunks ``r`` and ``2 * cp_size - 1 - r`` (Megatron's layout,
    which balances causal-attention work)."""
    if cp_size == 1:
        return torch.arange(width)
    chunk = width // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(second_start, second_start + chunk)])


def model_inputs(
    mb: MicroBatch,
    device: torch.device,
    *,
    multiple: int,
    pad_token_id: int,
    cp_size: int = 1,
    cp_rank: int = 0,
    explicit_mask: bool = True,
) -> ModelInputs:
    """Padded inputs for ``GPTModel``: ids right-padded to a multiple of ``multiple``, positions
    ``0..w-1``, and a causal mask (``[1, 1, w, w]``, True = masked) when ``explicit_mask`` (Megatron's
    local attention; Transformer Engine applies its own causal mask). Right padding needs no other
    mask: a real token never attends to the padding after it."""
    ids = mb.input_ids
    width = -(-ids.shape[1] // multiple) * multiple
    if width > ids.shape[1]:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], width - ids.shape[1]), pad_token_id)], dim=1)
    positions = cp_positions(width, cp_size, cp_rank)
    ids = ids[:, positions].to(device)
    position_ids = positions.to(device).unsqueeze(0).expand(ids.shape[0], -1)
    mask = None
    if explicit_mask:
        mask = torch.ones(width, width, dtype=torch.bool, device=device).triu(1)[positions.to(device)]
        mask = mask[None, None]
    return ModelInputs(ids, position_ids, mask, positions, width)


class _GatherColumns(torch.autograd.Function):
    """All-gather ``[b, n]`` per-rank values into ``[b, width]`` by each rank's columns; backward
    keeps this rank's columns of the gradient (the loss on the gathered tensor is computed
    identically on every rank, so each rank's gradient is already complete)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, width: int, cp_size: int, cp_rank: int, group: dist.ProcessGroup):  # type: ignore[override]
        parts = [torch.empty_like(local) for _ in range(cp_size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        full = local.new_zeros(local.shape[0], width)
        for r, part in enumerate(parts):
            full[:, cp_positions(width, cp_size, r).to(local.device)] = part
        ctx.mine = cp_positions(width, cp_size, cp_rank).to(local.device)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad[:, ctx.mine], None, None, None, None


def gather_columns(
    local: torch.Tensor, width: int, cp_size: int, cp_rank: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``[b, width]`` from every context-parallel rank's ``[b, n]`` columns (identity without
    context parallelism)."""
    if cp_size == 1:
        return local
    return _GatherColumns.apply(local, width, cp_size, cp_rank, group)
