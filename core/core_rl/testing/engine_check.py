"""A train engine's whole life on a real device, shared by the engines' ``torchrun`` workers (the
GPU checks of ``fsdp`` and ``deepspeed``): log-probs against a transformers forward, a few
optimizer steps, save, more steps, load into a fresh engine that must repeat them, and an HF export
that transformers loads. Each rank trains its own slice of one batch.

A worker script calls :func:`worker_main` with a factory for its engine; rank 0 writes
``result.json`` (see :func:`train_save_resume_export` for the keys) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from core_rl.config.schema import ActorConfig, MicroBatchConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput, TrainEngine
from core_rl.protocol import TensorBatch
from core_rl.testing.helpers import hf_logprobs, make_rl_batch

EngineFactory = Callable[[ActorConfig], TrainEngine]


def nll(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    """Negative log-likelihood of every response token."""
    return LossOutput(per_token_loss=-logprobs)


def train_save_resume_export(make_engine: EngineFactory, engine_name: str, model: str, out: Path) -> dict[str, Any]:
    """Run the check of the module docstring; returns (on every rank) ``world``, ``lp_error`` (max
    abs. log-prob difference to transformers in float32), ``losses`` (5 steps, a checkpoint after
    the 2nd), ``resumed_losses`` (steps 3-5 again after loading the checkpoint),
    ``resume_weight_diff`` (max abs. difference of the final weights), ``export_dtypes`` (the
    exported tensors' dtypes) and ``devices`` (of the engine's first parameter)."""
    actor = ActorConfig(
        model_path=model,
        engine=PluginSpec(name=engine_name),
        optimizer=OptimizerConfig(name="adamw", lr=1e-2),
        micro_batch=MicroBatchConfig(max_tokens_per_mb=20),
    )
    engine = make_engine(actor)
    rank, world = engine.rank, engine.world_size  # type: ignore[attr-defined]
    device = str(next(iter(engine.model.parameters())).device.type)  # type: ignore[attr-defined]
    full = make_rl_batch(batch_size=8, seed=0)
    batch = full.rows(slice(rank * 8 // world, (rank + 1) * 8 // world))
    want = hf_logprobs(model, batch["input_ids"], batch["attention_mask"])
    lp_error = (engine.compute_logprobs(batch) - want).abs().max().item()
    losses = [engine.train_step(batch, nll)["loss"] for _ in range(2)]
    engine.save_state(out / "ckpt", {"k": 1})
    losses += [engine.train_step(batch, nll)["loss"] for _ in range(3)]
    resumed = make_engine(actor)
    assert resumed.load_state(out / "ckpt") == {"k": 1}
    resumed_losses = [resumed.train_step(batch, nll)["loss"] for _ in range(3)]
    a, b = engine.full_state_dict(), resumed.full_state_dict()
    max_diff = max(((a[k] - b[k]).abs().max().item() for k in a), default=0.0)
    engine.export_hf(out / "export")
    if rank == 0:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(out / "export")
    engine.close()
    resumed.close()
    return {
        "world": world,
        "device": device,
        "lp_error": lp_error,
        "losses": losses,
        "resumed_losses": resumed_losses,
        "resume_weight_diff": max_diff,
        "export_dtypes": sorted({str(v.dtype) for v in a.values()}),
    }


def worker_main(make_engine: EngineFactory, engine_name: str, argv: list[str] | None = None) -> None:
    """The ``torchrun`` worker: ``--model DIR --out DIR``; rank 0 writes ``out/result.json``."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    result = train_save_resume_export(make_engine, engine_name, args.model, out)
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
