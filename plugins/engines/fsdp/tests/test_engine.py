"""The engine in one process (world size 1, gloo on CPU), checked against plain transformers."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from core_rl.checkpoint.files import CheckpointFormatError
from core_rl.config.schema import ActorConfig, MicroBatchConfig, OptimizerConfig, PluginSpec, SchedulerConfig
from core_rl.interfaces import LossOutput
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from core_rl_fsdp.config import FSDPConfig
from core_rl_fsdp.engine import FSDPEngine
from core_rl_fsdp.plugin import build_engine


def make_actor(model: Path, **overrides: object) -> ActorConfig:
    fields: dict[str, object] = {
        "model_path": str(model),
        "engine": PluginSpec(name="fsdp"),
        "optimizer": OptimizerConfig(name="sgd", lr=1.0),
        "grad_clip": 0.0,
    }
    fields.update(overrides)
    return ActorConfig(**fields)  # type: ignore[arg-type]


def nll_entropy(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    """-logprob - 0.1 * entropy: gradients flow through both. The metric ``one`` is 1 on the response
    and infinite elsewhere (only response tokens may count)."""
    one = torch.where(batch["response_mask"] > 0, 1.0, float("inf"))
    return LossOutput(
        per_token_loss=-logprobs - 0.1 * entropy,
        token_metrics={"neg_logprob": -logprobs.detach(), "one": one},
    )


def weights_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=1e-5, msg=key)


def reference_step(model_path: Path, batch: TensorBatch, temperature: float) -> dict[str, object]:
    """Loss, metrics and gradients of :func:`nll_entropy` from a plain transformers forward/backward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits / temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    lp = torch.zeros(ids.shape)
    ent = torch.zeros(ids.shape)
    lp[:, 1:] = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent[:, 1:] = -(logp.exp() * logp).sum(-1)
    lp, ent = lp * mask, ent * mask
    loss = ((-lp - 0.1 * ent) * batch["loss_weight"]).sum()
    loss.backward()
    resp = batch["response_mask"]
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {
        "loss": loss.item(),
        "entropy": ((ent * resp).sum() / resp.sum()).item(),
        "neg_logprob": ((-lp * resp).sum() / resp.sum()).item(),
        "grad_norm": torch.sqrt(sum(g.square().sum() for g in grads.values())).item(),
        "grads": grads,
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def test_train_step_matches_plain_transformers(tiny_model: Path) -> None:
    """Metrics, clipping, the warmup lr and the SGD update of one step, against a hand-made step."""
    batch = make_rl_batch(batch_size=5, seed=4)
    temperature, clip = 0.8, 0.05
    actor = make_actor(
        tiny_model,
        optimizer=OptimizerConfig(name="sgd", lr=0.5),
        lr_scheduler=SchedulerConfig(name="constant", warmup_steps=2),
        micro_batch=MicroBatchConfig(max_tokens_per_mb=20),
        grad_clip=clip,
    )
    engine = FSDPEngine(actor, FSDPConfig(), trainable=True)
    metrics = engine.train_step(batch, nll_entropy, temperature=temperature)
    ref = reference_step(tiny_model, batch, temperature)
    assert metrics["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert metrics["entropy"] == pytest.approx(ref["entropy"], rel=1e-5)
    assert metrics["neg_logprob"] == pytest.approx(ref["neg_logprob"], rel=1e-5)
    assert metrics["one"] == pytest.approx(1.0)
    assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert metrics["grad_norm"] > clip  # so clipping is exercised
    assert metrics["lr"] == pytest.approx(0.25)  # warmup: 0.5 * 1/2
    assert metrics["tokens"] == batch["attention_mask"].sum().item()
    assert metrics["num_micro_batches"] >= 3
    coef = clip / (ref["grad_norm"] + 1e-6)
    want = {k: w - 0.25 * coef * ref["grads"][k] for k, w in ref["weights"].items()}
    weights_close(engine.full_state_dict(), want)
    assert engine.train_step(batch, nll_entropy)["lr"] == pytest.approx(0.5)
    engine.close()


def test_gradient_checkpointing_gives_the_same_update(tiny_model: Path) -> None:
    batch = make_rl_batch(batch_size=4, seed=2)
    plain = FSDPEngine(make_actor(tiny_model), FSDPConfig(), trainable=True)
    ckpt = FSDPEngine(make_actor(tiny_model, gradient_checkpointing=True), FSDPConfig(), trainable=True)
    calls = {"plain": 0, "ckpt": 0}
    for name, engine in (("plain", plain), ("ckpt", ckpt)):
        engine.model.model.layers[0].mlp.register_forward_pre_hook(
            lambda *_, n=name: calls.__setitem__(n, calls[n] + 1)
        )
    m1 = plain.train_step(batch, nll_entropy)
    m2 = ckpt.train_step(batch, nll_entropy)
    # a pre-hook: the recompute in backward stops early (after the last saved tensor), so a
    # post-forward hook of the MLP would not fire again
    assert calls == {"plain": 1, "ckpt": 2}  # the layer ran again in backward: checkpointing is on
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-6)
    weights_close(plain.full_state_dict(), ckpt.full_state_dict())
    plain.close()
    ckpt.close()


@pytest.mark.parametrize(
    "options",
    [{"wrap": "root"}, {"reshard_after_forward": False}, {"cpu_offload": True}],
    ids=["wrap-root", "no-reshard", "cpu-offload"],
)
def test_sharding_options_give_the_same_update(tiny_model: Path, options: dict[str, object]) -> None:
    batch = make_rl_batch(batch_size=4, seed=6)
    base = FSDPEngine(make_actor(tiny_model), FSDPConfig(), trainable=True)
    variant = FSDPEngine(make_actor(tiny_model), FSDPConfig(**options), trainable=True)
    assert base.train_step(batch, nll_entropy)["loss"] == pytest.approx(
        variant.train_step(batch, nll_entropy)["loss"], rel=1e-6
    )
    weights_close(base.full_state_dict(), variant.full_state_dict())
    base.close()
    variant.close()


def test_one_rank_trains_the_plain_module_with_the_same_update(tiny_model: Path) -> None:
    """At world size 1 without policies the model is not FSDP-wrapped (``shard_single_rank``
    wraps it anyway); losses, gradient norms and weights after two AdamW steps agree."""
    from torch.distributed.fsdp import FSDPModule

    batch = make_rl_batch(batch_size=4, seed=7)
    adamw = OptimizerConfig(name="adamw", lr=1e-2, implementation="for_loop")
    actor = make_actor(tiny_model, optimizer=adamw, grad_clip=1.0)
    plain = FSDPEngine(actor, FSDPConfig(), trainable=True)
    wrapped = FSDPEngine(actor, FSDPConfig(shard_single_rank=True), trainable=True)
    assert not isinstance(plain.model, FSDPModule) and isinstance(wrapped.model, FSDPModule)
    for _ in range(2):
        m1, m2 = plain.train_step(batch, nll_entropy), wrapped.train_step(batch, nll_entropy)
        assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
        assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-6)
    weights_close(plain.full_state_dict(), wrapped.full_state_dict())
    plain.close()
    wrapped.close()


