"""The ``auto`` micro-batch token budget as pure functions (core_rl.loops.token_budget), each
against values computed by hand, and the ``max_tokens_per_mb`` key that accepts ``auto``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from core_rl.config.loader import structure
from core_rl.config.schema import MicroBatchConfig, RunConfig
from core_rl.errors import ConfigError
from core_rl.loops import token_budget as tb

#: a Qwen2.5-0.5B-shaped model
QWEN = tb.ModelShape(layers=24, hidden=896, intermediate=4864, vocab=151936)
GIB = 2**30


def test_activation_bytes_per_token_of_a_language_model_in_bfloat16():
    # per layer (8 x 896 + 4 x 4864) x 2 = 53248; x 24 = 1277952; the logits and their gradient
    # 151936 x 2 x 2 = 607744
    assert tb.activation_bytes_per_token(QWEN, compute_bytes=2) == 1_277_952 + 607_744
    # fused_head: no logits, the 896 hidden values it keeps instead
    assert tb.activation_bytes_per_token(QWEN, compute_bytes=2, fused_head=True) == 1_277_952 + 896 * 2


def test_activation_bytes_per_token_of_a_value_head_in_float32():
    # per layer 26624 x 4 = 106496; x 24 = 2555904; the head keeps one float32 value
    assert tb.activation_bytes_per_token(QWEN, compute_bytes=4, lm_head=False) == 2_555_904 + 4


def test_checkpointed_layers_keep_their_inputs_and_one_layer_being_recomputed():
    head = 607_744
    # every layer checkpointed: 24 inputs of 896 x 2 bytes = 43008, plus one layer's 53248
    assert tb.activation_bytes_per_token(QWEN, compute_bytes=2, checkpointed=24) == 43_008 + 53_248 + head
    # inputs offloaded to host memory: only the recomputed layer stays
    assert tb.activation_bytes_per_token(QWEN, compute_bytes=2, checkpointed=24, offload=True) == 53_248 + head
    # 5 of 24 checkpointed: 19 full layers + 5 inputs + one recomputed layer
    expected = 19 * 53_248 + 5 * 1792 + 53_248 + head
    assert tb.activation_bytes_per_token(QWEN, compute_bytes=2, checkpointed=5) == expected


@pytest.mark.parametrize(("layers", "every", "count"), [(24, 1, 24), (24, 5, 5), (3, 4, 1), (4, 2, 2)])
def test_checkpointed_layers(layers, every, count):
    assert tb.checkpointed_layers(layers, every) == count


def test_gpu_budget_is_half_the_usable_memory_in_tokens_rounded_down_to_128():
    # 0.5 x 10 GiB / 4012800 B = 1337.9 tokens -> 1280
    assert tb.gpu_token_budget(10 * GIB, 4_012_800) == 1280
    # 0.5 x 30 GiB / 4012800 B = 4013.8 -> 3968
    assert tb.gpu_token_budget(30 * GIB, 4_012_800) == 3968


def test_gpu_budget_is_clamped():
    assert tb.gpu_token_budget(71 * GIB, 1_277_954) == tb.GPU_MAX_TOKENS_PER_MB == 16384  # 29830 tokens fit
    assert tb.gpu_token_budget(GIB, 4_012_800) == tb.GPU_MIN_TOKENS_PER_MB == 1024  # 133 tokens fit
    assert tb.gpu_token_budget(-5 * GIB, 4_012_800) == 1024  # the weights and optimizer state alone do not fit


@pytest.mark.parametrize(
    ("kwargs", "pending"),
    [
        ({"optimizer": "adamw"}, 3000),  # gradients + two moments
        ({"optimizer": "sgd", "momentum": 0.9}, 2000),
        ({"optimizer": "sgd"}, 1000),
        ({"optimizer": "adamw", "lora": True}, 0),
    ],
)
def test_pending_state_bytes(kwargs, pending):
    assert tb.pending_state_bytes(1000, **kwargs) == pending


def test_model_shape_from_hugging_face_configs():
    llama = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 344, "vocab_size": 100}
    assert tb.ModelShape.from_config(llama) == tb.ModelShape(2, 128, 344, 100)
    gpt2 = {"n_layer": 12, "n_embd": 768, "vocab_size": 50257}  # no intermediate size: 4 x hidden
    assert tb.ModelShape.from_config(gpt2) == tb.ModelShape(12, 768, 3072, 50257)
    assert tb.ModelShape.from_config({"text_config": llama, "vision_config": {}}) == tb.ModelShape(2, 128, 344, 100)
    assert tb.ModelShape.from_config({"vocab_size": 10}) is None


def test_estimated_parameters():
    # 2 x (4 x 128^2 + 3 x 128 x 344) + 100 x 128 = 2 x (65536 + 132096) + 12800
    assert tb.ModelShape(2, 128, 344, 100).estimated_parameters == 408_064


def _safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_safetensors_parameters_reads_headers(tmp_path):
    _safetensors(tmp_path / "model-00001.safetensors", {"a": [3, 4], "b": [5]})
    _safetensors(tmp_path / "model-00002.safetensors", {"c": [2, 2, 2]})
    assert tb.safetensors_parameters(tmp_path) == 12 + 5 + 8
    (tmp_path / "model-00003.safetensors").write_bytes(b"\x01")
    assert tb.safetensors_parameters(tmp_path) is None
    assert tb.safetensors_parameters(tmp_path / "missing") is None


def test_format_parameters():
    assert [tb.format_parameters(n) for n in (360_000_000, 7_615_000_000, 3_100_000, 14_800_000_000, 99_000_000)] == [
        "0.36B",
        "7.62B",
        "3.1M",
        "14.8B",
        "99.0M",
    ]


def test_cpu_budget_fills_256_mib_of_activations_within_768_and_2048():
    mib = 2**20
    assert tb.cpu_token_budget(256 * mib // 2048) == 2048  # exactly 2048 tokens' worth
    assert tb.cpu_token_budget(256 * mib // 2048 + 1) == 1920  # 2047.98 -> a multiple of 128
    assert tb.cpu_token_budget(256 * mib // 1024) == 1024
    assert tb.cpu_token_budget(1) == 2048 and tb.cpu_token_budget(0) == 2048  # a tiny model: the largest
    assert tb.cpu_token_budget(256 * mib // 768 + 1) == 768  # 767.99 tokens: the least
    assert tb.cpu_token_budget(2**30) == 768
    # SmolLM2-135M in bfloat16: 30 x (8 x 576 + 4 x 1536) x 2 + 2 x 49152 x 2 = 841,728 bytes -> 318 -> 768
    smol = tb.ModelShape(layers=30, hidden=576, intermediate=1536, vocab=49152)
    assert tb.activation_bytes_per_token(smol, compute_bytes=2) == 841_728
    assert tb.cpu_token_budget(841_728) == 768
    # the medium CPU benchmark model: 4 x (8 x 256 + 4 x 704) x 2 + 2 x 13 x 2 = 38,964 bytes -> 6889 -> 2048
    medium = tb.ModelShape(layers=4, hidden=256, intermediate=704, vocab=13)
    assert tb.cpu_token_budget(tb.activation_bytes_per_token(medium, compute_bytes=2)) == 2048


def test_an_unresolved_auto_is_the_cpu_figure_for_an_engine_used_alone():
    assert tb.tokens_per_mb(MicroBatchConfig()) == tb.CPU_TOKENS_PER_MB == 768
    assert tb.tokens_per_mb(MicroBatchConfig(max_tokens_per_mb=20)) == 20


@pytest.mark.parametrize("role", ["actor", "ref", "critic", "teacher", "reward_model"])
def test_every_role_section_defaults_to_auto_and_takes_numbers(role):
    section = {"model_path": "m"}
    cfg = structure({role: section}, RunConfig)
    assert getattr(cfg, role).micro_batch.max_tokens_per_mb == "auto"
    cfg = structure({role: {**section, "micro_batch": {"max_tokens_per_mb": 16640}}}, RunConfig)
    assert getattr(cfg, role).micro_batch.max_tokens_per_mb == 16640


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("fast", "actor.micro_batch.max_tokens_per_mb: expected an integer or 'auto', got 'fast'"),
        (True, "actor.micro_batch.max_tokens_per_mb: expected an integer or 'auto', got True"),
        (1.5, "actor.micro_batch.max_tokens_per_mb: expected an integer or 'auto', got 1.5"),
        (0, "actor.micro_batch.max_tokens_per_mb: must be in [1, 16777216], got 0"),
    ],
)
def test_a_wrong_budget_names_the_key(value, problem):
    with pytest.raises(ConfigError) as info:
        structure({"actor": {"micro_batch": {"max_tokens_per_mb": value}}}, RunConfig)
    assert info.value.problems == [problem]
    assert info.value.exit_code == 2
