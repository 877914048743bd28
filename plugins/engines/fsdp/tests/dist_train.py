"""Worker for the distributed tests, launched by ``torchrun`` (1 or 2 processes, gloo on CPU).

Trains the tiny model for 3 steps on fixed global batches, each rank taking its share of the rows
(unevenly, down to no rows at all, so ranks need different numbers of micro-batches); saves the
training state after step 1 and checks a second engine in the same process resumes from it; also
computes log-probs with a frozen reference engine and exports the model; trains on batches whose
rows share prompts in the ``shared`` and the ``padded`` micro-batch layouts. Rank 0 writes
``result.json`` and ``*.pt`` files to ``--out`` for the test to compare across world sizes.
``--cross-ckpt`` resumes from a checkpoint written by another world size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
from core_rl.config.schema import ActorConfig, MicroBatchConfig, OptimizerConfig, PluginSpec, SchedulerConfig
from core_rl.interfaces import LossOutput
from core_rl.protocol import TensorBatch
from core_rl.testing import make_grouped_rl_batch, make_rl_batch
from core_rl_fsdp.config import FSDPConfig
from core_rl_fsdp.engine import FSDPEngine

GLOBAL_ROWS = 7
WIDTH = 10  # make_rl_batch: prompt 4 + response up to 6
# rows of rank 0 per step when there are 2 ranks (rank 1 takes the rest): 4/3, 6/1, 7/0
SPLITS = [4, 6, 7]


def nll(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs, token_metrics={"neg_logprob": -logprobs.detach()})


def batches() -> list[TensorBatch]:
    return [make_rl_batch(batch_size=GLOBAL_ROWS, seed=s, max_response_len=6) for s in range(3)]


def my_rows(batch: TensorBatch, step: int, rank: int, world: int) -> TensorBatch:
    if world == 1:
        return batch
    cut = SPLITS[step]
    return batch.rows(slice(0, cut) if rank == 0 else slice(cut, GLOBAL_ROWS))


def actor(model: str) -> ActorConfig:
    return ActorConfig(
        model_path=model,
        engine=PluginSpec(name="fsdp"),
        optimizer=OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.01),
        lr_scheduler=SchedulerConfig(name="linear", warmup_steps=1, total_steps=4, min_lr_ratio=0.1),
        # greedy (consecutive rows): the micro-batch counts the test expects are worked out for it
        micro_batch=MicroBatchConfig(max_tokens_per_mb=2 * WIDTH, packing_algorithm="greedy"),
        grad_clip=0.5,
    )


def grouped_rows(batch: TensorBatch, rank: int, world: int) -> TensorBatch:
    """Rank 0's share of a grouped batch: its first 12 of 14 rows (groups cut across the ranks; in
    the first batch rank 1's two rows share no prompt, so rank 0 plans shared and rank 1 padded)."""
    if world == 1:
        return batch
    return batch.rows(slice(0, 12) if rank == 0 else slice(12, batch.batch_size))


