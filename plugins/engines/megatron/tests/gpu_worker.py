"""GPU worker of ``test_gpu.py``, launched by ``torchrun`` (NCCL): the engine with Megatron's own
schedules and optimizer in the layout given by ``--options`` (a JSON ``actor.engine`` section),
against the ``fsdp`` engine on the same GPUs and rows, and against Hugging Face log-probs; then a
save / resume round and a Hugging Face export; a frozen engine (a reference model) in the same
layout computes the trainable one's log-probs; then a critic (``head="value"``: under pipeline
parallelism its head lives on the last stage) against the ``fsdp`` critic. Rank 0 writes
``result.json`` to ``--out``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mcore_common as common
import torch
import torch.distributed as dist
from core_rl.config.loader import structure
from core_rl.testing.contracts import hf_logprobs
from core_rl_megatron.config import MegatronConfig
from core_rl_megatron.engine import MegatronEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--options", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    cfg = structure(json.loads(args.options), MegatronConfig, path="actor.engine")
    engine = MegatronEngine(common.actor(args.model), cfg)
    rank, world = engine.rank, engine.world_size
    assert engine.use_megatron_schedule and engine.device.type == "cuda"
    batch = common.batches()[0]
    mine = common.my_rows(batch, 0, rank, world)
    lp = engine.compute_logprobs(mine)
    want = hf_logprobs(args.model, mine["input_ids"], mine["attention_mask"])
    lp_error = (lp - want).abs().max().item()
    frozen = MegatronEngine(common.actor(args.model), cfg, trainable=False)  # a reference model's engine
    frozen_lp_diff = (frozen.compute_logprobs(mine) - lp).abs().max().item()
    frozen.close()

    metrics = common.train(engine, range(1), rank, world)
    engine.save_state(out / "ckpt", {"k": 1})
    metrics += common.train(engine, range(1, 3), rank, world)
    final = engine.full_state_dict()
    engine.export_hf(out / "export")
    resumed = MegatronEngine(common.actor(args.model), cfg)
    assert resumed.load_state(out / "ckpt") == {"k": 1}
    resumed_metrics = common.train(resumed, range(1, 3), rank, world)
    final_resumed = resumed.full_state_dict()
    engine.close()
    resumed.close()

    from core_rl_fsdp.engine import FSDPEngine

    fsdp = FSDPEngine(common.actor(args.model, "fsdp"))
    fsdp_metrics = common.train(fsdp, range(3), rank, world)
    fsdp_final = fsdp.full_state_dict()
    fsdp.close()

    critics = [MegatronEngine(common.actor(args.model), cfg, head="value")]
    critics.append(FSDPEngine(common.actor(args.model, "fsdp"), head="value"))
    critic_metrics = [common.train_values(c, range(3), rank, world) for c in critics]
    critic_finals = [c.full_state_dict() for c in critics]
    for c in critics:
        c.close()

    if rank == 0:
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(out / "export", dtype=torch.float32).state_dict()
        result = {
            "world": world,
            "lp_error": lp_error,
            "frozen_lp_diff": frozen_lp_diff,
            "metrics": metrics,
            "resumed_metrics": resumed_metrics,
            "fsdp_metrics": fsdp_metrics,
            "resume_weight_diff": max((final[k].float() - final_resumed[k].float()).abs().max().item() for k in final),
            "fsdp_weight_diff": max((final[k].float() - fsdp_final[k].float()).abs().max().item() for k in final),
            "export_diff": max((exported[k] - final[k].float().cpu()).abs().max().item() for k in final),
            "critic_metrics": critic_metrics[0],
            "fsdp_critic_metrics": critic_metrics[1],
            "critic_weight_diff": max(
                (critic_finals[0][k].float() - critic_finals[1][k].float()).abs().max().item() for k in critic_finals[1]
            ),
        }
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
