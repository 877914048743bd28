"""GPU worker for ``test_gpu.py``'s float16 test (``torchrun``, one CUDA process): ZeRO-2 with float16
mixed precision; an overflowing step lowers the dynamic loss scale, a checkpoint keeps it, and a
fresh engine that loads the checkpoint scales and trains as the saving one goes on to."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from core_rl.config.schema import ActorConfig, MicroBatchConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput
from core_rl.testing import make_rl_batch
from core_rl_deepspeed.config import DeepSpeedConfig
from core_rl_deepspeed.engine import DeepSpeedEngine


def nll(batch, logprobs, entropy) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs)


def overflow(batch, logprobs, entropy) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs * float("inf"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    actor = ActorConfig(
        model_path=args.model,
        engine=PluginSpec(name="deepspeed"),
        optimizer=OptimizerConfig(name="adamw", lr=1e-3),
        micro_batch=MicroBatchConfig(max_tokens_per_mb=4096),
    )
    options = DeepSpeedConfig(zero_stage=2, mixed_precision="float16")
    batch = make_rl_batch(seed=1)
    saving = DeepSpeedEngine(actor, options)
    for loss in (nll, overflow, nll, overflow):
        saving.train_step(batch, loss)
    scale_saved = float(saving.optimizer.loss_scaler.cur_scale)
    saving.save_state(Path(args.out) / "ckpt", {})
    after = [saving.train_step(batch, loss)["loss"] for loss in (nll, nll)]
    resumed = DeepSpeedEngine(actor, options)
    initial_scale = float(resumed.optimizer.loss_scaler.cur_scale)
    resumed.load_state(Path(args.out) / "ckpt")
    result = {
        "initial_scale": initial_scale,
        "scale_saved": scale_saved,
        "scale_loaded": float(resumed.optimizer.loss_scaler.cur_scale),
        "after": after,
        "resumed_after": [resumed.train_step(batch, loss)["loss"] for loss in (nll, nll)],
        "scales_after": [float(e.optimizer.loss_scaler.cur_scale) for e in (saving, resumed)],
    }
    Path(args.out, "fp16.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
