"""Worker of ``test_engine_parity.py``, launched by ``torchrun`` (1 or 2 processes, gloo on CPU).

Runs every engine setting in one process, one after another, on the same tiny model, global batches
and loss: 3 optimizer steps each, every rank taking the rows :func:`rank_rows` gives it
(the trainer's own call). Each DeepSpeed setting also saves its state after step 1 and a second
engine of the same setting resumes from it. Rank 0 writes ``OUT/result.json`` (per-step metrics) and
``OUT/<setting>/{final,resumed}.safetensors``. With ``--cross DIR`` (a 2-rank run's output) the
ZeRO-3 checkpoint written by 2 ranks is resumed here too.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from core_rl.config.schema import ActorConfig, MicroBatchConfig, OptimizerConfig, PluginSpec, SchedulerConfig
from core_rl.data.balance import rank_rows
from core_rl.interfaces import LossOutput, TrainEngine
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from safetensors.torch import save_file

#: name -> (engine, engine options, micro-batch layout)
SETTINGS: dict[str, tuple[str, dict[str, object], str]] = {
    "fsdp": ("fsdp", {}, "padded"),
    "fsdp-packed": ("fsdp", {}, "packed"),
    "zero1": ("deepspeed", {"zero_stage": 1}, "padded"),
    "zero2": ("deepspeed", {"zero_stage": 2}, "padded"),
    "zero3": ("deepspeed", {"zero_stage": 3}, "padded"),
    # one sequence-parallel group of all the ranks (of 1 rank: none)
    "zero2-seq": ("deepspeed", {"zero_stage": 2, "sequence_parallel_size": "world"}, "padded"),
    "zero3-seq-packed": ("deepspeed", {"zero_stage": 3, "sequence_parallel_size": "world"}, "packed"),
}
STEPS = 3


def loss_fn(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    """A clipped policy-gradient-like loss with an entropy term, so every input of the loss matters."""
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    clipped = torch.clamp(ratio, 0.8, 1.2)
    pg = -torch.minimum(ratio * batch["advantages"], clipped * batch["advantages"])
    return LossOutput(per_token_loss=pg - 0.01 * entropy, token_metrics={"ratio": ratio.detach()})


def global_batches() -> list[TensorBatch]:
    return [
        make_rl_batch(batch_size=9, seed=s, max_response_len=8, aggregation="seq-mean-token-mean") for s in range(STEPS)
    ]


def my_rows(batch: TensorBatch, rank: int, world: int) -> TensorBatch:
    return batch.rows(rank_rows(batch, rank, world))


def build(setting: str, model: str) -> TrainEngine:
    name, options, layout = SETTINGS[setting]
    if options.get("sequence_parallel_size") == "world":
        options = {**options, "sequence_parallel_size": int(os.environ.get("WORLD_SIZE", "1"))}
    actor = ActorConfig(
        model_path=model,
        engine=PluginSpec(name=name),
        optimizer=OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.01),
        lr_scheduler=SchedulerConfig(name="cosine", warmup_steps=1, total_steps=STEPS),
        micro_batch=MicroBatchConfig(max_tokens_per_mb=36, layout=layout),
        grad_clip=0.5,
    )
    if name == "fsdp":
        from core_rl_fsdp.config import FSDPConfig
        from core_rl_fsdp.engine import FSDPEngine

        return FSDPEngine(actor, FSDPConfig(**options), trainable=True)
    from core_rl_deepspeed.config import DeepSpeedConfig
    from core_rl_deepspeed.engine import DeepSpeedEngine

    return DeepSpeedEngine(actor, DeepSpeedConfig(**options), trainable=True)


def train(engine: TrainEngine, data: list[TensorBatch], steps: range) -> list[dict[str, float]]:
    rank, world = engine.rank, engine.world_size
    return [engine.train_step(my_rows(data[s], rank, world), loss_fn, temperature=0.9) for s in steps]


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cross", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    data = global_batches()
    result: dict[str, object] = {}
    for setting in SETTINGS:
        resume = SETTINGS[setting][0] == "deepspeed"  # fsdp's own distributed test covers its resume
        a = build(setting, args.model)
        metrics = train(a, data, range(1))
        if resume:
            a.save_state(out / setting / "ckpt", {"setting": setting})
        metrics += train(a, data, range(1, STEPS))
        final = a.full_state_dict()
        a.close()
        result[setting] = {"metrics": metrics}
        if dist.get_rank() == 0:
            save_weights(final, out / setting / "final.safetensors")
        if not resume:
            continue
        b = build(setting, args.model)
        assert b.load_state(out / setting / "ckpt") == {"setting": setting} and b.step == 1
        result[setting]["resumed"] = train(b, data, range(1, STEPS))
        resumed = b.full_state_dict()
        b.close()
        if dist.get_rank() == 0:
            save_weights(resumed, out / setting / "resumed.safetensors")
    if args.cross:
        c = build("zero3", args.model)
        c.load_state(Path(args.cross) / "zero3" / "ckpt")
        result["cross"] = {"metrics": train(c, data, range(1, STEPS))}
        cross = c.full_state_dict()
        c.close()
        if dist.get_rank() == 0:
            save_weights(cross, out / "cross" / "final.safetensors")
    if dist.get_rank() == 0:
        result["world"] = dist.get_world_size()
        (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
