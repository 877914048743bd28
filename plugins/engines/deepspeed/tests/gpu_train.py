"""GPU worker for ``test_gpu.py``, launched by ``torchrun`` (NCCL): ZeRO-3 with bf16 mixed precision
and optimizer offload, log-probs, training, save/load resume and export on CUDA. Rank 0 writes
``result.json`` to ``--out``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from core_rl.config.schema import ActorConfig, MicroBatchConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from core_rl.testing.contracts import hf_logprobs
from core_rl_deepspeed.config import DeepSpeedConfig
from core_rl_deepspeed.engine import DeepSpeedEngine


def nll(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    actor = ActorConfig(
        model_path=args.model,
        engine=PluginSpec(name="deepspeed"),
        optimizer=OptimizerConfig(name="adamw", lr=1e-2),
        micro_batch=MicroBatchConfig(max_tokens_per_mb=20),
    )
    options = DeepSpeedConfig(zero_stage=3, mixed_precision="bfloat16", offload_optimizer=True)
    engine = DeepSpeedEngine(actor, options, trainable=True)
    rank, world = engine.rank, engine.world_size
    assert engine.device.type == "cuda"
    full = make_rl_batch(batch_size=8, seed=0)
    batch = full.rows(slice(rank * 8 // world, (rank + 1) * 8 // world))
    want = hf_logprobs(args.model, batch["input_ids"], batch["attention_mask"])
    lp_error = (engine.compute_logprobs(batch) - want).abs().max().item()
    losses = [engine.train_step(batch, nll)["loss"] for _ in range(2)]
    engine.save_state(out / "ckpt", {"k": 1})
    losses += [engine.train_step(batch, nll)["loss"] for _ in range(3)]
    resumed = DeepSpeedEngine(actor, options, trainable=True)
    assert resumed.load_state(out / "ckpt") == {"k": 1}
    resumed_losses = [resumed.train_step(batch, nll)["loss"] for _ in range(3)]
    a, b = engine.full_state_dict(), resumed.full_state_dict()
    max_diff = max(((a[k] - b[k]).abs().max().item() for k in a), default=0.0)
    engine.export_hf(out / "export")
    if rank == 0:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(out / "export")
        result = {
            "world": world,
            "lp_error": lp_error,
            "losses": losses,
            "resumed_losses": resumed_losses,
            "resume_weight_diff": max_diff,
            "fp32_export": all(v.dtype == torch.float32 for v in a.values()),
        }
        (out / "result.json").write_text(json.dumps(result))
    engine.close()
    resumed.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
