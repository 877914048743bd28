"""The packed (padding-free) micro-batch layout and the model forward of a micro-batch in either layout.

**Packed.** The real tokens of the micro-batch's rows are concatenated into one ``[1, S]`` row
(``S = sum(lengths)``) with ``position_ids`` restarting at 0 at each row. Called without an
attention mask (and without a KV cache), a transformers decoder then attends block-diagonally:
each token sees only the earlier tokens of its own row, so logits equal the padded forward's. With
a varlen attention kernel (flash-attn) the boundaries are also passed as ``cu_seqlens`` (cumulative
lengths ``[0, l0, l0+l1, ..., S]``, int32), so no mask is ever built; SDPA and eager attention
materialise an ``S x S`` mask instead, which is why padded is the faster layout there
(``benchmarks/engines.py``).

**Shared.** Rows that begin with the same prompt run it once: one stream row per group of them,
with a 4D attention mask and explicit ``position_ids`` (:mod:`core_rl_train_kit.shared_prefix`);
the forwards here take that stream (:class:`~core_rl_train_kit.shared_prefix.SharedRows`) as
``stream`` and otherwise run padded.

Log-probs come back in the padded ``[rows, width]`` alignment of :func:`token_logprobs`, so losses
never see the layout.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from core_rl.errors import ConfigError
from core_rl.vision.media import forward_kwargs
from torch import nn

from core_rl_train_kit.fused_head import check_handed_on, fused_head
from core_rl_train_kit.logprobs import align_to_tokens, next_tokens, token_logprobs
from core_rl_train_kit.shared_prefix import SHARED_ATTENTION, SharedRows
from core_rl_train_kit.topk_logprobs import logprobs_at, topk_logprobs
from core_rl_train_kit.vision_tower import idle_vision_pass

LAYOUTS = ("auto", "padded", "packed", "shared")
#: attention implementations with a varlen kernel that takes ``cu_seqlens`` (no mask materialised)
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


@attrs.frozen
class PackedRows:
    """Rows ``[b, T]`` (right-padded, real lengths ``lengths``) packed into one row.

    ``input_ids``/``position_ids`` ``[1, S]``; ``continues`` ``[1, S]`` is 0 at each row's first
    token and 1 elsewhere (a row start is not predicted from the previous row's last token);
    ``cu_seqlens`` ``[b + 1]`` int32; ``max_seqlen`` the longest length; ``index`` ``[b, width]``
    the position in the packed row of each padded entry (0 on padding, masked by ``valid``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    continues: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    index: torch.Tensor
    valid: torch.Tensor


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack a right-padded ``[b, T]`` micro-batch (see :class:`PackedRows`). Each row's real tokens
    must be a prefix (``attention_mask`` 1s then 0s); a row with none still takes one position (so
    every row has a place; its values are discarded)."""
    if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask must be the same [b, T] shape")
    real = attention_mask != 0
    lengths = real.sum(dim=1)
    b, width = input_ids.shape
    prefix = torch.arange(width, device=input_ids.device)[None, :] < lengths[:, None]
    if not torch.equal(real, prefix):
        raise ValueError(
            "the packed layout needs right-padded rows (attention_mask 1s then 0s); "
            "set actor.micro_batch.layout: padded for masks with holes"
        )
    lengths = lengths.clamp(min=1)
    keep = torch.arange(width, device=input_ids.device)[None, :] < lengths[:, None]
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(width, device=input_ids.device)[None, :].expand(b, width)
    packed_ids = input_ids[keep][None, :]
    position_ids = positions[keep][None, :]
    continues = (position_ids != 0).long()
    index = torch.where(real, starts[:, None] + positions, torch.zeros_like(positions))
    cu_seqlens = torch.zeros(b + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    return PackedRows(
        input_ids=packed_ids,
        position_ids=position_ids,
        continues=continues,
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max().item()),
        index=index,
        valid=real,
    )


#: a micro-batch laid out for the model: packed, or shared (:mod:`core_rl_train_kit.shared_prefix`)
Stream = PackedRows | SharedRows


def unpack(values: torch.Tensor, packed: Stream) -> torch.Tensor:
    """``[1, S]`` (packed; ``[g, L]`` shared) per-token values back to the padded ``[b, width]``
    alignment, 0 on padding (differentiable); trailing dimensions (``[1, S, k]``) are carried along."""
    gathered = values.flatten(0, 1)[packed.index]
    valid = packed.valid.view(*packed.valid.shape, *([1] * (gathered.ndim - 2)))
    return torch.where(valid, gathered, torch.zeros_like(gathered))


def pack_values(values: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """Padded ``[b, width, ...]`` per-token values in the packed ``[1, S, ...]`` row (the inverse of
    :func:`unpack`; 0 on the place of a row without tokens)."""
    out = values.new_zeros(1, packed.input_ids.shape[1], *values.shape[2:])
    out[0, packed.index[packed.valid]] = values[packed.valid]
    return out


def resolve_layout(layout: str, attn_implementation: str | None, unshareable: str | None = None) -> str:
    """``auto`` -> ``packed`` with a varlen attention kernel (:data:`VARLEN_ATTENTION`); else
    ``shared`` where the model can run it (attention that takes a 4D mask, ``unshareable`` ``None``:
    :func:`~core_rl_train_kit.shared_prefix.shared_unsupported` says why not), which runs a
    micro-batch plan shared where that saves work and padded otherwise; else ``padded`` (SDPA/eager
    would materialise the packed mask; measured slower on CPU). An explicit ``shared`` the model
    cannot run is a :class:`~core_rl.errors.ConfigError`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown micro-batch layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if attn_implementation not in SHARED_ATTENTION:
        unshareable = unshareable or f"its attention {attn_implementation!r} takes no 4D attention mask"
    if layout == "shared" and unshareable is not None:
        raise ConfigError(
            [f"actor.micro_batch.layout: shared cannot run on this model: {unshareable}; use auto or padded"]
        )
    if layout != "auto":
        return layout
    if attn_implementation in VARLEN_ATTENTION:
        return "packed"
    return "shared" if unshareable is None else "padded"


def _pack(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, layout: str, stream: Stream | None = None
) -> Stream | None:
    """The micro-batch as the model sees it: ``stream`` where given (already laid out), packed
    (``packed`` layout) or ``None`` (``padded``; ``shared`` without a stream)."""
    if stream is not None:
        return stream
    if layout not in LAYOUTS[1:]:
        raise ValueError(f"layout must be padded, packed or shared here, got {layout!r}")
    return pack_rows(input_ids, attention_mask) if layout == "packed" else None


def _forward_outputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    layout: str,
    varlen_kwargs: bool,
    packed: Stream | None = None,
    media: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, Stream | None]:
    """The model's ``logits`` of one micro-batch: ``[b, width, ...]`` padded, or ``[1, S, ...]``
    (``[g, L, ...]`` shared) with the :class:`PackedRows` (:class:`SharedRows`) to unpack them
    (``packed``: already laid out). ``media``: the rows' pixel inputs (a vision-language model's,
    :func:`core_rl.vision.media.row_media`), which run padded only."""
    if media:
        if layout != "padded" or packed is not None:
            raise ValueError(f"rows with images run in the padded layout, not {layout}")
        extra = forward_kwargs(model, input_ids, media)
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra).logits, None
    if packed is None:
        packed = _pack(input_ids, attention_mask, layout)
    with idle_vision_pass(model, input_ids.device):  # a VLM's tower runs on every rank (vision_tower.py)
        return _text_logits(model, input_ids, attention_mask, packed, varlen_kwargs)


