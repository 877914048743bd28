"""Hugging Face <-> Megatron-core weights, and tensor-parallel sharding (pure tensor functions).

A :class:`ParamMap` ties one Megatron parameter (named with its *global* layer index) to the
Hugging Face tensors it is made of, and says how tensor parallelism splits it:

- ``embedding.word_embeddings.weight`` / ``output_layer.weight``: the vocabulary rows, padded with
  zero rows to the padded vocabulary, split by rows (``ROWS``);
- ``linear_qkv``: the q, k and v projections interleaved per query group, each group being
  ``[q rows of its heads_per_group heads; k rows; v rows]``, so a row split gives every rank whole
  groups (``ROWS``); Qwen2's q/k/v biases the same way;
- ``linear_fc1``: ``[gate; up]``; rank ``r`` holds ``[gate_r; up_r]`` (``GLU``);
- ``linear_proj`` and ``linear_fc2``: split by columns (``COLS``);
- norms (and Qwen3's per-head q/k norms): the same on every rank (``REPLICATED``);
- a value or score head (:mod:`core_rl_megatron.heads`) in place of the output layer:
  ``output_layer.weight`` / ``.bias`` are Hugging Face's ``score.weight`` / ``score.bias`` (the head
  of ``*ForTokenClassification`` and ``*ForSequenceClassification``), replicated.

Every function only moves, concatenates and reshapes elements, so HF -> Megatron -> HF is
bit-exact for any tensor-parallel size.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs
import torch

from core_rl_megatron.families import ArchSpec


class Split(enum.Enum):
    """How a full Megatron parameter is divided over tensor-parallel ranks."""

    REPLICATED = "replicated"
    ROWS = "rows"  # dim 0 in equal chunks
    COLS = "cols"  # dim 1 in equal chunks
    GLU = "glu"  # [gate; up]: each half split by rows, rank r gets [gate_r; up_r]


class Kind(enum.Enum):
    """How Hugging Face tensors combine into the Megatron parameter."""

    COPY = "copy"
    VOCAB = "vocab"  # one tensor, rows padded to the padded vocabulary
    QKV = "qkv"  # q, k, v interleaved per query group
    GLU = "glu"  # gate, up concatenated


@attrs.frozen
class ParamMap:
    """One Megatron parameter (``megatron``, global layer numbering) and its Hugging Face sources."""

    megatron: str
    hf: tuple[str, ...]
    kind: Kind
    split: Split
    #: exported to Hugging Face (False for an output layer tied to the embedding)
    exported: bool = True
    #: may be absent from a Hugging Face directory, and then starts at zero (a value head on a
    #: causal LM's directory, as :func:`core_rl.roles.hf.load_value_model` does)
    optional: bool = False


def _norm_names(impl: str) -> tuple[str, str]:
    """Megatron names of a layer's two norms: Transformer Engine fuses them into the next linear."""
    if impl == "transformer_engine":
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def layer_maps(spec: ArchSpec, layer: int, impl: str = "local") -> list[ParamMap]:
    """The :class:`ParamMap` s of decoder layer ``layer`` (0-based, global)."""
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    attn, mlp = f"{h}self_attn.", f"{h}mlp."
    input_norm, mlp_norm = _norm_names(impl)
    maps = [
        ParamMap(m + input_norm, (f"{h}input_layernorm.weight",), Kind.COPY, Split.REPLICATED),
        ParamMap(
            m + "self_attention.linear_qkv.weight",
            (f"{attn}q_proj.weight", f"{attn}k_proj.weight", f"{attn}v_proj.weight"),
            Kind.QKV,
            Split.ROWS,
        ),
    ]
    if spec.qkv_bias:
        maps.append(
            ParamMap(
                m + "self_attention.linear_qkv.bias",
                (f"{attn}q_proj.bias", f"{attn}k_proj.bias", f"{attn}v_proj.bias"),
                Kind.QKV,
                Split.ROWS,
            )
        )
    if spec.qk_norm:
        maps += [
            ParamMap(m + "self_attention.q_layernorm.weight", (f"{attn}q_norm.weight",), Kind.COPY, Split.REPLICATED),
            ParamMap(m + "self_attention.k_layernorm.weight", (f"{attn}k_norm.weight",), Kind.COPY, Split.REPLICATED),
        ]
    maps += [
        ParamMap(m + "self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), Kind.COPY, Split.COLS),
        ParamMap(m + mlp_norm, (f"{h}post_attention_layernorm.weight",), Kind.COPY, Split.REPLICATED),
        ParamMap(m + "mlp.linear_fc1.weight", (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"), Kind.GLU, Split.GLU),
        ParamMap(m + "mlp.linear_fc2.weight", (f"{mlp}down_proj.weight",), Kind.COPY, Split.COLS),
    ]
    return maps


def param_maps(spec: ArchSpec, impl: str = "local") -> list[ParamMap]:
    """Every parameter of the model, in a fixed order every rank agrees on: embedding, layers,
    final norm, output layer (present, but not exported, when tied to the embedding; a scalar head
    ``score`` for ``spec.head`` ``value`` or ``score``, never tied)."""
    maps = [ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Kind.VOCAB, Split.ROWS)]
    for layer in range(spec.num_layers):
        maps += layer_maps(spec, layer, impl)
    maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), Kind.COPY, Split.REPLICATED))
    if spec.head != "lm":
        head = [ParamMap("output_layer.weight", ("score.weight",), Kind.COPY, Split.REPLICATED, optional=True)]
        if spec.head == "value":
            head.append(ParamMap("output_layer.bias", ("score.bias",), Kind.COPY, Split.REPLICATED, optional=True))
        maps += head
    elif spec.ties_output_layer:
        maps.append(
            ParamMap("output_layer.weight", ("model.embed_tokens.weight",), Kind.VOCAB, Split.ROWS, exported=False)
        )
    else:
        maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), Kind.VOCAB, Split.ROWS))
    return maps


