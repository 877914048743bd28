"""The lean decoding path (``core_rl_hf.decode.LeanStepper``) against the model's own forward:
the same next-token logits step by step (left padding, grouped-query attention, q/k/v biases,
dropped rows), in float32 and in mixed precision (``compute_dtype``), the same generations, and the
fall-back for architectures it does not cover."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_rl.interfaces import SamplingParams
from core_rl_hf.config import HFRolloutConfig
from core_rl_hf.decode import (
    LeanStepper,
    TransformersStepper,
    _attention_products,
    _one_query_attention,
    lean_supported,
    make_stepper,
    mixed_precision,
)
from core_rl_hf.engine import HFRolloutEngine
from core_rl_hf.generation import left_pad
from core_rl_train_kit import attention
from hypothesis import given, settings
from hypothesis import strategies as st

VOCAB = 40


def _model(architecture: str, **overrides: object) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        architecture
    ]
    options = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    options.update(overrides)
    torch.manual_seed(0)
    return model_cls(config_cls(**options)).eval()


MODELS = {
    "llama": lambda: _model("llama"),
    "llama-gqa-bias": lambda: _model("llama", num_key_value_heads=2, attention_bias=True),
    "qwen2": lambda: _model("qwen2"),
    "qwen2-gqa": lambda: _model("qwen2", num_key_value_heads=1),
}


def _prefilled(
    model: torch.nn.Module,
    kind: type,
    prompts: list[list[int]],
    capacity: int,
    compute_dtype: torch.dtype | None = None,
):
    cache, mask, last_position, logits = _prefill(model, prompts, compute_dtype)
    return kind(model, cache, mask, last_position, capacity, compute_dtype), logits


def _prefill(model: torch.nn.Module, prompts: list[list[int]], compute_dtype: torch.dtype | None) -> tuple:
    """The model's forward over the left-padded ``prompts``: its cache, the attention mask, each
    row's last position and the last logits."""
    input_ids, mask, positions = left_pad(prompts, 0, torch.device("cpu"))
    with mixed_precision(model, compute_dtype):
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
    return out.past_key_values, mask, positions[:, -1:], out.logits[:, -1]


@pytest.mark.parametrize("name", sorted(MODELS))
@torch.inference_mode()
def test_lean_steps_give_the_forwards_logits(name: str) -> None:
    model = MODELS[name]()
    assert lean_supported(model)
    prompts = [[1, 5, 6, 7, 8], [1, 9], [1, 10, 11], [3]]
    lean, first = _prefilled(model, LeanStepper, prompts, capacity=16)
    plain, _ = _prefilled(model, TransformersStepper, prompts, capacity=16)
    generator = torch.Generator().manual_seed(1)
    rows = len(prompts)
    for step in range(9):
        if step == 4:  # drop rows 1 and 3, as generation does with finished rows
            keep = torch.tensor([0, 2])
            lean.keep(keep)
            plain.keep(keep)
            rows = 2
        tokens = torch.randint(0, VOCAB, (rows,), generator=generator)
        expected = plain.step(tokens)
        got = lean.step(tokens)
        assert got.shape == (rows, VOCAB)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert first.shape == (len(prompts), VOCAB)


