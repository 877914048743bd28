"""The forward of one micro-batch under Ulysses sequence parallelism (:mod:`core_rl_train_kit.ulysses`).

Every rank of the :class:`~core_rl_train_kit.ulysses.SequenceGroup` calls these with the same
micro-batch. The micro-batch is laid out as without sequence parallelism (``padded``: ``[b, T]``;
``packed``: one ``[1, S]`` row, :mod:`core_rl_train_kit.packed`), padded on the right to a width
``W`` the group's size divides, and the model runs on this rank's slice of the positions. Each
position's prediction of the next token is scored on the slice (the target of a slice's last
position is the next slice's first token: every rank holds the whole micro-batch's tokens), and
the per-position results are gathered, so every rank returns the same ``[b, T]`` values, in the
alignment of :func:`~core_rl_train_kit.logprobs.token_logprobs`, as
:func:`~core_rl_train_kit.packed.forward_logprobs` would.

Padding columns added for the group are masked as keys in the padded layout; in the packed layout
they form a row of their own, seen by no other row. Their values are dropped.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from core_rl_train_kit.fused_head import check_handed_on, fused_head
from core_rl_train_kit.logprobs import align_to_tokens, next_tokens, prediction_stats
from core_rl_train_kit.packed import PackedRows, pack_rows, unpack
from core_rl_train_kit.ulysses import KWARG, VARLEN, SequenceGroup, WholeSequence, gather_positions


class _Layout:
    """One micro-batch as the model sees it, widened for the group: ``ids``/``positions``/``targets``
    ``[b, W]``, ``mask`` ``[b, T]`` (the unwidened attention mask, or the packed row's
    ``continues``), ``width`` ``T``, ``packed`` (or ``None``) and the :class:`WholeSequence`."""

    def __init__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layout: str, sg: SequenceGroup, varlen: bool
    ) -> None:
        self.packed: PackedRows | None = pack_rows(input_ids, attention_mask) if layout == "packed" else None
        if self.packed is None:
            ids, self.mask = input_ids, attention_mask
            positions = torch.arange(ids.shape[1], device=ids.device)[None, :].expand_as(ids)
        else:
            ids, self.mask, positions = self.packed.input_ids, self.packed.continues, self.packed.position_ids
        rows, self.width = ids.shape
        extra = sg.padded_width(self.width) - self.width
        self.ids = F.pad(ids, (0, extra))
        self.targets = F.pad(next_tokens(ids), (0, extra))
        more = torch.arange(extra, device=ids.device)[None, :].expand(rows, extra)
        if self.packed is None:  # the rows go on into masked columns
            self.positions = torch.cat([positions, more + self.width], dim=1)
            valid = F.pad(self.mask != 0, (0, extra))
            segments = torch.zeros_like(self.ids)
            self.whole = WholeSequence(key_valid=valid, segments=segments)
        else:  # the added columns are a packed row of their own
            self.positions = torch.cat([positions, more], dim=1)
            segments = torch.cumsum(self.positions == 0, dim=1) - 1
            cu_seqlens, longest = None, 0
            if varlen:
                counts = torch.bincount(segments[0])
                cu_seqlens, longest = F.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32), int(counts.max())
            self.whole = WholeSequence(
                key_valid=torch.ones_like(self.ids, dtype=torch.bool),
                segments=segments,
                cu_seqlens=cu_seqlens,
                max_seqlen=longest,
            )
        self.local = sg.local(self.ids.shape[1])

    def run(self, model: nn.Module, sg: SequenceGroup) -> torch.Tensor:
        """The model's output (``logits``) on this rank's slice."""
        ids, positions = self.ids[:, self.local], self.positions[:, self.local]
        return model(input_ids=ids, position_ids=positions, use_cache=False, **{KWARG: (sg, self.whole)}).logits

    def to_tokens(self, per_position: torch.Tensor) -> torch.Tensor:
        """Gathered ``[b, W]`` per-position values -> ``[b, T]`` on the tokens they predict (padded layout)."""
        aligned = align_to_tokens(per_position[:, : self.width - 1], self.mask)
        return aligned if self.packed is None else unpack(aligned, self.packed)


def sharded_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sg: SequenceGroup,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    layout: str = "padded",
    attn_implementation: str | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~core_rl_train_kit.packed.forward_logprobs` of one micro-batch over the group (module
    docstring); ``attn_implementation``: the one attention runs (a varlen kernel gets the packed
    rows' boundaries)."""
    plan = _Layout(input_ids, attention_mask, layout, sg, attn_implementation in VARLEN)
    targets = plan.targets[:, plan.local]
    if fused:
        with fused_head(model, targets, temperature, with_entropy=with_entropy, entropy_grad=entropy_grad) as made:
            stats = plan.run(model, sg)
        check_handed_on(stats, made)
        if not with_entropy:
            stats = stats[..., :1]
    else:
        lp, ent = prediction_stats(
            plan.run(model, sg), targets, temperature, with_entropy=with_entropy, entropy_grad=entropy_grad
        )
        stats = lp[..., None] if ent is None else torch.stack([lp, ent], dim=-1)
    whole = gather_positions(stats, sg)
    logprobs = plan.to_tokens(whole[..., 0])
    if not with_entropy:
        return logprobs, None
    entropy = plan.to_tokens(whole[..., 1])
    return logprobs, entropy if entropy_grad else entropy.detach()


def sharded_values(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sg: SequenceGroup,
    *,
    layout: str = "padded",
    attn_implementation: str | None = None,
) -> torch.Tensor:
    """:func:`~core_rl_train_kit.packed.forward_values` of one micro-batch over the group."""
    plan = _Layout(input_ids, attention_mask, layout, sg, attn_implementation in VARLEN)
    scalar = plan.run(model, sg)[..., 0].float()
    return plan.to_tokens(gather_positions(scalar, sg))
