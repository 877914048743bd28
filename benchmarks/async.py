"""Synchronous vs asynchronous training through a real inference server, side by side.

It starts one server (``vllm`` or ``sglang``, from the managed server environment) on a tiny model
of the example task (examples/tiny_grpo: reverse a 3-4 letter string), then trains the same
configuration twice against it, in this process (the train engine here, rollout in the server):

- ``sync``: ``rollout.controller.max_head_offpolicyness: 0`` (generation, then training);
- ``async``: ``max_head_offpolicyness: --bound`` (the server generates the next batches while the
  trainer trains; the decoupled loss corrects for the staleness).

Between the runs the server gets the initial weights back. It prints, for each mode, the mean wall
time per step (steps after the first), the trainer's wait for rollout, the rollout utilisation,
the staleness distribution and the reward over the last steps, then the speed-up sync / async.

    python benchmarks/async.py [--engine vllm] [--steps 12] [--batch-size 16] [--n 4]
                               [--max-new-tokens 8] [--bound 1] [--url URL] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_grpo"


def build_task(work: Path) -> tuple[Path, Path]:
    """The tiny model (head size 32, as vLLM's CPU attention needs) and the example's data."""
    from core_rl.testing.tiny import build_tiny_model

    sys.path.insert(0, str(EXAMPLE))
    try:
        from task import LETTERS, write_dataset
    finally:
        sys.path.remove(str(EXAMPLE))
    model = build_tiny_model(work / "model", alphabet=LETTERS + "=", seed=0, num_heads=2)
    return model, write_dataset(work / "data" / "train.jsonl")


def start_server(engine: str, model: Path, work: Path, url: str = "") -> Any:
    """A rollout engine that started one managed server (kept for both runs), or that speaks to
    the server at ``url`` (which must serve a model of :func:`build_task`'s shape)."""
    from core_rl.config.loader import structure
    from core_rl.config.schema import PluginSpec, RolloutConfig
    from core_rl.kinds import ROLLOUT_ENGINE
    from core_rl.plugins import PluginHost

    entry = PluginHost().get(ROLLOUT_ENGINE, engine)
    return entry.factory(
        RolloutConfig(engine=PluginSpec(name=engine)),
        structure({"dtype": "bfloat16", "server": {"urls": [url] if url else []}}, entry.config_cls),
        model_path=str(model),
        run_dir=work / "server",
    )


def run_config(args: argparse.Namespace, model: Path, data: Path, work: Path, url: str, bound: int) -> dict:
    return {
        "experiment": {"name": f"bound{bound}", "output_dir": str(work / "runs"), "seed": 1},
        "data": {"train_files": [str(data)], "batch_size": args.batch_size},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 3e-3}},
        "rollout": {
            "engine": {"name": args.engine, "dtype": "bfloat16", "server": {"urls": [url]}},
            "weight_sync": "disk",
            "sampling": {"n": args.n, "max_new_tokens": args.max_new_tokens},
            "controller": {"max_head_offpolicyness": bound, "warn_wait_fraction": 1.0, "pause_mode": args.pause_mode},
        },
        "algorithm": {"name": "grpo", "loss": {"name": "ppo_clip", "use_decoupled_loss": True}},
        "reward": {"name": "char_match"},
        "trainer": {"total_steps": args.steps, "torch_threads": 1},
        "saver": {"every_n_steps": 0, "at_end": False, "export_hf": False},
        "loggers": [],
    }


def train_once(config: dict, work: Path) -> list[dict]:
    import yaml
    from core_rl.builtin.loggers import read_metrics
    from core_rl.config import load_config
    from core_rl.plugins import PluginHost
    from core_rl.trainer import train

    path = work / f"{config['experiment']['name']}.yaml"
    path.write_text(yaml.safe_dump(config))
    host = PluginHost()
    train(load_config(path, host=host), host=host)
    return read_metrics(work / "runs" / config["experiment"]["name"] / "metrics.jsonl")


def summarise(rows: list[dict]) -> dict[str, Any]:
    later = rows[1:] or rows
    tail = rows[-max(1, len(rows) // 4) :]
    hist: dict[str, float] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("staleness/hist_"):
                hist[k.removeprefix("staleness/hist_")] = hist.get(k.removeprefix("staleness/hist_"), 0.0) + v / len(
                    rows
                )
    return {
        "steps": len(rows),
        "step_s": statistics.fmean(r["timing/step_s"] for r in later),
        "wait_s": statistics.fmean(r.get("timing/rollout_wait_s", 0.0) for r in later),
        "train_s": statistics.fmean(r["timing/train_s"] for r in later),
        "weight_sync_s": statistics.fmean(r["timing/weight_sync_s"] for r in later),
        "rollout_utilization": statistics.fmean(r.get("throughput/rollout_utilization", 0.0) for r in later),
        "staleness_mean": statistics.fmean(r.get("staleness/mean", 0.0) for r in rows),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
        "staleness_hist": dict(sorted(hist.items())),
        "reward_last": statistics.fmean(r["reward/mean"] for r in tail),
        "per_step": [
            {k: r.get(k) for k in ("timing/step_s", "timing/rollout_wait_s", "timing/train_s", "timing/weight_sync_s")}
            for r in rows
        ],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="core-rl-async-") as tmp:
        work = Path(tmp)
        model, data = build_task(work)
        engine = start_server(args.engine, model, work, args.url)
        try:
            url = engine.endpoints[0].url
            results = {}
            for mode, bound in (("sync", 0), ("async", args.bound)):
                engine.load_weights_from_path(model, 0)  # both runs start from the same weights
                results[mode] = summarise(train_once(run_config(args, model, data, work, url, bound), work))
        finally:
            engine.close()
    results["speedup"] = results["sync"]["step_s"] / max(results["async"]["step_s"], 1e-9)
    results["settings"] = vars(args)
    return results


def report(results: dict[str, Any]) -> None:
    s = results["settings"]
    print(
        f"{s['engine']} server, tiny task: {s['steps']} steps, {s['batch_size']} prompts x {s['n']} samples, "
        f"{s['max_new_tokens']} new tokens; async bound {s['bound']}"
    )
    print(f"{'':24}{'sync':>12}{'async':>12}")
    rows = (
        ("wall time per step (s)", "step_s", "{:12.2f}"),
        ("trainer wait (s/step)", "wait_s", "{:12.2f}"),
        ("train (s/step)", "train_s", "{:12.2f}"),
        ("weight sync (s/step)", "weight_sync_s", "{:12.2f}"),
        ("rollout utilisation", "rollout_utilization", "{:12.2f}"),
        ("staleness mean", "staleness_mean", "{:12.2f}"),
        ("staleness max", "staleness_max", "{:12.0f}"),
        ("reward (last quarter)", "reward_last", "{:12.3f}"),
    )
    for label, key, fmt in rows:
        print(f"{label:24}" + fmt.format(results["sync"][key]) + fmt.format(results["async"][key]))
    print(f"staleness histogram (async): {results['async']['staleness_hist']}")
    print(f"speed-up sync/async: {results['speedup']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="vllm", choices=("vllm", "sglang"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--bound", type=int, default=1)
    parser.add_argument("--pause-mode", default="abort", choices=("abort", "wait", "keep"))
    parser.add_argument("--url", default="", help="use this running server instead of starting one")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    results = run(args)
    report(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
