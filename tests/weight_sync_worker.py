"""Worker of ``test_weight_sync_memory.py`` (arguments: MODEL_DIR OUT_DIR), launched by ``torchrun``
with 2 CPU processes (gloo): an FSDP-sharded engine on every rank, the ``hf`` rollout engine on rank 0
alone, one training step, then ``weight_sync: memory`` in buckets of about 10 KB. Every rank records
its host trips and the buckets it drew; rank 0 compares the rollout engine's weights with the
engine's full state dict and writes ``result.json``."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput
from core_rl.sync.buckets import nbytes
from core_rl.sync.weight_sync import sync_in_memory
from core_rl.testing import make_rl_batch
from core_rl.testing.weight_transfer import HostTrips
from core_rl_fsdp.config import FSDPConfig
from core_rl_fsdp.engine import FSDPEngine
from core_rl_hf.config import HFRolloutConfig
from core_rl_hf.engine import HFRolloutEngine


class Counted:
    """The engine, with each of its buckets counted as it is drawn."""

    def __init__(self, engine: FSDPEngine) -> None:
        self.engine, self.buckets, self.names = engine, 0, 0

    def hf_weight_buckets(self, bucket_bytes: int | None = None):
        for bucket in self.engine.hf_weight_buckets(bucket_bytes):
            self.buckets += 1
            self.names += len(bucket)
            yield bucket


def main(model: str, out: str) -> None:
    torch.set_num_threads(1)
    actor = ActorConfig(
        model_path=model, engine=PluginSpec(name="fsdp"), optimizer=OptimizerConfig(name="adamw", lr=1e-2)
    )
    engine = FSDPEngine(actor, FSDPConfig(weight_bucket_mb=0.01))
    rank = engine.rank
    rows = make_rl_batch(batch_size=4).rows(slice(2 * rank, 2 * rank + 2))
    engine.train_step(rows, lambda b, lp, ent: LossOutput(per_token_loss=-lp))
    rollout = HFRolloutEngine(model, HFRolloutConfig(device="cpu")) if rank == 0 else None
    before = {k: v.clone() for k, v in rollout.model.state_dict().items()} if rollout is not None else {}
    counted = Counted(engine)
    with HostTrips() as trips:
        sent = sync_in_memory(counted, rollout, 1, contextlib.nullcontext())  # type: ignore[arg-type]
    mine = {"rank": rank, "host_trips": len(trips.calls), "buckets": counted.buckets, "bucket_names": counted.names}
    mine["sent"] = sent
    gathered: list[object] = [None] * engine.world_size
    dist.all_gather_object(gathered, mine)
    full = engine.full_state_dict()
    if rollout is not None:
        own = rollout.model.state_dict()
        result = {
            "ranks": gathered,
            "full_bytes": float(nbytes(full.values())),
            "mismatched": [k for k, v in own.items() if not torch.equal(v, full[k])],
            "changed_by_training": any(not torch.equal(before[k], v) for k, v in own.items()),
            "version": rollout.weight_version,
        }
        Path(out, "result.json").write_text(json.dumps(result, indent=1))
        rollout.close()
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])  # MODEL_DIR OUT_DIR