def _text_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    packed: Stream | None,
    varlen_kwargs: bool,
) -> tuple[torch.Tensor, Stream | None]:
    """:func:`_forward_outputs` of rows without images, laid out as ``packed`` says (``None``: padded)."""
    if packed is None:
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits, None
    if isinstance(packed, SharedRows):
        out = model(
            input_ids=packed.input_ids,
            attention_mask=packed.attention,
            position_ids=packed.position_ids,
            use_cache=False,
        )
        return out.logits, packed
    kwargs: dict[str, object] = {}
    if varlen_kwargs:
        kwargs = {
            "cu_seq_lens_q": packed.cu_seqlens,
            "cu_seq_lens_k": packed.cu_seqlens,
            "max_length_q": packed.max_seqlen,
            "max_length_k": packed.max_seqlen,
        }
    logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **kwargs).logits
    return logits, packed


def forward_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    layout: str = "padded",
    varlen_kwargs: bool = False,
    fused: bool = False,
    stream: SharedRows | None = None,
    media: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) ``[b, width]`` of one micro-batch through a causal LM, in the
    ``padded`` or ``packed`` layout, or the shared one given its ``stream`` (see the module
    docstring; identical results up to float rounding). ``varlen_kwargs`` also passes
    ``cu_seqlens`` / max lengths for flash-attn;
    ``entropy_grad``: see :func:`~core_rl_train_kit.logprobs.token_logprobs`; ``fused``: from
    the hidden states and the head's weight, the logits never whole
    (:mod:`core_rl_train_kit.fused_head`); ``media``: the rows' pixel inputs (padded layout only)."""
    if not fused:
        lp, ent, _ = forward_logprobs_at(
            model,
            input_ids,
            attention_mask,
            None,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            layout=layout,
            varlen_kwargs=varlen_kwargs,
            stream=stream,
            media=media,
        )
        return lp, ent
    packed = None if media else _pack(input_ids, attention_mask, layout, stream)
    ids, mask = (input_ids, attention_mask) if packed is None else (packed.input_ids, packed.continues)
    targets = next_tokens(ids)  # position i predicts token i + 1
    with fused_head(model, targets, temperature, with_entropy=with_entropy, entropy_grad=entropy_grad) as produced:
        stats, _ = _forward_outputs(
            model,
            input_ids,
            attention_mask,
            layout="padded" if media else layout,
            varlen_kwargs=varlen_kwargs,
            packed=packed,
            media=media,
        )
    check_handed_on(stats, produced)
    lp = align_to_tokens(stats[:, :-1, 0], mask)
    ent = None
    if with_entropy:
        ent = align_to_tokens(stats[:, :-1, 1], mask)
        ent = ent if entropy_grad else ent.detach()
    if packed is None:
        return lp, ent
    return unpack(lp, packed), (unpack(ent, packed) if ent is not None else None)