def test_bf16_mixed_precision_on_cpu(tiny_model: Path) -> None:
    batch = make_rl_batch(batch_size=4, seed=1)
    fp32 = FSDPEngine(make_actor(tiny_model), FSDPConfig(), trainable=False)
    bf16 = FSDPEngine(
        make_actor(tiny_model, optimizer=OptimizerConfig(name="adamw", lr=1e-3)),
        FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32"),
        trainable=True,
    )
    want = fp32.compute_logprobs(batch)
    got = bf16.compute_logprobs(batch)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.05, rtol=0)
    metrics = bf16.train_step(batch, nll_entropy)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert all(v.dtype == torch.float32 for v in bf16.full_state_dict().values())  # master weights stay fp32
    fp32.close()
    bf16.close()


def test_bf16_autocast_trains_float32_weights_deterministically(tiny_model: Path) -> None:
    """``autocast_dtype: bfloat16``: the decoder's matrix products run in bfloat16 (a hook sees their
    outputs), the plain module is kept at world size 1, log-probs and losses stay within bf16
    rounding of the float32 engine's, weights stay float32, and two runs give identical updates."""
    from torch.distributed.fsdp import FSDPModule

    batch = make_rl_batch(batch_size=4, seed=1)
    actor = make_actor(tiny_model, optimizer=OptimizerConfig(name="adamw", lr=1e-2), grad_clip=1.0)
    fp32 = FSDPEngine(actor, FSDPConfig(), trainable=True)
    mixed = [FSDPEngine(actor, FSDPConfig(autocast_dtype="bfloat16"), trainable=True) for _ in range(2)]
    assert not isinstance(mixed[0].model, FSDPModule)
    # the auto choice: SDPA in float32 on a CPU (whose bf16 SDPA backward is slow), plain SDPA on a GPU
    want_attn = "sdpa_float32" if fp32.device.type == "cpu" else "sdpa"
    assert mixed[0].model.config._attn_implementation == want_attn
    seen: dict[str, set[torch.dtype]] = {"fp32": set(), "bf16": set()}
    for name, engine in (("fp32", fp32), ("bf16", mixed[0])):
        engine.model.model.layers[0].mlp.down_proj.register_forward_hook(
            lambda _m, _i, out, n=name: seen[n].add(out.dtype)
        )
    want, got = fp32.compute_logprobs(batch), mixed[0].compute_logprobs(batch)
    assert got.dtype == torch.float32
    assert not torch.equal(got, want)  # bf16 rounding shows ...
    torch.testing.assert_close(got, want, atol=0.05, rtol=0)  # ... and stays small
    m32 = fp32.train_step(batch, nll_entropy)
    m16 = [engine.train_step(batch, nll_entropy) for engine in mixed]
    assert seen == {"fp32": {torch.float32}, "bf16": {torch.bfloat16}}
    assert m16[0]["loss"] == pytest.approx(m32["loss"], rel=2e-2)
    assert m16[0]["grad_norm"] == pytest.approx(m32["grad_norm"], rel=5e-2)
    assert m16[0]["loss"] == m16[1]["loss"] and m16[0]["grad_norm"] == m16[1]["grad_norm"]
    states = [engine.full_state_dict() for engine in mixed]
    assert all(v.dtype == torch.float32 for v in states[0].values())  # master weights stay fp32
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    for engine in (fp32, *mixed):
        engine.close()


