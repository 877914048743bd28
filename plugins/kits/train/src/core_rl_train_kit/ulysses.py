"""Ulysses sequence parallelism: the positions of one micro-batch split over the ranks of a group.

The ``n`` ranks of a :class:`SequenceGroup` hold the same micro-batch, padded to a width ``W`` that
``n`` divides; rank ``r`` runs the model on positions ``[r W/n, (r+1) W/n)`` only. Everything but
attention works position by position (embeddings, projections, norms, MLP, the head), so it runs on
the slice unchanged, with the slice's own ``position_ids`` for the rotary embedding. Attention needs
every position: :func:`ulysses_attention` turns the query, key and value of ``H`` heads over
``W/n`` positions into ``H/n`` heads over all ``W`` positions (one all-to-all each), runs the
model's own attention implementation on whole sequences under the mask of the whole micro-batch
(causal, key padding, packed-row boundaries, sliding window), and turns the result back with a
second all-to-all. Activation memory per rank is ``1/n`` of the micro-batch's.

The attention function is registered with transformers under :func:`registered_name` (``ulysses_sdpa``,
``ulysses_fa2``, ...: a name without "flash", which transformers would take for a flash-attn kernel
to fetch) by :func:`register`. The group and the whole micro-batch's :class:`WholeSequence` reach it as the
model call's keyword argument :data:`KWARG` (transformers hands a model's extra keyword arguments
down to its attention functions, also when activation checkpointing recomputes a layer in
backward); transformers itself builds no mask for it (none is registered), so the local slice's
shape never produces a wrong one.

Results per position (log-probs, entropies, values) are gathered with :func:`gather_positions`;
its backward hands each rank the gradient of its own positions, not a sum over ranks. So when
every rank of the group computes the same loss from the gathered values, the parameter gradients
of the group's ranks sum to the gradient of that loss (an engine that averages gradients over all
ranks and scales each micro-batch's loss by the world size then updates by the global batch's
gradient, as without sequence parallelism).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.distributed as dist
from core_rl.config.sequence_parallel import ATTENTION
from core_rl.errors import ConfigError
from core_rl.launch import collective_timeout

#: the model call's keyword argument that carries ``(SequenceGroup, WholeSequence)`` to attention
KWARG = "core_rl_sequence"
#: inner implementations that take the packed rows as ``cu_seqlens`` and padding as a 2D mask
VARLEN = ("flash_attention_2", "flash_attention_3")


@attrs.frozen
class SequenceGroup:
    """``size`` consecutive ranks sharing micro-batches; this rank is ``index`` among ``ranks``.
    ``group`` is ``None`` for a group of one (nothing to exchange)."""

    group: Any
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def padded_width(self, width: int) -> int:
        """The smallest multiple of ``size`` that is at least ``width``."""
        return math.ceil(width / self.size) * self.size

    def local(self, width: int) -> slice:
        """This rank's positions of a ``width``-wide micro-batch (``size`` divides ``width``)."""
        part = width // self.size
        return slice(self.index * part, (self.index + 1) * part)


def sequence_groups(size: int) -> SequenceGroup:
    """This rank's group when the world is cut into groups of ``size`` consecutive ranks. Collective:
    every rank creates every group (``torch.distributed.new_group``, with the run's collective
    timeout), in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"sequence_parallel_size {size} must divide the world size {world}")
    mine: SequenceGroup | None = None
    for start in range(0, world, size):
        ranks = tuple(range(start, start + size))
        group = dist.new_group(list(ranks), timeout=collective_timeout()) if size > 1 else None
        if rank in ranks:
            mine = SequenceGroup(group=group, ranks=ranks, index=ranks.index(rank))
    assert mine is not None
    return mine


def engine_group(size: int, world_size: int, *, engine: str) -> SequenceGroup | None:
    """The group of a train engine's ``sequence_parallel_size`` (``None`` for 1); a
    :class:`~core_rl.errors.ConfigError` naming ``engine`` when ``size`` does not divide the ranks."""
    if size == 1:
        return None
    if world_size % size:
        raise ConfigError(
            [
                f"{engine} engine (the role's engine section): sequence_parallel_size: {size} must divide the number "
                f"of ranks ({world_size}); start a multiple of {size} processes or lower it"
            ]
        )
    return sequence_groups(size)


def check_heads(model_config: Any, size: int, *, engine: str) -> None:
    """Each rank of a group attends with ``1/size`` of the key/value heads: ``size`` must divide them
    (a :class:`~core_rl.errors.ConfigError` naming ``engine`` otherwise)."""
    heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    if heads % size:
        raise ConfigError(
            [
                f"{engine} engine (the role's engine section): sequence_parallel_size: {size} must divide the "
                f"model's key/value heads ({heads}); choose a divisor of them"
            ]
        )


# ---------------------------------------------------------------------------------- collectives


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any, size: int) -> torch.Tensor:
    """Split ``x`` in ``size`` parts along ``scatter_dim``, send part ``r`` to rank ``r`` of ``group``,
    and concatenate what arrives (in rank order) along ``gather_dim``."""
    parts = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """:func:`_all_to_all`; its backward is the all-to-all the other way round."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, scatter_dim: int, gather_dim: int, sg: SequenceGroup
    ) -> torch.Tensor:
        ctx.dims, ctx.sg = (scatter_dim, gather_dim), sg
        return _all_to_all(x, scatter_dim, gather_dim, sg.group, sg.size)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.sg.group, ctx.sg.size), None, None, None