@pytest.mark.parametrize("attn", ["sdpa_float32", "sdpa"])
@pytest.mark.parametrize("name", sorted(MODELS))
@torch.inference_mode()
def test_mixed_precision_steps_give_the_autocast_forwards_logits(name: str, attn: str) -> None:
    """With ``compute_dtype=bfloat16`` the lean steps (bf16 projections on fused weight copies)
    give the logits of the model's forward under bf16 autocast, the training forward's arithmetic,
    with either attention the engines load: ``sdpa_float32`` (a CPU's: float32 attention over
    float32 keys/values) or ``sdpa`` (a GPU's: autocast runs SDPA in bf16, as it does on a CPU);
    they differ from the float32 logits by far more than from that forward."""
    model = MODELS[name]()
    model.set_attn_implementation(attention.register() if attn == attention.NAME else attn)
    assert model.config._attn_implementation == attn
    prompts = [[1, 5, 6, 7, 8], [1, 9], [1, 10, 11], [3]]
    bf16 = torch.bfloat16
    lean, _ = _prefilled(model, LeanStepper, prompts, capacity=16, compute_dtype=bf16)
    plain, _ = _prefilled(model, TransformersStepper, prompts, capacity=16, compute_dtype=bf16)
    full_precision, _ = _prefilled(model, LeanStepper, prompts, capacity=16)
    # values are v_proj's bf16 outputs, kept in bf16 (exact); rotated keys in the attention's dtype
    assert lean.values[0].dtype == bf16
    assert lean.keys[0].dtype == (torch.float32 if attn == attention.NAME else bf16)
    generator = torch.Generator().manual_seed(1)
    rows, same, differs, total = len(prompts), 0, 0, 0
    for step in range(9):
        if step == 4:
            keep = torch.tensor([0, 2])
            for stepper in (lean, plain, full_precision):
                stepper.keep(keep)
            rows = 2
        tokens = torch.randint(0, VOCAB, (rows,), generator=generator)
        expected = plain.step(tokens)
        got = lean.step(tokens)
        assert got.dtype == torch.float32 and got.shape == (rows, VOCAB)
        # bf16 logits: summation order may flip the last bit of a few (one bf16 step, 2^-7 relative)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=2**-7)
        same += int((got == expected).sum())
        differs += int((got != full_precision.step(tokens)).sum())
        total += got.numel()
    assert same >= 0.9 * total
    assert differs >= 0.9 * total  # the projections really ran in bfloat16


@pytest.mark.parametrize(
    ("attn", "compute_dtype"), [("sdpa", None), ("sdpa_float32", torch.bfloat16), ("sdpa", torch.bfloat16)]
)
@pytest.mark.parametrize("padding", ["left", "none"])
@pytest.mark.parametrize("name", sorted(MODELS))
@torch.inference_mode()
def test_lean_prefill_gives_the_forwards_logits_keys_and_values(name: str, attn: str, compute_dtype, padding) -> None:
    """``LeanStepper.prefill`` over left-padded prompts gives the logits, keys and values of the
    model's forward (under autocast with ``compute_dtype``), each prompt's repeated for the rows
    that continue it, and the stepper it returns steps as one built from the forward's cache does."""
    model = MODELS[name]()
    model.set_attn_implementation(attention.register() if attn == attention.NAME else attn)
    prompts = [[1, 5, 6, 7, 8], [1, 9], [3], [1, 10, 11]]
    rows = torch.tensor([0, 0, 1, 2, 2, 2, 3])
    if padding == "none":  # every prompt of one length: causal attention without a mask
        prompts, rows = [[1, 5, 6, 7, 8], [2, 9, 3, 4, 12]], torch.tensor([0, 1, 1])
    cache, mask, last_position, expected = _prefill(model, prompts, compute_dtype)
    input_ids, _, positions = left_pad(prompts, 0, torch.device("cpu"))
    lean, first = LeanStepper.prefill(model, input_ids, mask, positions, rows, 16, compute_dtype)
    exact = compute_dtype is None
    tolerance = dict(atol=1e-5, rtol=0) if exact else dict(atol=1e-6, rtol=2**-7)
    assert first.dtype == torch.float32 and first.shape == (len(prompts), VOCAB)
    torch.testing.assert_close(first, expected.float(), **tolerance)
    width = mask.shape[1]
    real = mask[rows].bool()[:, None, :, None]  # a padding position's keys and values are never read
    for i in range(len(model.model.layers)):
        for got, want in zip((lean.keys[i], lean.values[i]), (cache.layers[i].keys, cache.layers[i].values)):
            assert torch.isfinite(got[:, :, :width]).all()  # past the prompt: unwritten, never read
            torch.testing.assert_close(
                torch.where(real, got[:, :, :width], 0), torch.where(real, want[rows].to(got.dtype), 0), **tolerance
            )
    cache.reorder_cache(rows)
    plain = LeanStepper(model, cache, mask[rows], last_position[rows], 16, compute_dtype)
    tokens = torch.randint(0, VOCAB, (5, len(rows)), generator=torch.Generator().manual_seed(4))
    for row in tokens:
        torch.testing.assert_close(lean.step(row), plain.step(row), **tolerance)