def test_min_num_micro_batches(tiny_model: Path) -> None:
    batch = make_rl_batch(batch_size=5, seed=3)
    one = FSDPEngine(make_actor(tiny_model), FSDPConfig(), trainable=True)
    many = FSDPEngine(
        make_actor(tiny_model, micro_batch=MicroBatchConfig(max_tokens_per_mb=10_000, min_num_mb=4)),
        FSDPConfig(),
        trainable=True,
    )
    torch.testing.assert_close(one.compute_logprobs(batch), many.compute_logprobs(batch), atol=1e-6, rtol=0)
    m1, m2 = one.train_step(batch, nll_entropy), many.train_step(batch, nll_entropy)
    assert (m1["num_micro_batches"], m2["num_micro_batches"]) == (1.0, 4.0)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
    weights_close(one.full_state_dict(), many.full_state_dict())
    one.close()
    many.close()


def test_frozen_reference(tiny_model: Path, tmp_path: Path) -> None:
    ref = build_engine(make_actor(tiny_model), None, trainable=False)
    assert ref.optimizer is None and not ref.model.training
    assert not any(p.requires_grad for p in ref.model.parameters())
    batch = make_rl_batch()
    lp = ref.compute_logprobs(batch)
    assert lp.shape == batch["input_ids"].shape
    with pytest.raises(RuntimeError, match="frozen reference"):
        ref.train_step(batch, nll_entropy)
    with pytest.raises(RuntimeError, match="frozen reference"):
        ref.save_state(tmp_path / "ckpt", {})
    ref.close()
    with pytest.raises(RuntimeError, match="closed"):
        ref.compute_logprobs(batch)


def test_non_finite_gradient_skips_the_update(tiny_model: Path) -> None:
    engine = FSDPEngine(make_actor(tiny_model, grad_clip=1.0), FSDPConfig(), trainable=True)
    before = engine.full_state_dict()
    batch = make_rl_batch(seed=2)

    def nan_loss(mb: TensorBatch, lp: torch.Tensor, ent: torch.Tensor) -> LossOutput:
        return LossOutput(per_token_loss=lp * float("nan"))

    metrics = engine.train_step(batch, nan_loss)
    assert math.isnan(metrics["grad_norm"]) and engine.step == 1 and metrics["nonfinite"] == 1.0
    weights_close(engine.full_state_dict(), before, atol=0.0)
    metrics = engine.train_step(batch, nll_entropy)  # gradients were cleared: the next step is normal
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0 and metrics["nonfinite"] == 0.0
    engine.close()


