"""What Ray costs: the same 2-rank run of a tiny task (core_rl.testing.faults.build_task: fsdp,
hf rollout, grpo) under the ``local`` launcher (torch's elastic agent) and the ``ray`` launcher.

For each it prints the wall time of ``core-rl train`` (start-up included: for Ray, a cluster
started here unless ``--ray-address`` names one), the mean step time and weight-sync time over the
steps after the first, and whether the two runs logged the same metrics (they must: same ranks,
same seeds). ``--smoke``: 3 steps.

    python benchmarks/ray_overhead.py [--steps 20] [--ray-address HOST:PORT] [--smoke] [--json FILE] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml


def _run(config: Path, address: str | None) -> float:
    cmd = [sys.executable, "-m", "core_rl.cli", "train", "--nproc-per-node", "2"]
    if address:
        cmd += ["--ray-address", address]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    proc = subprocess.run([*cmd, str(config)], env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{config.name}: core-rl train exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return time.monotonic() - started


def measure(work: Path, steps: int, address: str | None) -> dict[str, Any]:
    """Run both launchers in ``work``; per launcher its wall time, step and weight-sync means, run dir."""
    from core_rl.builtin.loggers import read_metrics
    from core_rl.testing.faults import build_task, merged, run_dir

    base = merged(build_task(work), trainer={"total_steps": steps}, saver={"every_n_steps": steps, "keep_last": 1})
    out: dict[str, Any] = {}
    for launcher in ("local", "ray"):
        cfg = {**merged(base, experiment={"name": launcher}), "launcher": {"name": launcher}}
        config = work / f"{launcher}.yaml"
        config.write_text(yaml.safe_dump(cfg))
        wall = _run(config, address if launcher == "ray" else None)
        rows = read_metrics(run_dir(cfg) / "metrics.jsonl")
        later = rows[1:] or rows
        out[launcher] = {
            "wall_s": wall,
            "step_s": statistics.fmean(r["timing/step_s"] for r in later),
            "weight_sync_s": statistics.fmean(r["timing/weight_sync_s"] for r in later),
            "run_dir": str(run_dir(cfg)),
            "rows": rows,
        }
    keys = ("reward/mean", "actor/loss", "actor/grad_norm")
    out["same_metrics"] = all(
        abs(a[k] - b[k]) <= 1e-4 * abs(a[k]) + 1e-6
        for a, b in zip(out["local"]["rows"], out["ray"]["rows"], strict=True)
        for k in keys
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ray-address", default=None, help="a running Ray cluster (default: start one)")
    parser.add_argument("--smoke", action="store_true", help="3 steps")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--work", default=None, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    steps = 3 if args.smoke else args.steps
    if args.work:
        result = measure(Path(args.work), steps, args.ray_address)
    else:
        with tempfile.TemporaryDirectory(prefix="ray-overhead-") as tmp:
            result = measure(Path(tmp), steps, args.ray_address)
    print(f"2 CPU ranks, {steps} steps of the tiny task (fsdp, hf rollout, grpo)")
    print(f"{'launcher':<8} {'wall s':>8} {'step s':>8} {'weight sync s':>14}")
    for launcher in ("local", "ray"):
        r = result[launcher]
        print(f"{launcher:<8} {r['wall_s']:>8.1f} {r['step_s']:>8.3f} {r['weight_sync_s']:>14.4f}")
    print(f"same metrics: {result['same_metrics']}")
    if args.json:
        figures = {k: {m: v for m, v in r.items() if m != "rows"} for k, r in result.items() if k != "same_metrics"}
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if result["same_metrics"] else 1


if __name__ == "__main__":
    sys.exit(main())