def heads_to_positions(x: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """``[b, H, W/n, d]`` (all heads, this rank's positions) -> ``[b, H/n, W, d]`` (this rank's heads,
    every position)."""
    return x if sg.size == 1 else _AllToAll.apply(x, 1, 2, sg)


def positions_to_heads(x: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """``[b, W, H/n, d]`` (attention's output layout: every position, this rank's heads) ->
    ``[b, W/n, H, d]`` (this rank's positions, all heads)."""
    return x if sg.size == 1 else _AllToAll.apply(x, 1, 2, sg)


class _GatherPositions(torch.autograd.Function):
    """Every rank's ``[b, W/n, ...]`` concatenated along dimension 1; backward: this rank's slice of
    the gradient (module docstring: every rank computes the same loss from the result)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.sg, ctx.part = sg, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(sg.size)]
        dist.all_gather(parts, x.contiguous(), group=sg.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        start = ctx.sg.index * ctx.part
        return grad[:, start : start + ctx.part].contiguous(), None


def gather_positions(x: torch.Tensor, sg: SequenceGroup) -> torch.Tensor:
    """``[b, W/n, ...]`` per rank -> ``[b, W, ...]`` on every rank (see :class:`_GatherPositions`)."""
    if sg.size == 1:
        return x
    return _GatherPositions.apply(x, sg)


# ---------------------------------------------------------------------------------- the mask


@attrs.define
class WholeSequence:
    """What attention needs to know of the whole ``[b, W]`` micro-batch while each rank holds a slice.

    ``key_valid`` ``[b, W]``: the positions other positions may attend to (padding: ``False``);
    ``segments`` ``[b, W]``: which packed row each position belongs to (one segment per row in the
    padded layout); ``cu_seqlens``: the packed rows' boundaries for a varlen kernel (packed layout
    only, ``b == 1``), ``max_seqlen`` the longest of them. A mask is built once per forward (per
    implementation, window and dtype) and handed to every layer. For SDPA it is additive, in the
    dtype attention computes in: SDPA turns a boolean mask into a new float one at every call, and
    each layer's backward would keep its own copy."""

    key_valid: torch.Tensor
    segments: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    _masks: dict[tuple[str, int | None, torch.dtype], Any] = attrs.field(factory=dict, init=False, repr=False)

    def allowed(self, sliding_window: int | None) -> torch.Tensor:
        """``[b, 1, W, W]`` bool: query ``i`` may attend to key ``j`` when ``j <= i``, ``j`` is a valid
        key of the same segment and within the sliding window; and always to itself (so a padding
        position's row is never empty: its output is discarded, and no real query sees it)."""
        width = self.key_valid.shape[1]
        index = torch.arange(width, device=self.key_valid.device)
        causal = index[None, :] <= index[:, None]
        if sliding_window is not None:
            causal = causal & (index[:, None] - index[None, :] < sliding_window)
        same = self.segments[:, :, None] == self.segments[:, None, :]
        allowed = causal[None] & same & self.key_valid[:, None, :]
        return (allowed | torch.eye(width, dtype=torch.bool, device=allowed.device)[None])[:, None]

    def plainly_causal(self) -> bool:
        """Whether every position is a valid key of one segment (the mask is then just causal)."""
        return bool(self.key_valid.all()) and bool((self.segments == self.segments[:, :1]).all())

    def mask_for(self, inner: str, sliding_window: int | None, dtype: torch.dtype) -> Any:
        """The attention mask ``inner`` takes for this sequence (``None``: plainly causal, for the
        kernels that then run their causal path)."""
        key = (inner, sliding_window, dtype)
        if key not in self._masks:
            self._masks[key] = self._build(inner, sliding_window, dtype)
        return self._masks[key]

    def _build(self, inner: str, sliding_window: int | None, dtype: torch.dtype) -> Any:
        if inner in VARLEN:
            if self.cu_seqlens is not None or self.plainly_causal():
                return None
            return self.key_valid.long()
        if inner != "eager" and sliding_window is None and self.plainly_causal():
            return None  # sdpa's causal kernel: no [W, W] mask at all
        allowed = self.allowed(sliding_window)
        # additive (every row keeps its diagonal, so none is all -inf-like)
        return torch.zeros((), dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def ulysses_attention(inner: str) -> Any:
    """The attention function that runs ``inner`` (one of
    :data:`~core_rl.config.sequence_parallel.ATTENTION`) over the whole sequence (see the module
    docstring). Called without :data:`KWARG` it is ``inner`` itself, for one-token forwards only (a
    placeholder micro-batch): a longer one would silently see only its own slice."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attend(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        function = _eager_of(module) if inner == "eager" else ALL_ATTENTION_FUNCTIONS[inner]
        current = kwargs.pop(KWARG, None)
        if current is None:
            if query.shape[2] > 1:
                raise RuntimeError(f"attention {registered_name(inner)} ran outside a sequence-parallel forward")
            return function(_as_inner(module, inner), query, key, value, attention_mask, **kwargs)
        sg, whole = current
        if key.shape[1] % sg.size:
            raise ValueError(
                f"sequence_parallel_size {sg.size} must divide the model's key/value heads ({key.shape[1]})"
            )
        compute = _compute_dtype(query, inner)
        query, key, value = (heads_to_positions(t.to(compute), sg) for t in (query, key, value))
        kwargs.pop("position_ids", None)  # the slice's: the whole sequence's boundaries are in `whole`
        kwargs.pop("is_causal", None)
        # models that leave the window out of the call (transformers' mask carries it for them) keep it on the module
        window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
        mask = whole.mask_for(inner, window, torch.float32 if inner == "sdpa_float32" else compute)
        if inner in VARLEN and whole.cu_seqlens is not None:
            kwargs.update(
                cu_seq_lens_q=whole.cu_seqlens,
                cu_seq_lens_k=whole.cu_seqlens,
                max_length_q=whole.max_seqlen,
                max_length_k=whole.max_seqlen,
            )
        out, _ = function(_as_inner(module, inner), query, key, value, mask, **kwargs)
        return positions_to_heads(out, sg), None

    return attend


def _eager_of(module: torch.nn.Module) -> Any:
    """The model's own eager attention (transformers keeps it in the model's module, not in the
    registry)."""
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward


class _AsInner:
    """An attention module seen with ``config._attn_implementation`` set to the inner implementation:
    transformers' flash-attn wrapper picks its kernel by that name."""

    def __init__(self, module: torch.nn.Module, config: Any) -> None:
        self._module, self.config = module, config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _as_inner(module: torch.nn.Module, inner: str) -> Any:
    """``module`` itself, or for a flash-attn inner a view of it whose config names that inner (a
    deep copy of the module's config, made once and kept on the module)."""
    if inner not in VARLEN:
        return module
    config = module.__dict__.get("_core_rl_inner_config")
    if config is None:
        import copy

        config = copy.deepcopy(module.config)
        config._attn_implementation = inner
        module.__dict__["_core_rl_inner_config"] = config
    return _AsInner(module, config)


def _compute_dtype(query: torch.Tensor, inner: str) -> torch.dtype:
    """The dtype attention computes in: the autocast dtype inside an autocast region (query and key
    arrive in float32 there, promoted by the rotary embedding; sending them so would double the
    all-to-alls' bytes, and the kernels cast them anyway), except for ``sdpa_float32``, which
    computes in float32 by design; else the query's own."""
    device = query.device.type
    if inner != "sdpa_float32" and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def registered_name(inner: str) -> str:
    """The name :func:`register` gives the Ulysses attention around ``inner``."""
    return "ulysses_" + inner.replace("flash_attention_", "fa")


def register(inner: str) -> str:
    """Register :func:`registered_name` with transformers' attention functions (idempotent; no mask
    function: transformers then passes no mask, and the whole sequence's is built here); returns
    the name to load a model with."""
    if inner not in ATTENTION:
        raise ValueError(f"sequence parallelism runs with attention {', '.join(ATTENTION)}; the model's is {inner!r}")
    from transformers import AttentionInterface

    if inner == "sdpa_float32":
        from core_rl_train_kit import attention

        attention.register()
    name = registered_name(inner)
    AttentionInterface.register(name, ulysses_attention(inner))
    return name
