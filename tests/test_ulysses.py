"""Ulysses sequence parallelism (``core_rl_train_kit.ulysses`` and ``sharded_forward``).

Two real gloo ranks (``ulysses_worker.py``) check the all-to-alls, the gather and the gradients
against one process's unsharded forward; in-process tests with a group of one check the whole
sequence's mask and the layouts (every model call then goes through the Ulysses attention
function, with nothing exchanged), and the refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from core_rl_train_kit import ulysses
from core_rl_train_kit.packed import forward_logprobs, forward_values
from core_rl_train_kit.sharded_forward import sharded_logprobs, sharded_values
from hypothesis import given, settings
from hypothesis import strategies as st

ALONE = ulysses.SequenceGroup(group=None, ranks=(0,), index=0)
WORKER = Path(__file__).with_name("ulysses_worker.py")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A grouped-query llama, a qwen2 (q/k/v biases), and that qwen2 with a 4-token sliding window
    on its second layer."""
    from core_rl.testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("ulysses")
    llama = build_tiny_model(root / "llama", seed=0, num_kv_heads=2)
    qwen2 = build_tiny_model(root / "qwen2", seed=1, architecture="qwen2", alphabet="abcdefghij=+", num_kv_heads=2)
    window = root / "qwen2sw"
    window.mkdir()
    for file in qwen2.iterdir():
        (window / file.name).write_bytes(file.read_bytes())
    config = json.loads((window / "config.json").read_text())
    config.update(
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"],
    )
    (window / "config.json").write_text(json.dumps(config))
    return {"llama": llama, "qwen2": qwen2, "qwen2sw": window}


def test_two_ranks_give_one_process_values_and_gradients(models: dict[str, Path], tmp_path: Path) -> None:
    """Every case (3 models x sdpa/eager x padded/packed x logits/fused head, and each model with
    activation checkpointing): log-probs and entropies equal, the group's summed gradients equal,
    and every rank computed the same loss."""
    from core_rl.testing.launch import run_torchrun

    run_torchrun(WORKER, 2, "--models", *map(str, models.values()), "--out", str(tmp_path), timeout=300)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result.pop("same_loss_on_every_rank") == {"all": 1.0}
    assert len(result) == 3 * (2 * 2 * 2 + 1)
    for case, found in result.items():
        assert found["logprobs"] < 2e-6 and found["entropy"] < 2e-6, (case, found)
        assert found["grad_rel"] < 2e-6, (case, found)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (one per rank of the group)")
def test_on_two_gpus_nccl_gives_one_gpus_values_and_gradients(models: dict[str, Path], tmp_path: Path) -> None:
    """The same cases over NCCL, one GPU per rank (float32; GPU kernels block differently for
    fewer heads, so a looser bound)."""
    from core_rl.testing.launch import run_torchrun

    run_torchrun(
        WORKER, 2, "--models", *map(str, models.values()), "--out", str(tmp_path), "--device", "cuda", cpu=False
    )
    result = json.loads((tmp_path / "result.json").read_text())
    assert result.pop("same_loss_on_every_rank") == {"all": 1.0}
    for case, found in result.items():
        assert max(found["logprobs"], found["entropy"], found["grad_rel"]) < 1e-4, (case, found)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_group_of_one_gives_the_models_forward(models: dict[str, Path]) -> None:
    """The whole-sequence mask (additive, in the compute dtype) and the layouts on CUDA tensors:
    float32 and bfloat16 weights, and float32 weights under bfloat16 autocast."""
    import contextlib

    from core_rl.roles.hf import load_causal_lm

    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(13)[None, :] < torch.tensor([13, 6, 1, 9])[:, None]).long().cuda()
    for dtype, autocast in (("float32", False), ("bfloat16", False), ("float32", True)):
        reference = load_causal_lm(str(models["qwen2sw"]), dtype=dtype, attn_implementation="sdpa").cuda()
        sharded = load_causal_lm(str(models["qwen2sw"]), dtype=dtype, attn_implementation=ulysses.register("sdpa"))
        sharded = sharded.cuda()
        ids = (torch.randint(3, reference.config.vocab_size, mask.shape, generator=g).cuda()) * mask
        region = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        for layout in ("padded", "packed"):
            kwargs = {"temperature": 1.0, "with_entropy": True, "layout": layout}
            with torch.no_grad(), region:
                want = forward_logprobs(reference, ids, mask, **kwargs)
                got = sharded_logprobs(sharded, ids, mask, ALONE, attn_implementation="sdpa", **kwargs)
            bound = 1e-5 if dtype == "float32" and not autocast else 5e-2
            assert float((got[0] - want[0]).abs().max()) < bound, (dtype, autocast, layout)
            assert float((got[1] - want[1]).abs().max()) < bound, (dtype, autocast, layout)