# ------------------------------------------------------------------------------------ HF <-> full


def to_megatron(pm: ParamMap, hf: Sequence[torch.Tensor], spec: ArchSpec, padded_vocab: int) -> torch.Tensor:
    """The full (unsharded) Megatron parameter of ``pm`` from its Hugging Face tensors ``hf``
    (in the order of ``pm.hf``)."""
    if pm.kind is Kind.COPY:
        return hf[0]
    if pm.kind is Kind.VOCAB:
        (table,) = hf
        if table.shape[0] > padded_vocab:
            raise ValueError(f"{pm.hf[0]} has {table.shape[0]} rows, more than the padded vocabulary {padded_vocab}")
        pad = table.new_zeros((padded_vocab - table.shape[0], *table.shape[1:]))
        return torch.cat([table, pad])
    if pm.kind is Kind.QKV:
        q, k, v = hf
        g, d = spec.num_kv_heads, spec.head_dim
        tail = q.shape[1:]
        parts = [q.reshape(g, spec.heads_per_group * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)]
        return torch.cat(parts, dim=1).reshape(-1, *tail)
    if pm.kind is Kind.GLU:
        return torch.cat(list(hf))
    raise AssertionError(pm.kind)


def to_hf(pm: ParamMap, full: torch.Tensor, spec: ArchSpec) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of ``pm`` from its full Megatron parameter (inverse of
    :func:`to_megatron`)."""
    if pm.kind is Kind.COPY:
        return {pm.hf[0]: full}
    if pm.kind is Kind.VOCAB:
        return {pm.hf[0]: full[: spec.vocab_size]}
    if pm.kind is Kind.QKV:
        g, d, hpg = spec.num_kv_heads, spec.head_dim, spec.heads_per_group
        tail = full.shape[1:]
        q, k, v = full.reshape(g, (hpg + 2) * d, *tail).split([hpg * d, d, d], dim=1)
        return {name: t.reshape(-1, *tail) for name, t in zip(pm.hf, (q, k, v))}
    if pm.kind is Kind.GLU:
        gate, up = full.chunk(2)
        return {pm.hf[0]: gate, pm.hf[1]: up}
    raise AssertionError(pm.kind)


# ------------------------------------------------------------------------------------ TP shards


def shard(full: torch.Tensor, split: Split, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of ``full`` (a view where possible)."""
    if split is Split.REPLICATED or tp_size == 1:
        return full
    if split is Split.ROWS:
        return _chunks(full, tp_size, 0)[tp_rank]
    if split is Split.COLS:
        return _chunks(full, tp_size, 1)[tp_rank]
    if split is Split.GLU:
        gate, up = full.chunk(2)
        return torch.cat([_chunks(gate, tp_size, 0)[tp_rank], _chunks(up, tp_size, 0)[tp_rank]])
    raise AssertionError(split)


def unshard(shards: Sequence[torch.Tensor], split: Split) -> torch.Tensor:
    """The full parameter from every rank's part, in rank order (inverse of :func:`shard`)."""
    if split is Split.REPLICATED or len(shards) == 1:
        return shards[0]
    if split is Split.ROWS:
        return torch.cat(list(shards))
    if split is Split.COLS:
        return torch.cat(list(shards), dim=1)
    if split is Split.GLU:
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    raise AssertionError(split)


def _chunks(t: torch.Tensor, n: int, dim: int) -> tuple[torch.Tensor, ...]:
    if t.shape[dim] % n:
        raise ValueError(f"cannot split dimension {dim} of size {t.shape[dim]} into {n} equal parts")
    return t.chunk(n, dim=dim)


# ------------------------------------------------------------------------------------ whole models


def hf_to_megatron_shards(
    hf_state: Mapping[str, torch.Tensor],
    spec: ArchSpec,
    padded_vocab: int,
    tp_size: int,
    impl: str = "local",
) -> list[dict[str, torch.Tensor]]:
    """Every tensor-parallel rank's Megatron state (global names) from a full HF state dict."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for pm in param_maps(spec, impl):
        full = to_megatron(pm, [hf_state[n] for n in pm.hf], spec, padded_vocab)
        for r in range(tp_size):
            out[r][pm.megatron] = shard(full, pm.split, r, tp_size)
    return out


def megatron_shards_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], spec: ArchSpec, impl: str = "local"
) -> dict[str, torch.Tensor]:
    """The HF state dict (exported tensors only) from every tensor-parallel rank's Megatron state."""
    out: dict[str, torch.Tensor] = {}
    for pm in param_maps(spec, impl):
        if pm.exported:
            out.update(to_hf(pm, unshard([s[pm.megatron] for s in shards], pm.split), spec))
    return out
