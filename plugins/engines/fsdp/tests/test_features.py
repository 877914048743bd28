"""FSDP engine features on one process: packed (padding-free) micro-batches, LoRA adapters (merged
export, adapter export), activation checkpointing on some layers, the attention choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from core_rl.config.schema import ActorConfig, LoraConfig, MicroBatchConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput
from core_rl.protocol import TensorBatch
from core_rl.roles.hf import resolve_attn_implementation
from core_rl.testing import make_rl_batch
from core_rl.testing.contracts import hf_logprobs
from core_rl.testing.weight_transfer import assert_same_adapter, check_weight_buckets
from core_rl_fsdp.config import FSDPConfig
from core_rl_fsdp.engine import FSDPEngine
from transformers import PreTrainedModel


def make_actor(model: Path, **overrides: object) -> ActorConfig:
    fields: dict[str, object] = {
        "model_path": str(model),
        "engine": PluginSpec(name="fsdp"),
        "optimizer": OptimizerConfig(name="sgd", lr=0.5),
        "grad_clip": 0.0,
    }
    fields.update(overrides)
    return ActorConfig(**fields)  # type: ignore[arg-type]


def nll_entropy(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs - 0.1 * entropy)


@pytest.mark.parametrize("algorithm", ["ffd", "kk"])
def test_packed_layout_gives_the_padded_update(tiny_model: Path, algorithm: str) -> None:
    batch = make_rl_batch(batch_size=7, seed=3)
    engines = {
        layout: FSDPEngine(
            make_actor(
                tiny_model,
                micro_batch=MicroBatchConfig(max_tokens_per_mb=25, layout=layout, packing_algorithm=algorithm),
            ),
            FSDPConfig(),
            trainable=True,
        )
        for layout in ("padded", "packed")
    }
    assert engines["packed"].runner.layout == "packed" and engines["padded"].runner.layout == "padded"
    lps = {k: e.compute_logprobs(batch, temperature=0.8) for k, e in engines.items()}
    torch.testing.assert_close(lps["packed"], lps["padded"], atol=2e-5, rtol=0)
    metrics = {k: e.train_step(batch, nll_entropy) for k, e in engines.items()}
    assert metrics["packed"]["num_micro_batches"] >= 2
    for key in ("loss", "grad_norm", "entropy", "tokens"):
        assert metrics["packed"][key] == pytest.approx(metrics["padded"][key], rel=1e-5), key
    want = engines["padded"].full_state_dict()
    for key, value in engines["packed"].full_state_dict().items():
        torch.testing.assert_close(value, want[key], atol=1e-5, rtol=1e-5, msg=key)
    for e in engines.values():
        e.close()


def test_lora_trains_only_adapters_and_exports_merged_and_adapter(tiny_model: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    actor = make_actor(tiny_model, optimizer=OptimizerConfig(name="adamw", lr=2e-2), lora=lora)
    engine = FSDPEngine(actor, FSDPConfig(), trainable=True)
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj", "down_proj"}
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    batch = make_rl_batch(seed=1)
    before = engine.full_state_dict()
    for key in base:  # B starts at 0: the merged model is the base model
        assert torch.equal(before[key], base[key]), key
    losses = [engine.train_step(batch, nll_entropy)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    merged = engine.full_state_dict()
    assert set(merged) == set(base)
    assert check_weight_buckets(engine) > 1  # merged, then in buckets
    changed = {k for k in base if not torch.equal(merged[k], base[k])}
    assert changed == {k for k in base if any(f"{m}.weight" in k for m in ("q_proj", "v_proj", "down_proj"))}
    out = tmp_path / "export"
    engine.export_hf(out)
    # the merged export computes what the adapter model computes
    want = engine.compute_logprobs(batch)
    torch.testing.assert_close(hf_logprobs(out, batch["input_ids"], batch["attention_mask"]), want, atol=1e-5, rtol=0)
    engine.export_adapter(tmp_path / "adapter")  # rollout.lora_sync: adapter: A and B gathered alone
    assert_same_adapter(tmp_path / "adapter", out / "adapter")
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8.0)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out / "adapter")
    merged_model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        a = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        b = merged_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    engine.close()


def test_lora_reference_is_the_base_model_and_state_resumes(tiny_model: Path, tmp_path: Path) -> None:
    lora = LoraConfig(rank=2, alpha=4.0)
    actor = make_actor(tiny_model, optimizer=OptimizerConfig(name="adamw", lr=2e-2), lora=lora)
    ref = FSDPEngine(actor, FSDPConfig(), trainable=False)
    batch = make_rl_batch(seed=4)
    torch.testing.assert_close(
        ref.compute_logprobs(batch),
        hf_logprobs(tiny_model, batch["input_ids"], batch["attention_mask"]),
        atol=1e-5,
        rtol=0,
    )
    a = FSDPEngine(actor, FSDPConfig(), trainable=True)
    a.train_step(batch, nll_entropy)
    a.save_state(tmp_path / "ckpt", {})
    a.train_step(make_rl_batch(seed=5), nll_entropy)
    b = FSDPEngine(actor, FSDPConfig(), trainable=True)
    b.load_state(tmp_path / "ckpt")
    b.train_step(make_rl_batch(seed=5), nll_entropy)
    want = a.full_state_dict()
    for key, value in b.full_state_dict().items():
        assert torch.equal(value, want[key]), key
    for e in (ref, a, b):
        e.close()


@pytest.mark.skipif(
    not hasattr(PreTrainedModel, "activation_checkpointing_enable"),
    reason="every n-th layer needs transformers >= 5.23 (activation_checkpointing_enable)",
)
def test_activation_checkpointing_every_second_layer(tiny_model: Path) -> None:
    batch = make_rl_batch(batch_size=4, seed=2)
    plain = FSDPEngine(make_actor(tiny_model), FSDPConfig(), trainable=True)
    some = FSDPEngine(
        make_actor(tiny_model, gradient_checkpointing=True, gradient_checkpointing_every_n_layers=2),
        FSDPConfig(),
        trainable=True,
    )
    layers = some.model.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    calls = [0, 0]
    for i, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    m1, m2 = plain.train_step(batch, nll_entropy), some.train_step(batch, nll_entropy)
    assert calls == [2, 1]  # layer 0 ran again in backward, layer 1 kept its activations
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-6)
    want = plain.full_state_dict()
    for key, value in some.full_state_dict().items():
        torch.testing.assert_close(value, want[key], atol=1e-6, rtol=1e-5)
    plain.close()
    some.close()


def test_attention_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import core_rl.roles.hf as hf

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_attn_implementation("auto", cpu, "float32") == "sdpa"
    assert resolve_attn_implementation("eager", cuda, "float32") == "eager"
    assert resolve_attn_implementation(None, cpu, "float32") is None
    monkeypatch.setattr(hf, "flash_attn_available", lambda: True)
    assert resolve_attn_implementation("auto", cuda, "bfloat16") == "flash_attention_2"
    assert resolve_attn_implementation("auto", cuda, "float16") == "flash_attention_2"
    # flash-attn has no float32 kernels: a float32 forward (the default actor.dtype) keeps SDPA
    assert resolve_attn_implementation("auto", cuda, "float32") == "sdpa"
    assert resolve_attn_implementation("auto", cpu, "bfloat16") == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_attention_packed_matches_sdpa_padded(tiny_model: Path) -> None:
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    batch = make_rl_batch(batch_size=6, seed=7)
    flash = FSDPEngine(
        make_actor(tiny_model, dtype="bfloat16", micro_batch=MicroBatchConfig(layout="auto")),
        FSDPConfig(attn_implementation="auto"),
        trainable=True,
    )
    assert flash.runner.layout == "packed" and flash.runner.varlen_kwargs
    sdpa = FSDPEngine(
        make_actor(tiny_model, dtype="bfloat16", micro_batch=MicroBatchConfig(layout="padded")),
        FSDPConfig(attn_implementation="sdpa"),
        trainable=True,
    )
    torch.testing.assert_close(flash.compute_logprobs(batch), sdpa.compute_logprobs(batch), atol=0.05, rtol=0)
    m1, m2 = flash.train_step(batch, nll_entropy), sdpa.train_step(batch, nll_entropy)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=2e-2)
    flash.close()
    sdpa.close()
