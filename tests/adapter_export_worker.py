"""Worker of ``tests/test_adapter_export_ranks.py``, launched by ``torchrun`` (1 or 2 CPU processes).

For each engine (``fsdp``; ``deepspeed`` ZeRO-3, every LoRA tensor partitioned over the ranks) it
trains a LoRA adapter for 2 steps on fixed global batches, each rank taking its share of the rows
(4/3 of 7), then every rank calls ``export_adapter`` (what ``rollout.lora_sync: adapter`` sends a
server) and ``export_hf`` (the merged model and, beside it, the adapter from the whole state dict)
into ``--out/<engine>/``; rank 0 writes them, the others only take part in the gathers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from core_rl.config.schema import ActorConfig, LoraConfig, MicroBatchConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput, TrainEngine
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch

GLOBAL_ROWS = 7
RANK0_ROWS = 4


def nll(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs)


def my_rows(batch: TensorBatch, rank: int, world: int) -> TensorBatch:
    if world == 1:
        return batch
    return batch.rows(slice(0, RANK0_ROWS) if rank == 0 else slice(RANK0_ROWS, GLOBAL_ROWS))


def build(engine: str, model: str) -> TrainEngine:
    actor = ActorConfig(
        model_path=model,
        engine=PluginSpec(name=engine),
        optimizer=OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.0),
        micro_batch=MicroBatchConfig(max_tokens_per_mb=30),
        lora=LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]),
    )
    if engine == "fsdp":
        from core_rl_fsdp.config import FSDPConfig
        from core_rl_fsdp.engine import FSDPEngine

        return FSDPEngine(actor, FSDPConfig(), trainable=True)
    from core_rl_deepspeed.config import DeepSpeedConfig
    from core_rl_deepspeed.engine import DeepSpeedEngine

    return DeepSpeedEngine(actor, DeepSpeedConfig(zero_stage=3))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--engines", default="fsdp,deepspeed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = [make_rl_batch(batch_size=GLOBAL_ROWS, seed=s, max_response_len=6) for s in range(2)]
    for name in args.engines.split(","):
        torch.manual_seed(0)  # as the trainer seeds every rank alike before it builds its engines
        engine = build(name, args.model)
        rank, world = engine.rank, engine.world_size
        for batch in data:
            engine.train_step(my_rows(batch, rank, world), nll)
        out = Path(args.out) / name
        engine.export_adapter(out / "adapter")
        engine.export_hf(out / "export")
        engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
