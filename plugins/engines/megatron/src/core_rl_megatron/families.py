"""The Hugging Face decoder families the engine can build, described in one architecture record.

Llama, Qwen2 and Qwen3 are the same pre-norm decoder (RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, no linear biases) up to three switches: Qwen2 adds biases to the q/k/v
projections, Qwen3 normalises each head's queries and keys (RMSNorm over the head dimension), and
any of them may tie the output layer to the input embedding.
"""

from __future__ import annotations

from typing import Any

import attrs

from core_rl_megatron.errors import MegatronSetupError

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")


@attrs.frozen
class RopeSpec:
    """Rotary embedding: ``theta`` (base), and Llama-3 frequency scaling when ``llama3_factor`` is set."""

    theta: float
    llama3_factor: float | None = None


@attrs.frozen
class ArchSpec:
    """What both the Megatron model and the weight converter need to know about a model."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope: RopeSpec
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    #: what the last stage outputs (:data:`core_rl.interfaces.HEADS`): ``lm`` (the vocabulary
    #: projection), ``value`` or ``score`` (a scalar per token, :mod:`core_rl_megatron.heads`)
    head: str = "lm"

    @property
    def ties_output_layer(self) -> bool:
        """The output layer is the input embedding (a tied language-model head; a scalar head never is)."""
        return self.tie_word_embeddings and self.head == "lm"

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by * tp_size`` (Megatron's rule), so
    every tensor-parallel rank holds the same number of vocabulary rows."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


# Megatron-core's Llama-3 scaling has these constants built in; other values cannot be expressed.
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope(config: Any, where: str) -> RopeSpec:
    """Rotary settings from either transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` / ``rope_scaling`` attributes."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return RopeSpec(theta=float(theta))
    if kind == "llama3":
        values = {**scaling, **params}
        for key, expected in _MEGATRON_LLAMA3.items():
            if float(values.get(key, expected)) != expected:
                raise MegatronSetupError(
                    f"{where}: llama3 rope scaling with {key}={values.get(key)} is not supported by "
                    f"megatron-core (it implements {key}={expected} only)"
                )
        return RopeSpec(theta=float(theta), llama3_factor=float(values.get("factor", 8.0)))
    raise MegatronSetupError(
        f"{where}: rope scaling type {kind!r} is not supported by the megatron engine (supported: default, llama3)"
    )


def arch_spec(config: Any, where: str = "actor.model_path", head: str = "lm") -> ArchSpec:
    """The :class:`ArchSpec` of a transformers ``PretrainedConfig`` with ``head`` on its last stage;
    a :class:`MegatronSetupError` naming the family (``model_type``) and ``where`` for anything the
    engine cannot build exactly."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise MegatronSetupError(
            f"{where}: model family {family!r} (config.json model_type) is not supported by the megatron "
            f"train engine; supported: {', '.join(SUPPORTED_FAMILIES)}. Use the fsdp engine for other models."
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise MegatronSetupError(f"{where}: {family} with hidden_act={act!r} is not supported (only silu/SwiGLU)")
    if getattr(config, "mlp_bias", False):
        raise MegatronSetupError(f"{where}: {family} with mlp_bias=true is not supported")
    attention_bias = bool(getattr(config, "attention_bias", False))
    if attention_bias:
        # Llama/Qwen3 attention_bias also puts a bias on o_proj, which Megatron only offers
        # together with biases on every linear layer
        raise MegatronSetupError(f"{where}: {family} with attention_bias=true is not supported")
    if getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in (getattr(config, "layer_types", None) or [])
    ):
        raise MegatronSetupError(f"{where}: {family} with sliding-window attention layers is not supported")
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise MegatronSetupError(f"{where}: {family} with partial_rotary_factor != 1 is not supported")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ArchSpec(
        family=family,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        ffn_hidden_size=int(config.intermediate_size),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        vocab_size=int(config.vocab_size),
        max_position_embeddings=int(config.max_position_embeddings),
        norm_eps=float(config.rms_norm_eps),
        rope=_rope(config, where),
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        head=head,
    )
