"""Hugging Face <-> Megatron conversion and tensor-parallel sharding, as pure tensor functions:
bit-exact round trips for every family and tensor-parallel size, and shards laid out the way
Megatron's layers read them (checked against an independent per-head construction)."""

from __future__ import annotations

import attrs
import torch
from core_rl_megatron import convert
from core_rl_megatron.families import ArchSpec, RopeSpec, padded_vocab_size
from hypothesis import given, settings
from hypothesis import strategies as st


def make_spec(family: str, groups: int, heads_per_group: int, head_dim: int, tied: bool) -> ArchSpec:
    return ArchSpec(
        family=family,
        num_layers=2,
        hidden_size=24,
        ffn_hidden_size=20,
        num_heads=groups * heads_per_group,
        num_kv_heads=groups,
        head_dim=head_dim,
        vocab_size=37,
        max_position_embeddings=64,
        norm_eps=1e-6,
        rope=RopeSpec(theta=10000.0),
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        tie_word_embeddings=tied,
    )


def random_hf_state(spec: ArchSpec, seed: int) -> dict[str, torch.Tensor]:
    """A state dict with every tensor a Hugging Face model of ``spec`` has (random values)."""
    g = torch.Generator().manual_seed(seed)
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
        if spec.qkv_bias:
            shapes.update({p + f"self_attn.{x}_proj.bias": (q if x == "q" else kv,) for x in "qkv"})
        if spec.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


@settings(max_examples=30, deadline=None)
@given(
    family=st.sampled_from(["llama", "qwen2", "qwen3"]),
    tp=st.sampled_from([1, 2, 4]),
    groups_per_rank=st.integers(1, 2),
    heads_per_group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 4, 6]),
    tied=st.booleans(),
    impl=st.sampled_from(["local", "transformer_engine"]),
)
def test_round_trip_is_bit_exact(family, tp, groups_per_rank, heads_per_group, head_dim, tied, impl) -> None:
    spec = make_spec(family, tp * groups_per_rank, heads_per_group, head_dim, tied)
    spec = attrs.evolve(spec, ffn_hidden_size=5 * tp)  # fc1/fc2 split evenly over tp
    hf = random_hf_state(spec, seed=tp)
    padded = padded_vocab_size(spec.vocab_size, 4, tp)
    shards = convert.hf_to_megatron_shards(hf, spec, padded, tp, impl)
    back = convert.megatron_shards_to_hf(shards, spec, impl)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    for rank_state in shards:  # every rank holds the same parameter names, each an equal part
        assert rank_state.keys() == shards[0].keys()
        for name, tensor in rank_state.items():
            assert tensor.shape == shards[0][name].shape, name


def test_qkv_shards_hold_whole_query_groups_in_megatron_order() -> None:
    """Rank r's fused qkv rows, rebuilt head by head: for each of its query groups, the group's
    query heads, then its key head, then its value head."""
    spec = make_spec("qwen2", groups=4, heads_per_group=2, head_dim=3, tied=False)
    hf = random_hf_state(spec, seed=1)
    d, hpg, tp = spec.head_dim, spec.heads_per_group, 2
    shards = convert.hf_to_megatron_shards(hf, spec, 40, tp)
    for rank in range(tp):
        for suffix in ("weight", "bias"):
            rows = []
            for group in range(rank * 2, rank * 2 + 2):
                q = hf[f"model.layers.0.self_attn.q_proj.{suffix}"]
                rows += [q[(group * hpg + h) * d : (group * hpg + h + 1) * d] for h in range(hpg)]
                rows.append(hf[f"model.layers.0.self_attn.k_proj.{suffix}"][group * d : (group + 1) * d])
                rows.append(hf[f"model.layers.0.self_attn.v_proj.{suffix}"][group * d : (group + 1) * d])
            got = shards[rank][f"decoder.layers.0.self_attention.linear_qkv.{suffix}"]
            assert torch.equal(got, torch.cat(rows)), (rank, suffix)


def test_other_shards() -> None:
    spec = make_spec("llama", groups=2, heads_per_group=1, head_dim=4, tied=False)
    hf = random_hf_state(spec, seed=2)
    shards = convert.hf_to_megatron_shards(hf, spec, 40, 2)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    for r in range(2):
        s = shards[r]
        assert torch.equal(
            s["decoder.layers.1.mlp.linear_fc1.weight"],
            torch.cat([gate[r * 10 : r * 10 + 10], up[r * 10 : r * 10 + 10]]),
        )
        assert torch.equal(
            s["decoder.layers.1.mlp.linear_fc2.weight"],
            hf["model.layers.1.mlp.down_proj.weight"][:, r * 10 : r * 10 + 10],
        )
        assert torch.equal(
            s["decoder.layers.1.self_attention.linear_proj.weight"],
            hf["model.layers.1.self_attn.o_proj.weight"][:, r * 4 : r * 4 + 4],
        )
        assert torch.equal(s["decoder.final_layernorm.weight"], hf["model.norm.weight"])
    # the vocabulary is padded with zero rows (37 -> 40) and split by rows: rank 1 holds rows 20..39
    emb = shards[1]["embedding.word_embeddings.weight"]
    assert torch.equal(emb[:17], hf["model.embed_tokens.weight"][20:]) and not emb[17:].any()


def test_tied_output_layer_reads_the_embedding_and_is_not_exported() -> None:
    spec = make_spec("qwen2", groups=2, heads_per_group=2, head_dim=2, tied=True)
    maps = {pm.megatron: pm for pm in convert.param_maps(spec)}
    out = maps["output_layer.weight"]
    assert out.hf == ("model.embed_tokens.weight",) and not out.exported