def _load(path: Path, attn: str) -> torch.nn.Module:
    from core_rl.roles.hf import load_causal_lm

    return load_causal_lm(str(path), dtype="float32", attn_implementation=attn)


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 13), min_size=1, max_size=4),
    layout=st.sampled_from(["padded", "packed"]),
    inner=st.sampled_from(["sdpa", "eager"]),
    temperature=st.sampled_from([0.6, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_the_whole_sequence_mask_gives_the_models_own_forward(
    models: dict[str, Path], lengths: list[int], layout: str, inner: str, temperature: float, seed: int
) -> None:
    """A group of one runs every attention through :func:`ulysses.ulysses_attention` with the mask
    it builds itself (causal, padding, packed rows, the sliding window): the model's own forward."""
    width = max([*lengths, 1])
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    for name in ("qwen2sw", "llama"):
        reference, sharded = _load(models[name], inner), _load(models[name], ulysses.register(inner))
        ids = torch.randint(3, reference.config.vocab_size, mask.shape, generator=g) * mask
        kwargs = {"temperature": temperature, "with_entropy": True, "layout": layout}
        with torch.no_grad():
            want = forward_logprobs(reference, ids, mask, **kwargs)
            got = sharded_logprobs(sharded, ids, mask, ALONE, attn_implementation=inner, **kwargs)
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=0)


def test_values_of_a_value_model(models: dict[str, Path]) -> None:
    """A token-classification head through the sharded forward: the same values as unsharded."""
    from core_rl.roles.hf import load_value_model

    reference = load_value_model(str(models["llama"]), dtype="float32", attn_implementation="sdpa")
    sharded = load_value_model(str(models["llama"]), dtype="float32", attn_implementation=ulysses.register("sdpa"))
    with torch.no_grad():
        for model in (reference, sharded):
            torch.manual_seed(0)
            for p in model.score.parameters():
                p.normal_()
    ids = torch.randint(3, 40, (3, 7))
    mask = torch.tensor([[1] * 7, [1] * 3 + [0] * 4, [1] * 5 + [0] * 2])
    for layout in ("padded", "packed"):
        with torch.no_grad():
            want = forward_values(reference, ids, mask, layout=layout)
            got = sharded_values(sharded, ids, mask, ALONE, layout=layout, attn_implementation="sdpa")
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_the_mask_by_hand() -> None:
    """Two packed rows (3 and 2 tokens) and one added column, a window of 2."""
    whole = ulysses.WholeSequence(key_valid=torch.tensor([[True] * 6]), segments=torch.tensor([[0, 0, 0, 1, 1, 2]]))
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(whole.allowed(None)[0, 0], want)
    windowed = want.clone()
    windowed[2, 0] = False
    assert torch.equal(whole.allowed(2)[0, 0], windowed)
    # a padding key is never seen, except by itself (its row would be empty otherwise)
    padded = ulysses.WholeSequence(key_valid=torch.tensor([[True, True, False]]), segments=torch.zeros(1, 3))
    assert padded.allowed(None)[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_what_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="sdpa, eager, sdpa_float32, flash_attention_2, flash_attention_3"):
        ulysses.register("flex_attention")
    model = _load(models["llama"], ulysses.register("sdpa"))
    # a whole forward outside a sequence-parallel one would attend within the slice: refused
    with pytest.raises(RuntimeError, match="attention ulysses_sdpa ran outside a sequence-parallel forward"):
        model(input_ids=torch.tensor([[3, 4, 5]]))
    model(input_ids=torch.tensor([[3]]))  # one token (a placeholder micro-batch) runs as is
    three = ulysses.SequenceGroup(group=None, ranks=(0, 1, 2), index=0)
    with pytest.raises(ValueError, match=r"sequence_parallel_size 3 must divide the model's key/value heads \(2\)"):
        whole = ulysses.WholeSequence(torch.ones(1, 3), torch.zeros(1, 3))
        with torch.no_grad():
            model(input_ids=torch.tensor([[3]]), position_ids=torch.tensor([[0]]), **{ulysses.KWARG: (three, whole)})


def test_the_slices_of_a_group() -> None:
    sg = ulysses.SequenceGroup(group=None, ranks=(4, 5, 6), index=1)
    assert sg.size == 3 and sg.padded_width(7) == 9 and sg.padded_width(9) == 9
    assert sg.local(9) == slice(3, 6)


def test_a_varlen_kernel_gets_the_packed_rows_boundaries(models: dict[str, Path], monkeypatch) -> None:
    """flash-attn cannot run on a CPU: a stand-in registered as ``flash_attention_2`` checks what the
    Ulysses attention hands it (no mask; ``cu_seqlens`` and the longest row of the whole packed
    sequence, the group's added column a row of its own) and attends block by block with SDPA; the
    log-probs must be the model's own."""
    from torch.nn import functional as F
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    handed: list[tuple[list[int], int]] = []

    def varlen(module, query, key, value, attention_mask, **kwargs):
        assert module.config._attn_implementation == "flash_attention_2"  # the kernel transformers would pick
        if "cu_seq_lens_q" not in kwargs:  # a one-token placeholder forward: the inner kernel as is
            assert query.shape[2] == 1
            return value.repeat_interleave(query.shape[1] // value.shape[1], dim=1).transpose(1, 2), None
        assert attention_mask is None and "position_ids" not in kwargs
        cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
        assert torch.equal(cu, kwargs["cu_seq_lens_k"]) and cu.dtype == torch.int32
        handed.append((cu.tolist(), longest))
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        parts = []
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            q, k, v = (t[:, :, start:end] for t in (query, key, value))
            parts.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=kwargs.get("scaling")))
        return torch.cat(parts, dim=2).transpose(1, 2), None

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", varlen)
    reference, sharded = _load(models["llama"], "sdpa"), _load(models["llama"], ulysses.register("flash_attention_2"))
    ids = torch.randint(3, 40, (3, 6))
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 4 + [0] * 2])  # 12 tokens packed
    two = ulysses.SequenceGroup(group=None, ranks=(0,), index=0)
    with torch.no_grad():
        want = forward_logprobs(reference, ids, mask, temperature=1.0, with_entropy=False, layout="packed")
        got = sharded_logprobs(
            sharded,
            ids,
            mask,
            two,
            temperature=1.0,
            with_entropy=False,
            layout="packed",
            attn_implementation="flash_attention_2",
        )
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=0)
    assert handed and all(h == ([0, 6, 8, 12], 6) for h in handed)
    with torch.no_grad():  # a placeholder micro-batch (no group) also reaches the kernel under its own name
        sharded(input_ids=torch.tensor([[3]]))


