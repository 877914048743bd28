"""Worker of ``test_moe_distributed.py``, launched by ``torchrun`` (1 or 2 processes, gloo on CPU;
``--engine fsdp`` or ``deepspeed``, ZeRO 2).

Trains the tiny Qwen3-MoE at ``--model`` for 2 steps with rollout routing replay on a fixed batch
whose ``routed_experts`` come from a bf16 forward of the same model (so some differ from the
float32 trainer's own), each rank taking its share of the rows; then computes the log-probs. Rank 0
writes ``result.json`` (losses, MoE metrics, log-probs) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from core_rl.config.model_sections import MoEConfig
from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from core_rl_fsdp.engine import FSDPEngine
from core_rl_train_kit import moe

ROWS, SPLIT = 6, 4  # rank 0 takes 4 rows with 2 ranks


def nll(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs, token_metrics={})


def routed_batch(model_path: str) -> TensorBatch:
    from transformers import AutoModelForCausalLM

    batch = make_rl_batch(batch_size=ROWS, seed=0, max_response_len=6)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), moe.RouteRecorder(model) as recorder:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        layers, top_k = moe.route_shape(model)
        routes = recorder.take().reshape(*batch["input_ids"].shape, layers, top_k)
    batch["routed_experts"] = torch.where(batch["attention_mask"][..., None, None] > 0, routes, -1).to(torch.int16)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", choices=("fsdp", "deepspeed"), default="fsdp")
    args = parser.parse_args()
    torch.manual_seed(0)
    deepspeed = args.engine == "deepspeed"
    optimizer = OptimizerConfig(name="adamw", lr=1e-3) if deepspeed else OptimizerConfig(name="sgd", lr=0.5)
    actor = ActorConfig(
        model_path=args.model,
        engine=PluginSpec(name=args.engine),
        optimizer=optimizer,
        grad_clip=0.0,
        moe=MoEConfig(routing_replay="rollout", router_aux_loss_coef=0.0),  # per micro-batch: not split-invariant
    )
    if deepspeed:
        from core_rl_deepspeed.config import DeepSpeedConfig
        from core_rl_deepspeed.engine import DeepSpeedEngine

        engine = DeepSpeedEngine(actor, DeepSpeedConfig(zero_stage=2))
    else:
        engine = FSDPEngine(actor)
    batch = routed_batch(args.model)
    batch["loss_weight"] = batch["response_mask"] / batch["response_mask"].sum()
    rank, world = engine.rank, engine.world_size
    mine = slice(0, ROWS) if world == 1 else (slice(0, SPLIT) if rank == 0 else slice(SPLIT, ROWS))
    shard = batch.rows(mine)
    steps = [engine.train_step(shard, nll) for _ in range(2)]
    logprobs = engine.compute_logprobs(shard)
    gathered: list[torch.Tensor | None] = [None] * world
    dist.all_gather_object(gathered, logprobs)
    if rank == 0:
        keys = ("loss", "grad_norm", "moe/routing_agreement", "moe/imbalance")
        out = {
            "steps": [{k: s[k] for k in keys} for s in steps],
            "logprobs": torch.cat([t for t in gathered if t is not None]).tolist(),
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps(out))
    engine.close()


if __name__ == "__main__":
    main()