@torch.inference_mode()
def test_static_steps_give_the_same_logits_and_reload() -> None:
    """A static stepper (fixed shapes: attention over every buffer position, the unwritten ones
    masked) gives the logits of the stepper attending over the written positions only; reloaded
    with the same prefill (as a captured graph's buffers are for the next call) it repeats them."""
    model = MODELS["qwen2-gqa"]()
    prompts = [[1, 5, 6, 7, 8], [1, 9], [3]]
    plain, _ = _prefilled(model, LeanStepper, prompts, capacity=16)
    input_ids, mask, positions = left_pad(prompts, 0, torch.device("cpu"))
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
    static = LeanStepper(model, out.past_key_values, mask, positions[:, -1:], 32, static=True)
    tokens = torch.randint(0, VOCAB, (8, len(prompts)), generator=torch.Generator().manual_seed(2))
    first = []
    for row in tokens:
        first.append(static.step(row))
        torch.testing.assert_close(first[-1], plain.step(row), atol=1e-5, rtol=0)
    static.load(out.past_key_values, mask, positions[:, -1:])
    again = [static.step(row) for row in tokens]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    with pytest.raises(RuntimeError, match="static"):
        static.keep(torch.tensor([0]))


@torch.inference_mode()
def test_lean_step_equals_a_full_forward_over_the_sequence() -> None:
    """The cached steps give the logits of one uncached forward over prompt + fed tokens."""
    model = MODELS["qwen2-gqa"]()
    prompt, fed = [1, 5, 6, 7], [9, 3, 12, 30]
    lean, _ = _prefilled(model, LeanStepper, [prompt], capacity=12)
    for token in fed:
        last = lean.step(torch.tensor([token]))
    full = model(input_ids=torch.tensor([prompt + fed]), use_cache=False).logits[0, -1]
    torch.testing.assert_close(last[0], full, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_refreshed_weights_are_the_models_current_ones_cast() -> None:
    """A weight update between two batches of a reused (graphed) stepper: ``refresh_weights``
    copies the model's new weights into the stepper's bf16 fused copies in place (a captured graph
    keeps reading those tensors), as a stepper built afresh would hold them."""
    model = MODELS["llama-gqa-bias"]()
    prompts = [[1, 5, 6, 7, 8], [1, 9]]
    bf16 = torch.bfloat16
    stepper, _ = _prefilled(model, LeanStepper, prompts, capacity=16, compute_dtype=bf16)

    def addresses() -> list[int]:
        return [t.data_ptr() for w in stepper.weights for p in (w.qkv, w.o, w.gate_up, w.down) for t in p.weights]

    held = addresses()
    generator = torch.Generator().manual_seed(3)
    for param in model.parameters():
        param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    stepper.refresh_weights()
    fresh, _ = _prefilled(model, LeanStepper, prompts, capacity=16, compute_dtype=bf16)
    assert addresses() == held
    assert torch.equal(stepper.head_weight, fresh.head_weight)
    for old, new in zip(stepper.weights, fresh.weights):
        for name in ("qkv", "o", "gate_up", "down"):
            a, b = getattr(old, name), getattr(new, name)
            for x, y in zip((*a.weights, *a.biases), (*b.weights, *b.biases)):
                assert (x is None and y is None) or torch.equal(x, y), name
    stepper.load(*_prefill(model, prompts, bf16)[:3])
    tokens = torch.tensor([3, 4])
    torch.testing.assert_close(stepper.step(tokens), fresh.step(tokens), atol=0, rtol=0)


def test_unsupported_models_fall_back_to_the_forward(tiny_gpt2_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_pretrained(tiny_gpt2_path).eval()
    assert not lean_supported(gpt2)
    windowed = _model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert not lean_supported(windowed)
    training = MODELS["llama"]().train()
    assert not lean_supported(training)
    gelu = _model("llama", hidden_act="gelu")
    assert not lean_supported(gelu)
    dynamic_rope = _model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert not lean_supported(dynamic_rope)
    assert lean_supported(_model("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))
    with torch.inference_mode():
        input_ids, mask, positions = left_pad([[1, 2, 3]], 0, torch.device("cpu"))
        out = gpt2(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        stepper = make_stepper(gpt2, out.past_key_values, mask, positions[:, -1:], 8, lean=True)
    assert isinstance(stepper, TransformersStepper)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_engine_generates_the_same_with_either_decoder(architecture: str, tmp_path: Path) -> None:
    from core_rl.testing.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "model", alphabet="abcdefgh=", seed=0, architecture=architecture)
    prompts = [[1, 5, 6, 7], [1, 8], [1, 3, 4, 5, 6, 7]]
    sampling = SamplingParams(n=3, max_new_tokens=10, min_new_tokens=2, temperature=1.0)
    results = []
    for decoder in ("auto", "transformers"):
        engine = HFRolloutEngine(path, HFRolloutConfig(device="cpu", seed=5, decoder=decoder))
        try:
            assert lean_supported(engine.model)
            out = engine.generate(prompts, sampling)
        finally:
            engine.close()
        results.append([(s.response_ids, s.finish_reason, s.logprobs) for group in out for s in group])
    for (ids_a, reason_a, lp_a), (ids_b, reason_b, lp_b) in zip(*results):
        assert (ids_a, reason_a) == (ids_b, reason_b)
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-5, rtol=0)


def test_compiled_steps_generate_what_the_eager_steps_do(tmp_path: Path) -> None:
    """``compile: true``: the engine's lean steps run compiled (:func:`core_rl_hf.decode.compiled_advance`)
    and a seeded engine generates the same tokens with the same log-probs (up to fused-kernel
    rounding, float32: in bfloat16 one rounding of an input moves a log-prob by ~1e-3) as the eager
    one, over rows that finish at different steps (dropped as they do) and a second call of other
    batch and prompt sizes, which compiles nothing new: one compilation in all, the positions
    cached symbolic from the first (at one step of the first call the positions cached equal its
    rows: a guard tying the two would compile again). One decoder layer: compiling scales with the layers,
    not what is tested."""
    from core_rl.testing.tiny import build_tiny_model
    from torch._dynamo.utils import counters

    path = build_tiny_model(tmp_path / "model", alphabet="abcdefgh=", seed=0, architecture="qwen2", num_layers=1)
    calls = [
        ([[1, 5, 6, 7], [1, 8], [1, 3, 4, 5, 6, 7]], SamplingParams(n=3, max_new_tokens=10, temperature=1.0)),
        ([[1, 2], [4, 4, 4, 4, 4, 4, 4, 4, 4]], SamplingParams(n=2, max_new_tokens=6, temperature=1.0)),
    ]
    results, frames = [], []
    for compile_steps in (False, True):
        engine = HFRolloutEngine(path, HFRolloutConfig(device="cpu", seed=5, compile=compile_steps))
        try:
            got = []
            for prompts, sampling in calls:
                out = engine.generate(prompts, sampling)
                got += [(s.response_ids, s.finish_reason, s.logprobs) for group in out for s in group]
                frames.append(counters["frames"]["ok"])
        finally:
            engine.close()
        results.append(got)
    assert frames[1] == frames[0] and frames[2] == frames[1] + 1 and frames[3] == frames[2], frames  # one compilation
    assert len({len(ids) for ids, _, _ in results[0]}) > 1  # rows finished at different steps
    for (ids_a, reason_a, lp_a), (ids_b, reason_b, lp_b) in zip(*results, strict=True):
        assert (ids_a, reason_a) == (ids_b, reason_b)
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(
            n=3,
            max_new_tokens=8,
            min_new_tokens=3,
            temperature=0.7,
            top_k=6,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
        ),
        SamplingParams(n=2, max_new_tokens=8, greedy=True, presence_penalty=0.5),
    ],
    ids=["filtered-penalised", "greedy"],
)
def test_compiled_choice_with_filters_penalties_and_greedy_matches_the_eager_one(tmp_path: Path, sampling) -> None:
    """The compiled step and choice (:func:`core_rl_hf.decode.compiled_advance`) with top-k, top-p,
    min-p, temperature, the three penalties, blocked stop tokens (``min_new_tokens``) and greedy
    choice: the eager engine's tokens, and its log-probs up to fused-kernel rounding (float32)."""
    from core_rl.testing.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "model", alphabet="abcdefgh=", seed=0, architecture="qwen2", num_layers=1)
    prompts = [[1, 5, 6, 7], [1, 8], [1, 3, 4, 5, 6, 7]]
    results = []
    for compile_steps in (False, True):
        engine = HFRolloutEngine(path, HFRolloutConfig(device="cpu", seed=7, compile=compile_steps))
        try:
            out = engine.generate(prompts, sampling)
        finally:
            engine.close()
        results.append([(s.response_ids, s.finish_reason, s.logprobs) for group in out for s in group])
    assert all(len(ids) >= 3 for ids, _, _ in results[0])  # stops were blocked for the first three tokens
    for (ids_a, reason_a, lp_a), (ids_b, reason_b, lp_b) in zip(*results, strict=True):
        assert (ids_a, reason_a) == (ids_b, reason_b)
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-5, rtol=0)


