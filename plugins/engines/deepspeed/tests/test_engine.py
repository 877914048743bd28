"""The engine in one process (gloo on CPU): offload settings, LoRA, a skipped non-finite step, and
checkpoints that hold no pickles and load into any ZeRO stage."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from core_rl.config.schema import ActorConfig, LoraConfig, MicroBatchConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch, preloaded
from core_rl.testing.contracts import hf_logprobs
from core_rl.testing.weight_transfer import assert_same_adapter, check_weight_buckets
from core_rl_deepspeed.config import DeepSpeedConfig
from core_rl_deepspeed.engine import DeepSpeedEngine


def make_actor(model: Path, **overrides: object) -> ActorConfig:
    fields: dict[str, object] = {
        "model_path": str(model),
        "engine": PluginSpec(name="deepspeed"),
        "optimizer": OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.01),
        "micro_batch": MicroBatchConfig(max_tokens_per_mb=30),
        "grad_clip": 0.5,
    }
    fields.update(overrides)
    return ActorConfig(**fields)  # type: ignore[arg-type]


def nll_entropy(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs - 0.1 * entropy)


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


@pytest.mark.parametrize(
    "options",
    [{"zero_stage": 2, "offload_optimizer": True}, {"zero_stage": 3, "offload_optimizer": True, "offload_param": True}],
    ids=["z2-offload-optimizer", "z3-offload-all"],
)
def test_offload_gives_the_same_update(tiny_model: Path, options: dict[str, object]) -> None:
    batch = make_rl_batch(batch_size=5, seed=1)
    base = DeepSpeedEngine(make_actor(tiny_model), DeepSpeedConfig(zero_stage=int(options["zero_stage"])))
    off = DeepSpeedEngine(make_actor(tiny_model), DeepSpeedConfig(**options))
    for _ in range(2):
        m1, m2 = base.train_step(batch, nll_entropy), off.train_step(batch, nll_entropy)
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-6)
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    same_weights(off.full_state_dict(), base.full_state_dict(), atol=1e-6)
    base.close()
    off.close()


def test_zero3_built_partitioned_or_whole_trains_the_same(tiny_model: Path) -> None:
    """``zero3_init`` changes how the model is built (partitioned by ``zero.Init``, or whole and then
    partitioned), not what it computes."""
    batch = make_rl_batch(batch_size=5, seed=3)
    options = [DeepSpeedConfig(zero_stage=3, zero3_init=z) for z in (True, False)]
    built = [DeepSpeedEngine(make_actor(tiny_model), o) for o in options]
    before = [e.compute_logprobs(batch) for e in built]
    assert torch.equal(before[0], before[1])
    m1, m2 = (e.train_step(batch, nll_entropy) for e in built)
    assert (m1["loss"], m1["grad_norm"]) == (m2["loss"], m2["grad_norm"])
    same_weights(built[0].full_state_dict(), built[1].full_state_dict())
    for e in built:
        e.close()


def test_lora_on_zero3_exports_merged_weights(tiny_model: Path, tmp_path: Path) -> None:
    actor = make_actor(tiny_model, lora=LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    engine = DeepSpeedEngine(actor, DeepSpeedConfig(zero_stage=3))
    assert all(".lora_" in n for n, p in engine.model.named_parameters() if p.requires_grad)
    batch = make_rl_batch(seed=2)
    losses = [engine.train_step(batch, nll_entropy)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    assert check_weight_buckets(engine) > 1  # gathered, merged, then in buckets
    engine.export_hf(tmp_path / "export")
    assert (tmp_path / "export" / "adapter" / "adapter_model.safetensors").is_file()
    # the adapter alone (rollout.lora_sync: adapter), its partitions gathered by themselves: the
    # adapter export_hf writes from the whole state dict
    engine.export_adapter(tmp_path / "adapter")
    assert_same_adapter(tmp_path / "adapter", tmp_path / "export" / "adapter")
    want = hf_logprobs(tmp_path / "export", batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(engine.compute_logprobs(batch), want, atol=1e-5, rtol=0)
    engine.close()


@pytest.mark.parametrize(("stage", "dtype"), [(2, "float32"), (1, "bfloat16"), (2, "bfloat16")])
def test_non_finite_gradient_skips_the_update(tiny_model: Path, stage: int, dtype: str) -> None:
    """Also with bf16 weights and no ``mixed_precision``: ZeRO-1/2 check gradients for overflow
    only in DeepSpeed's bf16 mode, which such weights turn on (without it NaN reached every weight)."""
    engine = DeepSpeedEngine(make_actor(tiny_model, dtype=dtype), DeepSpeedConfig(zero_stage=stage))
    before = engine.full_state_dict()
    batch = make_rl_batch(seed=2)

    def nan_loss(mb: TensorBatch, lp: torch.Tensor, ent: torch.Tensor) -> LossOutput:
        return LossOutput(per_token_loss=lp * float("nan"))

    metrics = engine.train_step(batch, nan_loss)
    assert not math.isfinite(metrics["grad_norm"]) and engine.step == 1
    same_weights(engine.full_state_dict(), before)
    metrics = engine.train_step(batch, nll_entropy)  # the next step is normal
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    engine.close()