def test_infinite_loss_with_finite_gradients_skips_the_update(tiny_model: Path) -> None:
    """Weight decay would move the weights even with zero gradients: nothing moves when skipped."""
    optimizer = OptimizerConfig(name="adamw", lr=0.1, weight_decay=0.5)
    engine = FSDPEngine(make_actor(tiny_model, optimizer=optimizer), FSDPConfig(), trainable=True)
    before = engine.full_state_dict()

    def inf_loss(mb: TensorBatch, lp: torch.Tensor, ent: torch.Tensor) -> LossOutput:
        return LossOutput(per_token_loss=lp * 0.0 + torch.where(mb["response_mask"] > 0, float("inf"), 0.0))

    metrics = engine.train_step(make_rl_batch(seed=3), inf_loss)
    assert metrics["grad_norm"] == 0.0 and math.isinf(metrics["loss"]) and metrics["nonfinite"] == 1.0
    weights_close(engine.full_state_dict(), before, atol=0.0)
    engine.close()


def test_check_checkpoint_reads_headers_and_names_the_bad_file(tiny_model: Path, tmp_path: Path) -> None:
    engine = FSDPEngine(make_actor(tiny_model, optimizer=OptimizerConfig(name="adamw")), FSDPConfig())
    engine.train_step(make_rl_batch(), nll_entropy)
    path = tmp_path / "ckpt"
    engine.save_state(path, {"n": 1})
    engine.check_checkpoint(path)
    optimizer = path / "optimizer.safetensors"
    optimizer.write_bytes(optimizer.read_bytes()[:50])
    with pytest.raises(CheckpointFormatError, match="optimizer.safetensors: cannot be read"):
        engine.check_checkpoint(path)
    (path / "rng" / "rank0.json").unlink()
    with pytest.raises(CheckpointFormatError, match=r"rank0.json: missing"):
        engine.check_checkpoint(path)
    (path / "meta.json").write_text('{"format": 1, "engine": "fsdp", "step": 1}')
    with pytest.raises(CheckpointFormatError, match="unsupported checkpoint"):
        engine.check_checkpoint(path)
    engine.close()


def test_bad_inputs_are_reported(tiny_model: Path) -> None:
    actor = make_actor(tiny_model, micro_batch=MicroBatchConfig(max_tokens_per_mb=20))
    engine = FSDPEngine(actor, FSDPConfig(), trainable=True)
    batch = make_rl_batch()
    with pytest.raises(ValueError, match="temperature"):
        engine.compute_logprobs(batch, temperature=0.0)
    with pytest.raises(KeyError, match="loss_weight"):
        engine.train_step(TensorBatch({k: batch[k] for k in batch.keys() if k != "loss_weight"}), nll_entropy)
    calls = []

    def wrong_shape_later(mb: TensorBatch, lp: torch.Tensor, ent: torch.Tensor) -> LossOutput:
        calls.append(1)  # the first micro-batch back-propagates, the second fails
        return nll_entropy(mb, lp, ent) if len(calls) == 1 else LossOutput(per_token_loss=lp.sum(-1))

    with pytest.raises(ValueError, match="per_token_loss"):
        engine.train_step(batch, wrong_shape_later)
    assert engine.step == 0 and len(calls) == 2
    fresh = FSDPEngine(actor, FSDPConfig(), trainable=True)
    for e in (engine, fresh):  # the failed step left no gradient behind
        e.train_step(batch, nll_entropy)
    weights_close(engine.full_state_dict(), fresh.full_state_dict(), atol=0.0)
    engine.close()
    fresh.close()
    with pytest.raises(ValueError, match="total_steps"):
        FSDPEngine(make_actor(tiny_model, lr_scheduler=SchedulerConfig(name="cosine")), FSDPConfig(), trainable=True)


def test_save_at_step_zero_does_not_change_training(tiny_model: Path, tmp_path: Path) -> None:
    """Asking torch for the state of an optimizer that never stepped would initialise it (AdamW's
    step count then differs); the engine must save none and resume identically."""
    actor = make_actor(tiny_model, optimizer=OptimizerConfig(name="adamw", lr=1e-2))
    batch = make_rl_batch(seed=5)
    saved = FSDPEngine(actor, FSDPConfig(), trainable=True)
    saved.save_state(tmp_path / "ckpt", {"position": 0})
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["optimizer"] is False
    saved.train_step(batch, nll_entropy)
    fresh = FSDPEngine(actor, FSDPConfig(), trainable=True)
    fresh.train_step(batch, nll_entropy)
    resumed = FSDPEngine(actor, FSDPConfig(), trainable=True)
    resumed.train_step(make_rl_batch(seed=9), nll_entropy)  # drift away, then load step 0
    assert resumed.load_state(tmp_path / "ckpt") == {"position": 0} and resumed.step == 0
    resumed.train_step(batch, nll_entropy)
    want = fresh.full_state_dict()
    for other in (saved, resumed):
        for key, value in other.full_state_dict().items():
            assert torch.equal(value, want[key]), key
    for e in (saved, fresh, resumed):
        e.close()