def forward_logprobs_at(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    token_ids: torch.Tensor | None,
    *,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    layout: str = "padded",
    varlen_kwargs: bool = False,
    stream: SharedRows | None = None,
    media: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`forward_logprobs` (not fused) and, from the same logits, the log-probs ``[b, width, k]``
    of the tokens ``token_ids`` ``[b, width, k]`` in the same alignment: ``[:, t, j]`` is
    ``log p(token_ids[:, t, j])`` under the prediction of token ``t`` (made at ``t - 1``), 0 at
    column 0 and on padding (:func:`~core_rl_train_kit.topk_logprobs.logprobs_at`; ``None``
    without ``token_ids``, which the shared layout does not take: its rows share prompt positions)."""
    if token_ids is not None and stream is not None:
        raise ValueError("log-probs of given ids run padded or packed, not shared")
    if media:  # rows with images run padded (their position ids are the model's own, e.g. M-RoPE)
        layout, stream = "padded", None
    packed = _pack(input_ids, attention_mask, layout, stream)
    ids, mask = (input_ids, attention_mask) if packed is None else (packed.input_ids, packed.continues)
    logits, _ = _forward_outputs(
        model, input_ids, attention_mask, layout=layout, varlen_kwargs=varlen_kwargs, packed=packed, media=media
    )
    lp, ent = token_logprobs(logits, ids, mask, temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)
    at = None
    if token_ids is not None:
        wanted = token_ids if not isinstance(packed, PackedRows) else pack_values(token_ids, packed)
        # position i predicts token i + 1: the ids moved one column left (the last column's are
        # read and dropped), so the whole logits go in as they are, never a sliced copy
        shifted = torch.cat([wanted[:, 1:], torch.zeros_like(wanted[:, :1])], dim=1)
        at = align_to_tokens(logprobs_at(logits, shifted, temperature)[:, :-1], mask)
    if packed is None:
        return lp, ent, at
    return tuple(None if x is None else unpack(x, packed) for x in (lp, ent, at))  # type: ignore[return-value]


def forward_topk(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    k: int,
    *,
    temperature: float,
    vocab_size: int | None = None,
    layout: str = "padded",
    varlen_kwargs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens (among the first ``vocab_size``; ``None``: all) of the
    prediction of every token of one micro-batch: ids ``[b, width, k]`` (long) and log-probs
    ``[b, width, k]`` (float32), in the alignment of :func:`token_logprobs` (``[:, t]`` from the
    prediction made at ``t - 1``; 0 at column 0 and on padding;
    :func:`~core_rl_train_kit.topk_logprobs.topk_logprobs`)."""
    logits, packed = _forward_outputs(model, input_ids, attention_mask, layout=layout, varlen_kwargs=varlen_kwargs)
    mask = attention_mask if packed is None else packed.continues
    ids, values = topk_logprobs(logits, k, temperature, vocab_size)  # the last position's are dropped
    ids, values = align_to_tokens(ids[:, :-1], mask), align_to_tokens(values[:, :-1], mask)
    if packed is None:
        return ids, values
    return unpack(ids, packed), unpack(values, packed)


def forward_values(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    layout: str = "padded",
    varlen_kwargs: bool = False,
    stream: SharedRows | None = None,
) -> torch.Tensor:
    """Values ``[b, width]`` float32 of one micro-batch through a value model (a token
    classifier with one output, e.g. ``LlamaForTokenClassification``), in the alignment of
    :func:`token_logprobs`: position ``t`` holds the output at ``t - 1`` (the value of the state
    before token ``t``); position 0 and padding hold 0. ``stream``: the shared layout's."""
    out, packed = _forward_outputs(
        model, input_ids, attention_mask, layout=layout, varlen_kwargs=varlen_kwargs, packed=stream
    )
    scalar = out[..., 0].float()
    if packed is None:
        return align_to_tokens(scalar[:, :-1], attention_mask)
    return unpack(align_to_tokens(scalar[:, :-1], packed.continues), packed)
