"""Hugging Face configs -> the architecture record: the three families, and a clear error naming
the family (or the setting) for everything the engine cannot build exactly."""

from __future__ import annotations

import pytest
from core_rl_megatron.errors import MegatronSetupError
from core_rl_megatron.families import arch_spec, padded_vocab_size
from mcore_common import LLAMA3_ROPE
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

SMALL = {"vocab_size": 50, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}


def test_llama_qwen2_qwen3() -> None:
    llama = arch_spec(LlamaConfig(**SMALL, num_key_value_heads=2, rms_norm_eps=1e-5))
    assert (llama.family, llama.num_kv_heads, llama.head_dim, llama.heads_per_group) == ("llama", 2, 16, 2)
    assert (llama.qkv_bias, llama.qk_norm, llama.norm_eps, llama.rope.theta) == (False, False, 1e-5, 10000.0)
    qwen2 = arch_spec(Qwen2Config(**SMALL, tie_word_embeddings=True))
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.tie_word_embeddings) == (True, False, True)
    qwen3 = arch_spec(Qwen3Config(**SMALL, head_dim=24))
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 24)


def test_llama3_rope_scaling() -> None:
    spec = arch_spec(LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE))
    assert (spec.rope.theta, spec.rope.llama3_factor) == (500000.0, 8.0)
    with pytest.raises(MegatronSetupError, match="low_freq_factor"):
        arch_spec(LlamaConfig(**SMALL, rope_parameters={**LLAMA3_ROPE, "low_freq_factor": 2.0}))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (GPT2Config(), "model family 'gpt2'"),
        (MistralConfig(**SMALL), "model family 'mistral'"),
        (LlamaConfig(**SMALL, hidden_act="gelu"), "hidden_act='gelu'"),
        (LlamaConfig(**SMALL, attention_bias=True), "attention_bias=true"),
        (LlamaConfig(**SMALL, mlp_bias=True), "mlp_bias=true"),
        (Qwen2Config(**SMALL, use_sliding_window=True, max_window_layers=0), "sliding-window"),
        (LlamaConfig(**SMALL, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "'yarn'"),
    ],
)
def test_unsupported_models_name_what_is_unsupported(config: object, message: str) -> None:
    with pytest.raises(MegatronSetupError, match=message) as info:
        arch_spec(config, "actor.model_path")
    assert str(info.value).startswith("actor.model_path:")


def test_padded_vocabulary() -> None:
    assert padded_vocab_size(47, 8, 1) == 48
    assert padded_vocab_size(47, 8, 2) == 48
    assert padded_vocab_size(49, 8, 2) == 64
    assert padded_vocab_size(151936, 128, 4) == 151552 + 512  # a multiple of 512 at or above
