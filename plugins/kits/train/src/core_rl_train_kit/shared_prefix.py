"""The ``shared`` micro-batch layout: rows that begin with the same prompt run it once.

A GRPO-style batch holds several samples of each prompt; in the ``padded`` and ``packed`` layouts
the model computes every row's prompt again (58% of the tokens of 8 prompts x 4 samples of 32
tokens after a 45-token chat prompt). Here the rows of a *unit* (rows of one micro-batch whose
first ``p`` tokens are identical) become one stream row::

    P[0] .. P[p-2] | P[p-1] r_1 | P[p-1] r_2 | ... | P[p-1] r_n

the shared tokens ``P[0..p-2]`` once, then one *segment* per row: the prompt's last token again,
then the row's own tokens after the prompt (``r_j``: its columns ``p..len_j-1``). ``p`` is a row's
prompt length, the columns before its first ``response_mask`` 1; rows group when ``p`` and their
first ``p`` tokens agree (whatever the response mask says beyond, only the identical prefix counts,
so a group is exact by construction).

- **Positions** (``position_ids``): a stream token's column in its padded row: ``0..p-2`` on the
  shared part, ``p-1, p, ...`` along each segment.
- **Attention** (``[g, 1, L, L]``, True = attend): the shared part is causal among itself; a
  segment's token sees the shared part and, causally, its own segment; a padding position sees
  only itself (a query that sees nothing gives NaN in SDPA). Every token thus sees exactly the
  tokens of its padded row before it, at the same positions: its hidden states, logits and value
  are the padded forward's up to float rounding. The mask goes to the model as a prepared 4D mask,
  which ``transformers`` (5.x, ``masking_utils.create_causal_mask`` / ``_preprocess_mask_arguments``)
  hands to the attention as it is: boolean for ``sdpa`` (and ``sdpa_float32``), additive float32
  (0 / the most negative float) for ``eager``, which adds the mask to the scores.
- **Predictions**: every segment repeats ``P[p-1]``, so each token's predictor is the previous
  position of its own segment, and :func:`~core_rl_train_kit.logprobs.token_logprobs` on the
  stream works unchanged with ``continues`` (0 at each stream row's start, at the heads of the
  segments after the first, and on padding) as the mask: the first segment's ``P[p-1]`` carries
  the prompt's last log-prob, the other copies' predictions are discarded.
- **Back to rows**: ``index`` ``[b, width]`` (into the flattened ``[g * L]`` stream) and ``valid``
  map every padded entry to its stream position (columns ``< p`` of every row of a unit to the
  shared part and the first segment's head), so log-probs, entropies, values and the fused
  head's statistics come back in the padded alignment and losses never see the layout. Autograd
  through the shared part sums the rows' gradients: the update is the padded one's.

A unit of one row (no ``response_mask``, no shared prompt, a prompt of one token) is the row itself
with a causal mask. Rows whose mask has holes (not right-padded) are not shared.

**Planning** (:func:`find_units`, :func:`plan_units`): units are formed over a rank's whole batch
before micro-batching, so a group's rows stay in one micro-batch; the planner packs units (cost:
``units x longest stream``, the padded cost over stream rows) within the token budget. A group
whose stream would outgrow the budget, or where a longer stream would cost more in attention than
it saves in tokens, is cut into several units (see :func:`best_unit_rows`).

**Cost** (:func:`plan_cost`): the masked attention kernels SDPA and eager run compute every query x
key pair of a row, so a stream of ``L`` tokens costs about ``L x (1 + L / span)`` token-equivalents,
``span`` (:func:`attention_span`) being the number of keys whose attention costs as much as one
token's matrix products (``(4 hidden + 3 intermediate + vocab / layers) / 2``: 4.3k for
SmolLM2-135M). The ``auto`` layout runs a plan shared when that cost is at least
:data:`AUTO_MIN_SAVING` below the padded plan's.

Not with sequence parallelism, varlen (flash-attn) or flex attention, nor models whose attention
does not follow a 4D mask (:func:`shared_unsupported`: sliding windows, chunked attention, layers
that are not full attention). As a backstop for architectures the configuration does not tell
apart (recurrent layers, positions derived from the mask), the runner checks the model once before
its first shared plan (:func:`probe`: two rows sharing a prompt, shared against padded). Top-k
log-probs and log-probs of given ids run padded. With dropout in training the rows of a unit
share the prompt's dropout mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from core_rl.data import row_lengths
from core_rl.loops import ModelShape
from core_rl.roles.hf import inner_model
from torch import nn

from core_rl_train_kit.microbatch import micro_batch_width
from core_rl_train_kit.packing import plan_micro_batches

#: attention implementations that take a prepared 4D mask: boolean ones, and ``eager`` (additive)
SHARED_ATTENTION = ("sdpa", "sdpa_float32", "eager")
#: the least relative saving (of :func:`plan_cost`) for which ``auto`` runs a plan shared
AUTO_MIN_SAVING = 0.2
#: :func:`attention_span` of a model whose shape is not known
DEFAULT_SPAN = 4096.0


@attrs.frozen
class Unit:
    """Rows (batch indices) run as one stream row: the first ``shared`` tokens once (0 for a unit
    of one row), then a segment per row; ``length`` the stream's length."""

    rows: tuple[int, ...]
    shared: int
    length: int