def test_rng_states_are_restored_and_checkpoints_replaced(tiny_model: Path, tmp_path: Path) -> None:
    engine = FSDPEngine(make_actor(tiny_model), FSDPConfig(), trainable=True)
    engine.train_step(make_rl_batch(), nll_entropy)
    path = tmp_path / "ckpt"
    engine.save_state(path, {"first": True})
    engine.train_step(make_rl_batch(seed=1), nll_entropy)
    engine.save_state(path, {"first": False})  # replaces the first, atomically
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    want = (torch.rand(3), random.random())
    torch.manual_seed(123)
    random.seed(123)
    assert engine.load_state(path) == {"first": False} and engine.step == 2
    assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1]
    with pytest.raises(CheckpointFormatError, match="meta.json"):
        engine.load_state(tmp_path / "missing")
    engine.close()


def test_a_failed_save_leaves_nothing_and_keeps_the_old_checkpoint(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core_rl.checkpoint import files as checkpointing

    engine = FSDPEngine(make_actor(tiny_model), FSDPConfig(), trainable=True)
    engine.train_step(make_rl_batch(), nll_entropy)
    path = tmp_path / "ckpt"
    engine.save_state(path, {"n": 1})

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointing, "save_tree", disk_full)
    with pytest.raises(OSError, match="No space left"):
        engine.save_state(path, {"n": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial directory left
    monkeypatch.undo()
    assert engine.load_state(path) == {"n": 1}
    engine.close()


def test_export_is_a_loadable_hf_directory_and_atomic(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    engine = FSDPEngine(make_actor(tiny_model), FSDPConfig(), trainable=True)
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    engine.train_step(make_rl_batch(), nll_entropy)
    engine.export_hf(out)
    names = sorted(p.name for p in out.iterdir())
    assert "stale.txt" not in names and "model.safetensors" in names and "tokenizer.json" in names
    assert AutoConfig.from_pretrained(out).architectures == ["LlamaForCausalLM"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    engine.model.save_pretrained = broken  # a failure while writing keeps the previous export
    with pytest.raises(OSError, match="disk full"):
        engine.export_hf(out)
    assert sorted(p.name for p in out.iterdir()) == names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    engine.close()


def test_compiled_model_trains_like_the_eager_one(tmp_path: Path) -> None:
    """``compile: true``: the plain one-rank module runs as one compiled graph (parameter names
    unchanged), and its log-probs, losses, gradient norms and updated weights over two steps of
    different widths equal the eager engine's up to fused-kernel rounding. Two graphs in all (with
    and without gradients): the second step's narrower micro-batch (cut from its batch) compiles
    nothing new. One decoder layer: tracing and compiling scale with the layers, not what is tested."""
    from core_rl.testing.tiny import build_tiny_model
    from torch._dynamo.utils import counters

    first, second = make_rl_batch(batch_size=4, seed=1), make_rl_batch(batch_size=3, seed=2)
    assert first["input_ids"].shape[1] != second["input_ids"].shape[1] or first.batch_size != second.batch_size
    model = build_tiny_model(tmp_path / "model", seed=0, num_layers=1)
    actor = make_actor(model)  # SGD: the updates are the gradients (AdamW would amplify rounding)
    eager = FSDPEngine(actor, FSDPConfig(), trainable=True)
    compiled = FSDPEngine(actor, FSDPConfig(compile=True), trainable=True)
    assert compiled.model._compiled_call_impl is not None and eager.model._compiled_call_impl is None
    assert compiled.full_state_dict().keys() == eager.full_state_dict().keys()
    compiled_before = counters["frames"]["ok"]
    torch.testing.assert_close(compiled.compute_logprobs(first), eager.compute_logprobs(first), atol=1e-5, rtol=0)
    for batch in (first, second):
        want, got = eager.train_step(batch, nll_entropy), compiled.train_step(batch, nll_entropy)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    weights_close(compiled.full_state_dict(), eager.full_state_dict(), atol=1e-5)
    assert counters["frames"]["ok"] - compiled_before == 2, dict(counters["frames"])
    for engine in (eager, compiled):
        engine.close()