def test_checkpoint_holds_no_pickles_and_loads_into_another_stage(tiny_model: Path, tmp_path: Path) -> None:
    batches = [make_rl_batch(seed=s) for s in range(3)]
    z1 = DeepSpeedEngine(make_actor(tiny_model), DeepSpeedConfig(zero_stage=1))
    z1.save_state(tmp_path / "step0", {"at": 0})  # before any step: no optimizer state yet
    assert json.loads((tmp_path / "step0" / "meta.json").read_text())["optimizer"] is False
    z1.train_step(batches[0], nll_entropy)
    z1.save_state(tmp_path / "ckpt", {"at": 1})
    files = {p.relative_to(tmp_path / "ckpt").as_posix() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    assert files == {
        "meta.json",
        "model.safetensors",
        "optimizer.json",
        "optimizer.safetensors",
        "extra.json",
        "rng/rank0.json",
        "rng/rank0.safetensors",
    }
    after = [z1.train_step(b, nll_entropy)["loss"] for b in batches[1:]]
    z3 = DeepSpeedEngine(make_actor(tiny_model), DeepSpeedConfig(zero_stage=3))
    z3.train_step(batches[2], nll_entropy)  # drift away first
    assert z3.load_state(tmp_path / "ckpt") == {"at": 1} and z3.step == 1
    resumed = [z3.train_step(b, nll_entropy)["loss"] for b in batches[1:]]
    assert resumed == pytest.approx(after, rel=1e-6)
    same_weights(z3.full_state_dict(), z1.full_state_dict(), atol=2e-5)
    fresh = DeepSpeedEngine(make_actor(tiny_model), DeepSpeedConfig(zero_stage=1))
    z3.load_state(tmp_path / "step0")  # step 0: the optimizer restarts as in a fresh run
    assert z3.train_step(batches[0], nll_entropy)["loss"] == pytest.approx(
        fresh.train_step(batches[0], nll_entropy)["loss"], rel=1e-6
    )
    same_weights(z3.full_state_dict(), fresh.full_state_dict(), atol=2e-5)  # stage 3 vs 1: reduction order
    for e in (z1, z3, fresh):
        e.close()


def test_frozen_reference_on_zero3(tiny_model: Path, tmp_path: Path) -> None:
    ref = DeepSpeedEngine(make_actor(tiny_model), DeepSpeedConfig(zero_stage=3), trainable=False)
    batch = make_rl_batch(seed=6)
    want = hf_logprobs(tiny_model, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(ref.compute_logprobs(batch), want, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="frozen reference"):
        ref.train_step(batch, nll_entropy)
    with pytest.raises(RuntimeError, match="frozen reference"):
        ref.save_state(tmp_path / "x", {})
    ref.close()
    with pytest.raises(RuntimeError, match="closed"):
        ref.compute_logprobs(batch)


def test_bf16_mixed_precision_trains_resumes_and_exports_fp32(tiny_model: Path, tmp_path: Path) -> None:
    options = DeepSpeedConfig(zero_stage=2, mixed_precision="bfloat16")
    a = DeepSpeedEngine(make_actor(tiny_model), options)
    batch = make_rl_batch(seed=3)
    want = hf_logprobs(tiny_model, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(a.compute_logprobs(batch), want, atol=0.05, rtol=0)  # bf16 compute
    losses = [a.train_step(batch, nll_entropy)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    assert {v.dtype for v in a.full_state_dict().values()} == {torch.float32}  # the fp32 masters
    a.save_state(tmp_path / "ckpt", {})
    after = a.train_step(batch, nll_entropy)["loss"]
    b = DeepSpeedEngine(make_actor(tiny_model), options)
    b.load_state(tmp_path / "ckpt")
    assert b.train_step(batch, nll_entropy)["loss"] == after
    same_weights(b.full_state_dict(), a.full_state_dict())
    a.close()
    b.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_weights_resume_from_their_fp32_masters_exactly(tiny_model: Path, tmp_path: Path, stage: int) -> None:
    """bf16 weights with fp32 masters: the checkpoint keeps the masters whole, so updates smaller
    than a bf16 step (lr 1e-5) survive a resume: the losses and masters after it are the
    uninterrupted run's, bit for bit (a checkpoint of bf16-rounded masters drifts at once)."""
    from deepspeed.utils import safe_get_full_fp32_param

    options = DeepSpeedConfig(zero_stage=stage, mixed_precision="bfloat16")
    actor = make_actor(tiny_model, dtype="bfloat16", optimizer=OptimizerConfig(name="adamw", lr=1e-5))
    batch = make_rl_batch(seed=3)
    a = DeepSpeedEngine(actor, options)
    for _ in range(3):
        a.train_step(batch, nll_entropy)
    a.save_state(tmp_path / "ckpt", {})
    want = [a.train_step(batch, nll_entropy)["loss"] for _ in range(2)]
    b = DeepSpeedEngine(actor, options)
    b.load_state(tmp_path / "ckpt")
    assert [b.train_step(batch, nll_entropy)["loss"] for _ in range(2)] == want
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(safe_get_full_fp32_param(pa), safe_get_full_fp32_param(pb)), name
    a.close()
    b.close()


def test_an_engine_on_another_device_type_than_deepspeeds_is_one_clear_error(monkeypatch) -> None:
    """DeepSpeed picks its accelerator once per process: a CPU engine beside a CUDA one (a small
    reference beside a GPU actor) would be moved to the GPU behind the engine's back. Here
    DeepSpeed is made to report CUDA, as the first engine on a GPU machine leaves it."""
    import deepspeed.accelerator
    from core_rl.errors import CoreRLError
    from core_rl_deepspeed.engine import import_deepspeed

    class OnCUDA:
        def device_name(self, index: int | None = None) -> str:
            return "cuda"

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: OnCUDA())
    with pytest.raises(CoreRLError, match="runs on cpu, but DeepSpeed already works on cuda in this process"):
        import_deepspeed(DeepSpeedConfig(), torch.device("cpu"))
    assert import_deepspeed(DeepSpeedConfig(), torch.device("cuda")) is not None


def test_zero12_weight_buckets_are_the_module_parameters_in_the_wanted_dtype(tiny_model: Path) -> None:
    """ZeRO-1/2 gather each update into the module's full parameters: where those are already in
    ``actor.dtype`` the buckets are the parameters themselves (no fp32 buffer assembled and reduced
    per parameter, no cast), equal to the masters cast to that dtype."""
    from deepspeed.utils import safe_get_full_fp32_param

    options = DeepSpeedConfig(zero_stage=2, mixed_precision="bfloat16", weight_bucket_mb=0.01)
    engine = DeepSpeedEngine(make_actor(tiny_model, dtype="bfloat16"), options)
    engine.train_step(make_rl_batch(seed=3), nll_entropy)
    params = {p.data_ptr() for p in engine.model.parameters()}
    buckets = list(engine.hf_weight_buckets())
    assert len(buckets) > 1 and all(t.data_ptr() in params for b in buckets for t in b.values())
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, safe_get_full_fp32_param(param).to(torch.bfloat16)), name
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_with_its_own_code_trains_and_exports_with_it(tmp_path: Path, stage: int) -> None:
    """``actor.trust_remote_code`` reaches the engine's load (ZeRO-3: partitioned as it is built) and
    its export, which keeps the model's code and gives the engine's log-probs when loaded again."""
    from core_rl.testing.remote_code_model import MODEL_CLASS, build_remote_code_model

    model = build_remote_code_model(tmp_path / f"remote_code_ds{stage}", seed=0)
    engine = DeepSpeedEngine(make_actor(model, trust_remote_code=True), DeepSpeedConfig(zero_stage=stage))
    assert engine._architectures == [MODEL_CLASS]
    batch = make_rl_batch(seed=2)
    losses = [engine.train_step(batch, nll_entropy)["loss"] for _ in range(2)]
    assert losses[-1] < losses[0]
    engine.export_hf(tmp_path / "export")
    assert (tmp_path / "export" / "modeling_tiny.py").is_file()
    want = hf_logprobs(tmp_path / "export", batch["input_ids"], batch["attention_mask"], trust_remote_code=True)
    torch.testing.assert_close(engine.compute_logprobs(batch), want, atol=1e-5, rtol=0)
    engine.close()


def test_deepspeed_is_imported_without_mlflow_which_imports_afterwards() -> None:
    """DeepSpeed's autotuner imports MLflow where installed (seconds of each process's start):
    ``import_deepspeed`` keeps it out, and ``import mlflow`` works afterwards (the mlflow logger)."""
    import sys

    pytest.importorskip("mlflow")
    script = (
        "import sys, torch\n"
        "from core_rl_deepspeed.config import DeepSpeedConfig\n"
        "from core_rl_deepspeed.engine import import_deepspeed\n"
        "import_deepspeed(DeepSpeedConfig(), torch.device('cpu'))\n"
        "assert 'deepspeed' in sys.modules and 'mlflow' not in sys.modules, sorted(sys.modules)\n"
        "import mlflow\n"
        "assert mlflow.__version__\n"
    )
    proc = preloaded.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