def test_compile_needs_the_lean_decoder() -> None:
    from core_rl.config.validators import FieldValueError

    with pytest.raises(FieldValueError, match=r"compile.*decoder: transformers does not use; set decoder: auto"):
        HFRolloutConfig(compile=True, decoder="transformers")


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    span=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_attention_as_two_products_is_sdpas_sum(rows: int, kv_heads: int, group: int, span: int, seed: int) -> None:
    """The compiled CPU step's attention (two matrix products around a masked softmax) gives
    SDPA's result over random keys, values and masks (the newest position always attended, as a
    step's is), grouped query heads and bf16 values included; a masked position's key and value
    change nothing. The eager step's is SDPA itself, bit for bit (the kernel the training forward
    runs)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, kv_heads, group, 16, generator=generator)
    k = torch.randn(rows, kv_heads, span, 16, generator=generator)
    v = torch.randn(rows, kv_heads, span, 16, generator=generator)
    mask = torch.rand(rows, 1, 1, span, generator=generator) < 0.7
    mask[..., -1] = True
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    got = _attention_products(q, k, v, mask, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(_one_query_attention(q, k, v, mask, 0.25), expected)
    narrow = v.bfloat16()  # bf16 value buffers: widened as they are read
    widened = torch.nn.functional.scaled_dot_product_attention(q, k, narrow.float(), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(_attention_products(q, k, narrow, mask, 0.25), widened, rtol=1e-5, atol=1e-6)
    assert torch.equal(_one_query_attention(q, k, narrow, mask, 0.25), widened)
    hidden = ~mask[:, :, 0, :, None].expand_as(k)
    changed = _attention_products(q, k.masked_fill(hidden, 1e3), v.masked_fill(hidden, -7.0), mask, 0.25)
    assert torch.equal(changed, got)