@attrs.frozen
class SharedRows:
    """A micro-batch of rows ``[b, width]`` in the shared layout (module docstring): ``input_ids``
    / ``position_ids`` / ``continues`` ``[g, L]``, ``attention`` ``[g, 1, L, L]`` (boolean, or
    additive float32 for eager attention), ``index`` ``[b, width]`` (positions in the flattened
    ``[g * L]`` stream; 0 on padding) and ``valid`` ``[b, width]``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    continues: torch.Tensor
    attention: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor


@attrs.frozen
class Planned:
    """One planned micro-batch: ``rows`` (batch indices) and, in the shared layout, ``units``:
    ``(rows, shared tokens)`` per stream row, in the order of ``rows`` (``None``: not shared)."""

    rows: list[int]
    units: tuple[tuple[int, int], ...] | None = None


# ---------------------------------------------------------------------------------------------
# the model


def _text_config(model: nn.Module) -> object | None:
    config = getattr(inner_model(model), "config", None)  # DeepSpeed's engine has a config of its own
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def model_attention(model: nn.Module) -> str | None:
    """The attention implementation ``model`` runs (its config's), ``None`` where unknown."""
    return getattr(_text_config(model), "_attn_implementation", None)


def shared_unsupported(model: nn.Module, attn_implementation: str | None) -> str | None:
    """Why ``model`` cannot run the shared layout (a phrase), or ``None`` where it can: its attention
    must take a prepared 4D mask (:data:`SHARED_ATTENTION`) and every layer must be full attention
    (no sliding window, chunked attention or recurrent layers, which the mask would not describe)."""
    attn = attn_implementation or model_attention(model)
    if attn not in SHARED_ATTENTION:
        return f"its attention {attn!r} takes no 4D attention mask (sdpa and eager do)"
    config = _text_config(model)
    if config is None:
        return "it has no config to check"
    types = getattr(config, "layer_types", None)
    if types and any(t != "full_attention" for t in types):
        return f"its layers are not all full attention ({sorted(set(types))})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"it uses a sliding window ({config.sliding_window})"
    if getattr(config, "attention_chunk_size", None):
        return "it uses chunked attention"
    return None


def attention_span(model: nn.Module) -> float:
    """Keys whose attention (per query, all layers, forward and backward) costs about what one
    token's matrix products do: ``(4 hidden + 3 intermediate + vocab / layers) / 2``, or
    :data:`DEFAULT_SPAN` where the model's shape is unknown (module docstring)."""
    config = _text_config(model)
    to_dict = getattr(config, "to_dict", None)
    shape = ModelShape.from_config(to_dict()) if callable(to_dict) else None
    if shape is None:
        return DEFAULT_SPAN
    return (4 * shape.hidden + 3 * shape.intermediate + shape.vocab / shape.layers) / 2


def probe(model: nn.Module, device: torch.device, *, additive: bool = False) -> str | None:
    """Check that ``model`` follows the shared layout's mask and positions (``None``), or say how
    it does not. One stream row of a 3-token prompt and two 3-token segments (the prompt's last
    token, then 2), run in eval mode without gradients (the caller sets the precision):

    - changing the first segment's tokens must leave the second's outputs as they are (a masked
      key adds an exact 0; a model that ignores the 4D mask lets the second segment see the first);
    - two identical segments must give the same outputs (up to rounding; a model that ignores
      ``position_ids`` puts the second at later positions).

    Both are compared against 0.1% of the outputs' scale (5% for 16-bit outputs): a correct model
    gives 0 and rounding (SmolLM2-135M: 0 and 1e-6 of the scale in float32, 0 and 0 in bfloat16),
    a broken one a change of the outputs' own size (SmolLM2-135M: 35-110% and 30%; a tiny random
    model's outputs hardly depend on positions: 2-3%). Each check compares the layout with itself,
    not with the padded forward, whose 16-bit rounding differs as much. Collective where the
    model's forward is (every rank of a sharded engine calls it)."""
    vocab = getattr(_text_config(model), "vocab_size", None) or 64
    a, b = max(vocab // 4, 1), max(vocab // 3, 1)
    prompt = [a, a + 1, a + 2]
    first, second, other = [b, b + 1], [b + 2, b + 3], [b + 4, b + 5]
    ids = torch.tensor(
        [
            [*prompt, *first, prompt[-1], *second],
            [*prompt, *other, prompt[-1], *second],
            [*prompt, *first, prompt[-1], *first],
        ],
        device=device,
    ) % max(vocab, 1)
    stream = share_rows(ids[:2, :5], torch.ones_like(ids[:2, :5]), [(2, 2)], additive=additive)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(
                input_ids=ids,
                attention_mask=stream.attention[:1].expand(3, -1, -1, -1),
                position_ids=stream.position_ids[:1].expand(3, -1),
                use_cache=False,
            ).logits
    finally:
        model.train(was_training)
    tolerance = 1e-3 if out.dtype in (torch.float32, torch.float64) else 5e-2
    out = out.float()
    scale = float(out.abs().max())
    seen = float((out[0, 5:] - out[1, 5:]).abs().max())
    shifted = float((out[2, 2:5] - out[2, 5:]).abs().max())
    tolerance *= scale
    if not math.isfinite(scale):
        return "its outputs on rows sharing a prompt are not finite"
    if seen > tolerance:
        return (
            f"a segment's outputs change with another segment's tokens (by {seen:.3g}, outputs' scale "
            f"{scale:.3g}): it does not follow the 4D attention mask"
        )
    if shifted > tolerance:
        return (
            f"identical segments give different outputs (by {shifted:.3g}, outputs' scale {scale:.3g}): "
            "it does not follow the position_ids"
        )
    return None


# ---------------------------------------------------------------------------------------------
# planning


def best_unit_rows(shared: int, segment: float, span: float) -> int:
    """How many rows of a group (``shared`` tokens in common, segments of ``segment`` tokens on
    average) one stream row should hold: ``k`` minimising the cost per row
    ``(shared + k segment)(1 + (shared + k segment) / span) / k`` of :func:`plan_cost`, i.e.
    ``sqrt(shared (span + shared)) / segment``, at least 1. Long responses after a short prompt
    give 1 (no sharing: the attention over one long stream would cost more than the prompt saves)."""
    if segment <= 0:
        return 1
    return max(1, round(math.sqrt(shared * (span + shared)) / segment))


def find_units(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor | None,
    budget: int,
    span: float = DEFAULT_SPAN,
) -> list[Unit] | None:
    """The batch's rows as units (module docstring), ordered by first row, or ``None`` when no two
    rows share (no ``response_mask``, no repeated prompt, or a row that is not right-padded).

    Rows group when their prompt length ``p`` (columns before the first ``response_mask`` 1,
    at least 2, less than the row's length) and first ``p`` tokens agree; a group is cut, in row
    order, into units of at most :func:`best_unit_rows` rows whose stream fits in ``budget``
    tokens (at least one row each)."""
    if response_mask is None or input_ids.shape[0] < 2:
        return None
    lengths = row_lengths(attention_mask)
    width = attention_mask.shape[1]
    real = attention_mask != 0
    cols = torch.arange(width, device=real.device)[None, :]
    if not torch.equal(real, cols < torch.as_tensor(lengths, device=real.device)[:, None]):
        return None
    response = (response_mask != 0) & real
    starts = torch.where(response.any(dim=1), response.int().argmax(dim=1), 0)
    ids = input_ids.detach().cpu().numpy()
    groups: dict[tuple[int, bytes], list[int]] = {}
    alone: list[int] = []
    for i, p in enumerate(starts.tolist()):
        if 2 <= p < lengths[i]:
            groups.setdefault((p, ids[i, :p].tobytes()), []).append(i)
        else:
            alone.append(i)
    units = [Unit((i,), 0, max(lengths[i], 1)) for i in alone]
    for (p, _), rows in groups.items():
        shared = p - 1
        segments = [lengths[i] - shared for i in rows]
        most = best_unit_rows(shared, sum(segments) / len(segments), span)
        current: list[int] = []
        size = shared
        for row, segment in zip(rows, segments, strict=True):
            if current and (len(current) >= most or size + segment > budget):
                units.append(_unit(current, shared, size))
                current, size = [], shared
            current.append(row)
            size += segment
        units.append(_unit(current, shared, size))
    if all(len(u.rows) == 1 for u in units):
        return None
    return sorted(units, key=lambda u: u.rows[0])


def _unit(rows: Sequence[int], shared: int, length: int) -> Unit:
    """A unit of ``rows`` (one row: the row itself, nothing shared)."""
    if len(rows) == 1:
        return Unit((rows[0],), 0, length)
    return Unit(tuple(rows), shared, length)


def _split(unit: Unit, lengths: Sequence[int]) -> list[Unit]:
    """``unit`` in two halves (by rows)."""
    half = len(unit.rows) // 2
    out = []
    for rows in (unit.rows[:half], unit.rows[half:]):
        size = unit.shared + sum(lengths[i] - unit.shared for i in rows)
        out.append(_unit(rows, unit.shared, max(size, 1)))
    return out


def plan_units(
    units: Sequence[Unit], lengths: Sequence[int], budget: int, min_num: int = 1, *, algorithm: str = "ffd"
) -> list[Planned]:
    """Micro-batches of whole units (:func:`~core_rl_train_kit.packing.plan_micro_batches` over
    the units' stream lengths, padded cost: ``units x longest stream <= budget``, a single longer
    unit alone), at least ``min(min_num, rows)`` of them: while there are fewer units than that,
    the longest unit of several rows is halved."""
    units = list(units)
    target = min(min_num, len(lengths))
    while len(units) < target:
        splittable = [u for u in units if len(u.rows) > 1]
        if not splittable:
            break
        worst = max(splittable, key=lambda u: u.length)
        at = units.index(worst)
        units[at : at + 1] = _split(worst, lengths)
    units.sort(key=lambda u: u.rows[0])
    plan = plan_micro_batches([u.length for u in units], budget, min_num, algorithm=algorithm)
    return [
        Planned(
            rows=[row for i in group for row in units[i].rows],
            units=tuple((len(units[i].rows), units[i].shared) for i in group),
        )
        for group in plan
    ]


def plan_cost(plan: Sequence[Planned], lengths: Sequence[int], span: float) -> float:
    """Token-equivalents of running ``plan``: per micro-batch ``n x w x (1 + w / span)`` for ``n``
    rows (stream rows when shared) of width ``w`` (the longest row or stream): the tokens and every
    query x key pair a masked attention computes (module docstring)."""
    total = 0.0
    for mb in plan:
        if not mb.rows:
            continue
        if mb.units is None:
            count, width = len(mb.rows), micro_batch_width(lengths, mb.rows)
        else:
            count, width = len(mb.units), max(_stream_lengths(mb.units, mb.rows, lengths))
        total += count * width * (1 + width / span)
    return total


def _stream_lengths(units: Sequence[tuple[int, int]], rows: Sequence[int], lengths: Sequence[int]) -> list[int]:
    out, at = [], 0
    for count, shared in units:
        mine = rows[at : at + count]
        out.append(max(1, shared + sum(lengths[i] - shared for i in mine)))
        at += count
    return out


# ---------------------------------------------------------------------------------------------
# the stream


def share_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    units: Sequence[tuple[int, int]],
    *,
    additive: bool = False,
) -> SharedRows:
    """The micro-batch ``[b, width]`` (right-padded; rows in unit order) as :class:`SharedRows`;
    ``units``: ``(rows, shared tokens)`` per stream row, covering the ``b`` rows in order. The
    caller guarantees that a unit's rows agree on their first ``shared + 1`` tokens and are longer
    than that (:func:`find_units`). ``additive``: the attention as a float32 mask to add to the
    scores (eager attention) instead of a boolean one."""
    if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask must be the same [b, T] shape")
    b, width = input_ids.shape
    if sum(count for count, _ in units) != b:
        raise ValueError(f"units {list(units)} do not cover the micro-batch's {b} rows")
    device = input_ids.device
    lengths = row_lengths(attention_mask)
    cols = torch.arange(width, device=device)
    valid = cols[None, :] < torch.as_tensor(lengths, device=device)[:, None]
    if not torch.equal(valid, attention_mask != 0):
        raise ValueError(
            "the shared layout needs right-padded rows (attention_mask 1s then 0s); "
            "set actor.micro_batch.layout: padded for masks with holes"
        )
    # per stream row: the source (row, column) of each position, its segment (-1: shared) and
    # whether its prediction counts; per padded row: where its columns start in the stream
    src_rows: list[torch.Tensor] = []
    src_cols: list[torch.Tensor] = []
    segments: list[torch.Tensor] = []
    heads: list[list[int]] = []
    offsets = torch.zeros(b, dtype=torch.long)  # stream position of column `shared` of each row's segment
    shared_of = torch.zeros(b, dtype=torch.long)
    unit_of = torch.zeros(b, dtype=torch.long)
    row = 0
    for u, (count, shared) in enumerate(units):
        first = row
        parts_r, parts_c, parts_s, starts = [], [], [], []
        if shared:
            parts_r.append(torch.full((shared,), first))
            parts_c.append(torch.arange(shared))
            parts_s.append(torch.full((shared,), -1))
        at = shared
        for j in range(count):
            i = first + j
            length = max(lengths[i], 1)
            if length <= shared:
                raise ValueError(f"row {i} has {lengths[i]} tokens, not more than the {shared} it shares")
            n = length - shared
            parts_r.append(torch.full((n,), i))
            parts_c.append(torch.arange(shared, length))
            parts_s.append(torch.full((n,), j))
            offsets[i], shared_of[i], unit_of[i] = at, shared, u
            starts.append(at)
            at += n
        src_rows.append(torch.cat(parts_r))
        src_cols.append(torch.cat(parts_c))
        segments.append(torch.cat(parts_s))
        heads.append(starts)
        row += count
    g = len(units)
    stream = max(len(s) for s in src_rows)
    row_index = torch.zeros(g, stream, dtype=torch.long)
    col_index = torch.zeros(g, stream, dtype=torch.long)
    segment = torch.full((g, stream), -2, dtype=torch.long)
    continues = torch.zeros(g, stream, dtype=torch.long)
    for u in range(g):
        n = len(src_rows[u])
        row_index[u, :n], col_index[u, :n], segment[u, :n] = src_rows[u], src_cols[u], segments[u]
        continues[u, 1:n] = 1
        continues[u, heads[u][1:]] = 0
        row_index[u, n:] = src_rows[u][0]
    row_index, col_index, segment, continues = (t.to(device) for t in (row_index, col_index, segment, continues))
    real = segment != -2
    ids = input_ids[row_index, col_index]
    q, k = segment[:, :, None], segment[:, None, :]
    allowed = cols.new_ones(stream, stream, dtype=torch.bool).tril()[None] & ((k == -1) | (k == q)) & real[:, None, :]
    allowed = allowed & real[:, :, None] | (~real[:, :, None] & torch.eye(stream, dtype=torch.bool, device=device))
    attention = allowed[:, None]
    if additive:
        attention = torch.zeros(attention.shape, dtype=torch.float32, device=device).masked_fill_(
            ~attention, torch.finfo(torch.float32).min
        )
    # padded entry (i, c) -> the stream: columns up to `shared` of the unit's shared part and first
    # head (identical tokens), later ones along the row's own segment
    offsets, shared_of, unit_of = offsets.to(device), shared_of.to(device), unit_of.to(device)
    per_row = torch.where(
        cols[None, :] <= shared_of[:, None], cols[None, :], offsets[:, None] + cols[None, :] - shared_of[:, None]
    )
    index = torch.where(valid, unit_of[:, None] * stream + per_row, torch.zeros_like(per_row))
    return SharedRows(
        input_ids=ids,
        position_ids=col_index,
        continues=continues,
        attention=attention,
        index=index,
        valid=valid,
    )