def train(engine: FSDPEngine, data: list[TensorBatch], steps: range, rank: int, world: int) -> list[dict]:
    return [engine.train_step(my_rows(data[s], s, rank, world), nll, temperature=0.9) for s in steps]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cross-ckpt", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    data = batches()
    cfg = actor(args.model)

    a = FSDPEngine(cfg, FSDPConfig(), trainable=True)
    rank, world = a.rank, a.world_size
    assert (rank, world) == (dist.get_rank(), dist.get_world_size())
    ref = FSDPEngine(cfg, FSDPConfig(), trainable=False)
    ref_lp = ref.compute_logprobs(my_rows(data[0], 0, rank, world), temperature=0.9)

    metrics_a = train(a, data, range(1), rank, world)
    a.save_state(out / "ckpt", {"data_position": 1, "rank_independent": [1, 2]})
    metrics_a += train(a, data, range(1, 3), rank, world)
    final_a = a.full_state_dict()
    lp_a = a.compute_logprobs(my_rows(data[1], 1, rank, world))
    a.export_hf(out / "export")

    b = FSDPEngine(cfg, FSDPConfig(), trainable=True)
    extra = b.load_state(out / "ckpt")
    assert extra == {"data_position": 1, "rank_independent": [1, 2]}, extra
    assert b.step == 1
    metrics_b = train(b, data, range(1, 3), rank, world)
    final_b = b.full_state_dict()

    mixed = FSDPEngine(cfg, FSDPConfig(autocast_dtype="bfloat16"), trainable=True)
    metrics_bf16 = train(mixed, data, range(2), rank, world)

    # log-probs from the hidden states and the (sharded) head's weight: the same training as a's
    fused = FSDPEngine(attrs.evolve(cfg, fused_head=True), FSDPConfig(), trainable=True)
    metrics_fused = train(fused, data, range(3), rank, world)
    final_fused = fused.full_state_dict()

    # rows sharing prompts, in the shared layout and in the padded one
    grouped = [make_grouped_rl_batch(seed=s) for s in range(2)]
    by_layout = {}
    for layout in ("shared", "padded"):
        engine = FSDPEngine(attrs.evolve(cfg, micro_batch=attrs.evolve(cfg.micro_batch, layout=layout)), FSDPConfig())
        by_layout[layout] = [engine.train_step(grouped_rows(b, rank, world), nll, temperature=0.9) for b in grouped]
        by_layout[f"{layout}_final"] = engine.full_state_dict()
        by_layout[f"{layout}_lp"] = engine.compute_logprobs(grouped_rows(grouped[0], rank, world))
        engine.close()

    # 2 ranks: one sequence-parallel group (each rank half of every micro-batch's positions, the
    # group's rows pooled): the same training as one rank's; packed and fused as well
    sequence = {}
    if world == 2:
        sp = FSDPConfig(sequence_parallel_size=2)
        seq = FSDPEngine(cfg, sp, trainable=True)
        sequence["metrics_sp"] = train(seq, data, range(3), rank, world)
        final_sp = seq.full_state_dict()
        lp_sp = seq.compute_logprobs(my_rows(data[1], 1, rank, world))
        packed = attrs.evolve(cfg, fused_head=True, micro_batch=attrs.evolve(cfg.micro_batch, layout="packed"))
        sequence["metrics_sp_fused_packed"] = train(FSDPEngine(packed, sp, trainable=True), data, range(3), rank, world)
        rows_sp: list[object] = [None] * world
        dist.all_gather_object(rows_sp, lp_sp)
        if rank == 0:
            torch.save(final_sp, out / "final_sp.pt")
            torch.save(torch.cat(rows_sp), out / "logprobs_sp.pt")  # type: ignore[arg-type]

    result = {
        **sequence,
        "world": world,
        "metrics_a": metrics_a,
        "metrics_b": metrics_b,
        "metrics_bf16": metrics_bf16,
        "metrics_fused": metrics_fused,
        "metrics_shared": by_layout["shared"],
        "metrics_shared_padded": by_layout["padded"],
    }
    if args.cross_ckpt:
        c = FSDPEngine(cfg, FSDPConfig(), trainable=True)
        c.load_state(args.cross_ckpt)
        result["metrics_c"] = train(c, data, range(1, 3), rank, world)
        final_c = c.full_state_dict()
        if rank == 0:
            torch.save(final_c, out / "final_c.pt")

    if rank != 0:
        assert final_a == {} and final_b == {}
    # every rank's log-probs, gathered on rank 0 in row order
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, (ref_lp, lp_a))
    layouts: list[object] = [None] * world
    dist.all_gather_object(layouts, (by_layout["shared_lp"], by_layout["padded_lp"]))
    if rank == 0:
        torch.save(
            {
                "shared": by_layout["shared_final"],
                "padded": by_layout["padded_final"],
                "shared_lp": torch.cat([g[0] for g in layouts]),  # type: ignore[index]
                "padded_lp": torch.cat([g[1] for g in layouts]),  # type: ignore[index]
            },
            out / "layouts.pt",
        )
        torch.save(final_a, out / "final_a.pt")
        torch.save(final_b, out / "final_b.pt")
        torch.save(final_fused, out / "final_fused.pt")
        torch.save(
            {
                "ref": torch.cat([g[0] for g in gathered]),  # type: ignore[index]
                "trained": torch.cat([g[1] for g in gathered]),  # type: ignore[index]
            },
            out / "logprobs.pt",
        )
        (out / "result.json").write_text(json.dumps(result, indent=1))
    for engine in (a, b, ref, mixed):
        engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
