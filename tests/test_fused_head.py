"""Log-probs from the last hidden states and the head's weight (``fused_head``): values and the
gradients of both inputs against autograd through the materialised logits, what backward keeps,
autocast, a whole model's forward in both layouts (tied and untied heads), which models cannot
be fused, and the configuration checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_rl_train_kit import fused_head as fused_head_module
from core_rl_train_kit import logprobs
from core_rl_train_kit.fused_head import check_fusable, fused_head, fused_head_stats, output_head
from core_rl_train_kit.packed import forward_logprobs
from hypothesis import given, settings
from hypothesis import strategies as st


def _reference(hidden, weight, targets, temperature, entropy):
    """Log-probs and entropies ``[N]`` through the whole logits (autograd's formulation)."""
    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    return lp, (-(logp.exp() * logp).sum(-1) if entropy else None)


@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(1, 12),
    width=st.integers(2, 16),
    vocab=st.integers(2, 40),
    chunk=st.integers(1, 120),
    temperature=st.one_of(st.just(1.0), st.floats(0.3, 2.0)),
    entropy=st.booleans(),
    bfloat16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_values_and_both_gradients_against_the_whole_logits(
    count, width, vocab, chunk, temperature, entropy, bfloat16, seed
) -> None:
    """Any shape, chunking (down to one row a chunk), temperature and dtype: the log-probs and
    entropies of the materialised logits, and the gradients of any weighting of both with
    respect to the hidden states and the weight."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bfloat16 else torch.float32
    hidden = (torch.randn(count, width, generator=g) * 2).to(dtype)
    weight = torch.randn(vocab, width, generator=g).to(dtype)
    targets = torch.randint(0, vocab, (count,), generator=g)
    w_lp, w_ent = torch.randn(count, generator=g), torch.randn(count, generator=g)
    out = {}
    for name in ("fused", "reference"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(logprobs, "CHUNK_ELEMENTS", chunk)
            if name == "fused":
                lp, ent = fused_head_stats(h, w, targets, temperature, with_entropy=entropy)
            else:
                lp, ent = _reference(h, w, targets, temperature, entropy)
            loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy else 0.0)
            loss.backward()
        out[name] = (lp.detach(), ent, h.grad, w.grad)
    (lp, ent, gh, gw), (ref_lp, ref_ent, ref_gh, ref_gw) = out["fused"], out["reference"]
    assert lp.dtype == torch.float32 and (ent is None) is (not entropy)
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=0)
    if entropy:
        torch.testing.assert_close(ent.detach(), ref_ent.detach(), atol=5e-5, rtol=0)
    assert gh.dtype == dtype and gw.dtype == dtype
    tolerance = 3e-2 if bfloat16 else 2e-5
    torch.testing.assert_close(gh.float(), ref_gh.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(gw.float(), ref_gw.float(), atol=tolerance, rtol=tolerance)


def test_by_hand_and_without_gradient() -> None:
    """h = (1, 0), W = ((0, 0), (ln 3, 0)): logits (0, ln 3), p = (1/4, 3/4); d log p_1 / dW_1 =
    (1 - p_1) h = (1/4, 0), d/dW_0 = -p_0 h = (-1/4, 0), d/dh = W_1 - sum_v p_v W_v = (ln 3 / 4, 0)."""
    ln3 = float(torch.log(torch.tensor(3.0)))
    hidden = torch.tensor([[1.0, 0.0]], requires_grad=True)
    weight = torch.tensor([[0.0, 0.0], [ln3, 0.0]], requires_grad=True)
    lp, ent = fused_head_stats(hidden, weight, torch.tensor([1]), 1.0, with_entropy=True)
    lp.sum().backward()
    assert lp.item() == pytest.approx(float(torch.log(torch.tensor(0.75))), abs=1e-6)
    entropy = -(0.25 * float(torch.log(torch.tensor(0.25))) + 0.75 * float(torch.log(torch.tensor(0.75))))
    assert ent.item() == pytest.approx(entropy, abs=1e-6)
    torch.testing.assert_close(weight.grad, torch.tensor([[-0.25, 0.0], [0.25, 0.0]]))
    torch.testing.assert_close(hidden.grad, torch.tensor([[ln3 / 4, 0.0]]))
    with torch.no_grad():
        lp2, ent2 = fused_head_stats(hidden, weight, torch.tensor([1]), 1.0, with_entropy=True)
    assert torch.equal(lp2, lp.detach()) and torch.equal(ent2, ent.detach()) and not lp2.requires_grad


def test_backward_keeps_no_tensor_of_the_vocabulary_size() -> None:
    """Saved for backward: the hidden states, the weight (the model's own tensors) and a few values
    per token; the logits ([N, V], larger than both here) are never kept."""
    g = torch.Generator().manual_seed(0)
    count, width, vocab = 64, 8, 512
    hidden = torch.randn(count, width, generator=g).bfloat16().requires_grad_(True)
    weight = torch.randn(vocab, width, generator=g).bfloat16().requires_grad_(True)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = fused_head_stats(
            hidden, weight, torch.randint(0, vocab, (count,), generator=g), 0.8, with_entropy=True
        )
    (lp.sum() + ent.sum()).backward()
    inputs = (hidden.numel() + weight.numel()) * 2
    assert saved[0] <= inputs + 24 * count < count * vocab * 2, saved[0]
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


def test_under_autocast_the_dtype_is_the_autocast_one_in_both_passes() -> None:
    """float32 weights under bfloat16 autocast: the same values and gradients as autocast gives
    the materialised logits (the head's product in bfloat16), the gradients in float32."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(10, 16, generator=g), torch.randn(50, 16, generator=g)
    targets = torch.randint(0, 50, (10,), generator=g)
    out = {}
    for name in ("fused", "reference"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if name == "fused":
                lp, ent = fused_head_stats(h, w, targets, 0.9, with_entropy=True)
            else:
                lp, ent = _reference(h, w, targets, 0.9, True)
        (lp.sum() + 0.5 * ent.sum()).backward()
        out[name] = (lp.detach(), h.grad, w.grad)
    (lp, gh, gw), (ref_lp, ref_gh, ref_gw) = out["fused"], out["reference"]
    assert gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(gh, ref_gh, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw, ref_gw, atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_model(request, tmp_path_factory) -> torch.nn.Module:
    from core_rl.testing.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", seed=0, architecture="qwen2", tie_word_embeddings=request.param
    )
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_models_forward_gives_what_the_logits_give(tiny_model, layout: str) -> None:
    """Through a whole model (the head tied to the embedding or not), in either layout: the same
    log-probs and entropies as from its logits, the same gradient of every parameter, and the
    head's own forward back in place afterwards."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, tiny_model.config.vocab_size, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    out = {}
    for fused in (False, True):
        tiny_model.zero_grad()
        lp, ent = forward_logprobs(
            tiny_model, ids, mask, temperature=0.8, with_entropy=True, layout=layout, fused=fused
        )
        ((lp * mask).sum() + 0.1 * ent.sum()).backward()
        grads = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
        out[fused] = (lp.detach(), ent.detach(), grads)
    (lp, ent, grads), (ref_lp, ref_ent, ref_grads) = out[True], out[False]
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert "forward" not in vars(output_head(tiny_model))


def test_the_heads_forward_is_restored_after_an_error(tiny_model) -> None:
    head = output_head(tiny_model)
    with (
        pytest.raises(RuntimeError, match="boom"),
        fused_head(tiny_model, torch.zeros(1, 1, dtype=torch.long), 1.0, with_entropy=False),
    ):
        assert "forward" in vars(head)
        raise RuntimeError("boom")
    assert "forward" not in vars(head)


def test_which_models_cannot_be_fused(tiny_model) -> None:
    import copy

    assert check_fusable(tiny_model) is None
    capped = copy.deepcopy(tiny_model)
    capped.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping=30.0" in check_fusable(capped)
    biased = copy.deepcopy(tiny_model)
    biased.lm_head = torch.nn.Linear(biased.config.hidden_size, biased.config.vocab_size, bias=True)
    assert "bias" in check_fusable(biased)
    wrapped = copy.deepcopy(tiny_model)
    wrapped.lm_head = torch.nn.Sequential(wrapped.lm_head)
    assert "Sequential" in check_fusable(wrapped)


def test_lora_on_the_head_cannot_be_fused(tmp_path: Path) -> None:
    from core_rl.config.model_sections import LoraConfig
    from core_rl.roles.lora import apply_lora
    from core_rl.testing.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", seed=0))
    adapted = apply_lora(model, LoraConfig(rank=4, target_modules=["q_proj", "lm_head"]))
    assert "not a plain linear layer" in check_fusable(adapted)
    plain = apply_lora(
        AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "n", seed=0)),
        LoraConfig(rank=4, target_modules=["q_proj"]),
    )
    assert check_fusable(plain) is None


def _run_config(tmp_path: Path, model: Path, *overrides: str):
    import json

    from core_rl.config import load_config
    from core_rl.plugins.host import PluginHost
    from core_rl.testing.launch import write_grpo_config

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s}) + "\n" for s in ("ab", "ba")))
    return load_config(write_grpo_config(tmp_path, model, [str(data)]), list(overrides), host=PluginHost())


def test_where_fused_head_cannot_apply_the_configuration_says_so(tmp_path: Path) -> None:
    """An engine that does not honour it (megatron, which also refuses LoRA rather than ignore it),
    a scalar-head role, a model that transforms its logits after the head, LoRA on the head."""
    import json
    from importlib.util import find_spec

    from core_rl.config.checks import MachineInfo
    from core_rl.errors import ConfigError, PreflightError
    from core_rl.loops.preflight import preflight
    from core_rl.testing.tiny import build_tiny_model

    pytest.importorskip("core_rl_fsdp")
    model = build_tiny_model(tmp_path / "model", alphabet="ab=", hidden_size=16, num_heads=2)
    no_gpu = MachineInfo(cuda_device_count=0)
    preflight(
        _run_config(tmp_path, model, "actor.fused_head=true", f"ref.model_path={model}", "ref.fused_head=true"),
        machine=no_gpu,
    )

    with pytest.raises(ConfigError) as info:
        _run_config(tmp_path, model, f"reward_model.model_path={model}", "reward_model.fused_head=true")
    assert "reward_model.fused_head: the reward_model has a scalar head, no vocabulary to fuse; set it to false" in (
        info.value.problems
    )
    with pytest.raises(ConfigError) as info:
        _run_config(tmp_path, model, "actor.fused_head=true", "actor.engine.compile=true")
    assert info.value.problems == [
        "actor.engine.compile: true with actor.fused_head: true, which compiled models do not support; "
        "set one of them to false"
    ]
    if find_spec("core_rl_megatron") is not None:
        with pytest.raises(ConfigError) as info:
            _run_config(tmp_path, model, "actor.engine.name=megatron", "actor.fused_head=true", "actor.lora.rank=4")
        problems = info.value.problems
        assert any(
            p.startswith("actor.fused_head: train engine 'megatron' (distribution core-rl-megatron)") for p in problems
        )
        assert "actor.lora.rank: 4, but the megatron engine trains every weight" in " ".join(problems)

    cfg = _run_config(
        tmp_path, model, "actor.fused_head=true", "actor.lora.rank=4", "actor.lora.target_modules=[q_proj,lm_head]"
    )
    with pytest.raises(PreflightError) as info:
        preflight(cfg, machine=no_gpu)
    assert any(p.startswith("actor.fused_head: actor.lora.target_modules adapts lm_head") for p in info.value.problems)

    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    with pytest.raises(PreflightError) as info:
        preflight(_run_config(tmp_path, model, "actor.fused_head=true"), machine=no_gpu)
    assert f"actor.fused_head: the model ({model / 'config.json'}) sets final_logit_softcapping=30.0" in " ".join(
        info.value.problems
    )
    preflight(_run_config(tmp_path, model), machine=no_gpu)  # without fused_head the model is fine


def test_an_engine_built_on_a_model_that_cannot_be_fused_names_the_setting(tiny_model) -> None:
    """Where ``config validate`` could not read the model (a hub id), the engine's build refuses it."""
    import copy

    from core_rl.config.schema import MicroBatchConfig
    from core_rl.errors import ConfigError
    from core_rl_train_kit.runner import MicroBatchRunner

    capped = copy.deepcopy(tiny_model)
    capped.config.logit_scale = 0.5
    options = dict(pad_token_id=0, attn_implementation="sdpa")
    with pytest.raises(ConfigError, match=r"fused_head: .*logit_scale=0.5.*set fused_head: false"):
        MicroBatchRunner(capped, MicroBatchConfig(), torch.device("cpu"), fused_head=True, **options)
    MicroBatchRunner(capped, MicroBatchConfig(), torch.device("cpu"), **options)  # not fused: fine
    assert MicroBatchRunner(capped, MicroBatchConfig(), torch.device("cpu"), head="value", fused_head=True, **options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("autocast", [False, True])
def test_on_a_gpu_the_fused_head_equals_the_logits_with_less_memory(autocast: bool) -> None:
    """On CUDA, a Qwen-sized head (896 x 151936) over 4096 tokens in several chunks, bfloat16
    weights or float32 ones under bfloat16 autocast: the log-probs and entropies of the
    materialised logits, both gradients within bfloat16 rounding, and a lower peak."""
    g = torch.Generator().manual_seed(0)
    count, width, vocab = 4096, 896, 151936
    dtype = torch.float32 if autocast else torch.bfloat16
    hidden = torch.randn(count, width, generator=g).to("cuda", dtype)
    weight = (torch.randn(vocab, width, generator=g) * width**-0.5).to("cuda", dtype)
    targets = torch.randint(0, vocab, (count,), generator=g).cuda()
    w_lp, w_ent = torch.randn(count, generator=g).cuda(), torch.randn(count, generator=g).cuda()
    out, peaks = {}, {}
    for name in ("fused", "reference"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            if name == "fused":
                lp, ent = fused_head_stats(h, w, targets, 0.9, with_entropy=True)
            else:
                lp, ent = _reference(h, w, targets, 0.9, True)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        out[name] = (lp.detach(), ent.detach(), h.grad, w.grad)
    (lp, ent, gh, gw), (ref_lp, ref_ent, ref_gh, ref_gw) = out["fused"], out["reference"]
    torch.testing.assert_close(lp, ref_lp, atol=1e-3, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-3, rtol=0)
    assert gh.dtype == gw.dtype == dtype
    scale = ref_gw.abs().max().item()
    torch.testing.assert_close(gh.float(), ref_gh.float(), atol=2e-2 * ref_gh.abs().max().item(), rtol=0)
    torch.testing.assert_close(gw.float(), ref_gw.float(), atol=2e-2 * scale, rtol=0)
    assert peaks["fused"] < peaks["reference"] / 2, peaks


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
def test_the_weights_gradient_over_many_chunks_is_as_precise_as_one_product(device: str) -> None:
    """bfloat16 weights, 40 chunks of rows, 4 blocks of the vocabulary (on CUDA the products are
    16-bit with a float32 result, elsewhere widened): the head weight's gradient is as close to a float64
    computation as autograd's single bfloat16 product is, in its largest and its mean error (a
    bfloat16 running sum drifts several times further; float32 sums of products each rounded to
    bfloat16 are 7% worse on the mean and up to 50% on the largest)."""
    g = torch.Generator().manual_seed(3)
    count, width, vocab = 640, 64, 512
    hidden = torch.randn(count, width, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=g, dtype=torch.float64) * 0.3
    targets = torch.randint(0, vocab, (count,), generator=g)
    w_lp = torch.randn(count, generator=g)

    def weight_grad(fn, dtype, on=device):
        h = hidden.detach().to(on, dtype).requires_grad_(True)
        w = weight.detach().to(on, dtype).requires_grad_(True)
        lp, _ = fn(h, w, targets.to(on), 1.0, False)
        (lp * w_lp.to(on, lp.dtype)).sum().backward()
        return w.grad.double().cpu()

    exact = weight_grad(_reference, torch.float64, "cpu")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(logprobs, "CHUNK_ELEMENTS", vocab * 16)  # 16 rows a chunk: 40 chunks
        patch.setattr(fused_head_module, "VOCAB_BLOCK", 128)
        fused = weight_grad(lambda h, w, y, t, e: fused_head_stats(h, w, y, t, with_entropy=e), torch.bfloat16)
    single = weight_grad(_reference, torch.bfloat16)
    fused_error, single_error = (fused - exact).abs(), (single - exact).abs()
    assert fused_error.max() <= 1.05 * single_error.max(), (fused_error.max().item(), single_error.max().item())
    assert fused_error.mean() <= 1.01 * single_error.mean(), (fused_error.mean().item(), single_error.mean().item())


class _Transforming(torch.nn.Module):
    """A model whose forward scales the head's output (as a family with a logit multiplier does)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits * 2.0
        return out


def test_a_transform_after_the_head_that_no_setting_names_is_caught_at_the_first_forward(tiny_model) -> None:
    from core_rl.errors import ConfigError

    ids, mask = torch.tensor([[3, 4, 5, 6]]), torch.ones(1, 4, dtype=torch.long)
    model = _Transforming(tiny_model)
    forward_logprobs(model, ids, mask, temperature=1.0, with_entropy=False)  # not fused: fine
    with pytest.raises(ConfigError, match="did not hand the output head's result on unchanged"):
        forward_logprobs(model, ids, mask, temperature=1.0, with_entropy=False, fused=True)
    assert "forward" not in vars(output_head(tiny_model))


def test_an_engine_wrapper_with_a_config_of_its_own_is_looked_through(tiny_model) -> None:
    """DeepSpeed's engine keeps the model as ``.module`` and has a ``config`` of its own."""
    import copy

    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module, self.config = module, {"train_batch_size": 1}

    scaled = copy.deepcopy(tiny_model)
    scaled.config.logits_scaling = 4.0
    assert "logits_scaling=4.0" in check_fusable(Wrapper(scaled))
    assert check_fusable(Wrapper(tiny_model)) is None