def test_a_group_that_cannot_be_formed_is_refused_at_build() -> None:
    from core_rl.errors import ConfigError

    assert ulysses.engine_group(1, 3, engine="fsdp") is None
    with pytest.raises(
        ConfigError, match=r"fsdp engine .* sequence_parallel_size: 2 must divide the number of ranks \(3\)"
    ):
        ulysses.engine_group(2, 3, engine="fsdp")
    config = type("Config", (), {"num_key_value_heads": 4, "num_attention_heads": 8})()
    ulysses.check_heads(config, 4, engine="deepspeed")
    with pytest.raises(ConfigError, match=r"deepspeed engine .* must divide the model's key/value heads \(4\)"):
        ulysses.check_heads(config, 3, engine="deepspeed")


def test_a_window_the_model_keeps_on_its_module_is_applied() -> None:
    """Some models leave ``sliding_window`` out of the attention call (transformers' mask carries it
    for them): the module's own attribute then sets the window."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attend = ulysses.ulysses_attention("sdpa")
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    whole = ulysses.WholeSequence(key_valid=torch.ones(1, 6, dtype=torch.bool), segments=torch.zeros(1, 6))
    module = torch.nn.Module()
    module.is_causal = True

    def run(**kwargs: object) -> torch.Tensor:
        return attend(module, query, key, value, None, **{ulysses.KWARG: (ALONE, whole)}, **kwargs)[0]

    module.sliding_window = 2
    windowed = run()
    assert torch.equal(windowed, run(sliding_window=2))
    module.sliding_window = None
    plain = run()
    causal, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, None)
    torch.testing.assert_close(plain, causal)
    assert not torch.allclose(windowed, plain)


def test_under_autocast_the_group_gives_the_autocast_forward(models: dict[str, Path]) -> None:
    """bf16 autocast, padded rows (a mask, built in bf16), sdpa and eager: within bf16 rounding of
    the unsharded autocast forward."""
    mask = (torch.arange(9)[None, :] < torch.tensor([9, 4, 6])[:, None]).long()
    for inner in ("sdpa", "eager"):
        reference, sharded = _load(models["llama"], inner), _load(models["llama"], ulysses.register(inner))
        ids = torch.randint(3, reference.config.vocab_size, mask.shape, generator=torch.Generator().manual_seed(1))
        kwargs = {"temperature": 1.0, "with_entropy": True, "layout": "padded"}
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want = forward_logprobs(reference, ids * mask, mask, **kwargs)
            got = sharded_logprobs(sharded, ids * mask, mask, ALONE, attn_implementation=inner, **kwargs)
        assert float((got[0] - want[0]).abs().max()) < 3e-2, inner
        assert float((got[1] - want[1]).abs().max()) < 3e-2, inner
