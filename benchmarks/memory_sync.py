"""``weight_sync: memory`` from the ``fsdp`` train engine to the embedded ``hf`` rollout engine: time per
sync, and how much of it is the host's work per tensor rather than the copies.

    python benchmarks/memory_sync.py [--shapes 0.5b,0.5b-narrow] [--layouts plain,sharded] [--repeats 20]
                                     [--device auto] [--profile ROWS] [--smoke]

Shapes (:data:`core_rl.testing.tiny.QWEN2_SHAPES`, tied embeddings, the character vocabulary): ``0.5b`` is the
0.36B model of ``benchmarks/gpu_grpo.py`` (291 tensors, 1.4 GB in float32); ``0.5b-narrow`` has the
same 24 layers and tensors with hidden size 64, so its copies cost next to nothing and its time is
the per-tensor work on the host (state-dict walks, shard views, bucket bookkeeping, name checks):
what a GPU step pays on top of the copies themselves. Layouts: ``plain`` (one rank, the plain module)
and ``sharded`` (FSDP-wrapped for bf16 mixed precision over fp32 weights, as the GPU benchmark runs).
The rollout engine keeps float32 weights; the sync copies each bucket in place.

Prints per shape and layout: the tensors and bytes a sync moves, the median seconds per sync over
``--repeats`` (after 3 unmeasured), the bandwidth that implies, and the median seconds the sync
check adds to a checked sync (``rollout.sync_check``: the trainer's samples as the buckets pass,
the engine's fingerprints of what it holds, the folds and the comparison; over as many more syncs).
``--smoke``: a 2-layer model, 3 repeats, on the CPU (the test suite runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

NARROW = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2}
SMOKE = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
LAYOUTS = {"plain": {}, "sharded": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}


def shape_of(name: str) -> dict:
    from core_rl.testing.tiny import QWEN2_SHAPES

    if name == "smoke":
        return SMOKE
    if name.endswith("-narrow"):
        return {**QWEN2_SHAPES[name.removesuffix("-narrow")], **NARROW}
    return QWEN2_SHAPES[name]


def measure(model: Path, layout: str, device: str, repeats: int, profile: int = 0) -> dict[str, float]:
    """Median seconds per ``sync_in_memory`` from a trained fsdp engine to an hf engine on ``device``,
    and of the sync check of as many more; with ``profile`` rows, then torch's profiler over 3 more
    syncs: that many operators, by host time."""
    from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
    from core_rl.interfaces import LossOutput
    from core_rl.sync.buckets import nbytes
    from core_rl.sync.check import SentWeights
    from core_rl.sync.fingerprint import first_difference
    from core_rl.sync.weight_sync import sync_in_memory
    from core_rl.testing import make_rl_batch
    from core_rl_fsdp.config import FSDPConfig
    from core_rl_fsdp.engine import FSDPEngine
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    actor = ActorConfig(model_path=str(model), engine=PluginSpec(name="fsdp"), optimizer=OptimizerConfig(name="adamw"))
    engine = FSDPEngine(actor, FSDPConfig(device=device, **LAYOUTS[layout]))
    engine.train_step(make_rl_batch(), lambda batch, logprobs, entropy: LossOutput(per_token_loss=-logprobs))
    rollout = HFRolloutEngine(model, HFRolloutConfig(device=device))
    try:
        seconds = []
        for version in range(1, repeats + 4):
            start = time.perf_counter()
            sync_in_memory(engine, rollout, version, contextlib.nullcontext())  # the hf engine synchronises
            if version > 3:
                seconds.append(time.perf_counter() - start)
        checks = []
        for version in range(repeats + 4, 2 * repeats + 4):
            sent = SentWeights(version, rollout.fingerprint_prefix)
            sync_in_memory(engine, rollout, version, contextlib.nullcontext(), sent=sent)
            start = time.perf_counter()
            held = rollout.weight_fingerprints(version)["engine"]
            assert first_difference(sent.prints(rollout, "memory"), held) is None
            checks.append(sent.seconds + time.perf_counter() - start)
        if profile:
            print_profile(lambda v: sync_in_memory(engine, rollout, v, contextlib.nullcontext()), profile, device)
        state = rollout.model.state_dict()
        unique = {t.data_ptr(): t for t in state.values()}.values()
        return {
            "tensors": float(len(state)),
            "bytes": float(nbytes(unique)),
            "s": statistics.median(seconds),
            "check_s": statistics.median(checks),
        }
    finally:
        rollout.close()
        engine.close()


def print_profile(sync: Callable[[int], object], rows: int, device: str) -> None:
    """torch's profiler over 3 calls of ``sync`` (host and, on a CUDA ``device``, device time): the ``rows``
    operators that took the most host time (the ``sync`` row: the whole of the 3 calls)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for version in range(1000, 1003):
            with record_function("sync"):
                sync(version)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="0.5b,0.5b-narrow")
    parser.add_argument("--layouts", default="plain,sharded")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS", help="then profile 3 syncs: top ROWS ops")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model, 3 repeats, on the CPU")
    args = parser.parse_args()
    from core_rl.testing.tiny import build_tiny_model

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    device, repeats = ("cpu", 3) if args.smoke else (device, args.repeats)
    torch.set_num_threads(min(torch.get_num_threads(), 8))
    print(f"weight_sync: memory, fsdp -> hf on {device} (median of {repeats} syncs)")
    print(f"{'shape':<12}{'layout':<9}{'tensors':>8}{'MB':>9}{'ms/sync':>10}{'GB/s':>8}{'check ms':>10}")
    with tempfile.TemporaryDirectory(prefix="core-rl-sync-bench-") as tmp:
        for name in shapes:
            model = build_tiny_model(
                Path(tmp) / name, architecture="qwen2", tie_word_embeddings=True, seed=0, **shape_of(name)
            )
            for layout in args.layouts.split(","):
                row = measure(model, layout, device, repeats, args.profile)
                size, ms, rate = row["bytes"] / 1e6, row["s"] * 1e3, row["bytes"] / row["s"] / 1e9
                # three significant digits: the smoke model's ~0.1 MB a sync is a few hundredths of a GB/s
                check = row["check_s"] * 1e3
                print(f"{name:<12}{layout:<9}{row['tensors']:>8.0f}{size:>9.1f}{ms:>10.2f}{rate:>8.3g}{check:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
