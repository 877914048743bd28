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
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from core_rl.testing.processes import idle_cpu, process_tree, tree_usage

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


def start_server(engine: str, model: Path, work: Path, url: str = "", cpus: list[int] | None = None) -> Any:
    """A rollout engine that started one managed server (kept for both runs; on the cores
    ``cpus``, any if empty), or that speaks to the server at ``url`` (which must serve a model of
    :func:`build_task`'s shape)."""
    from core_rl.config.loader import structure
    from core_rl.config.schema import PluginSpec, RolloutConfig
    from core_rl.plugins.host import PluginHost
    from core_rl.plugins.kinds import ROLLOUT_ENGINE

    entry = PluginHost().get(ROLLOUT_ENGINE, engine)
    return entry.factory(
        RolloutConfig(engine=PluginSpec(name=engine)),
        structure(
            {"dtype": "bfloat16", "server": {"urls": [url] if url else [], "cpus": list(cpus or [])}}, entry.config_cls
        ),
        model_path=str(model),
        run_dir=work / "server",
    )


def thread_usage(root: int | None, *, tree: bool = True) -> dict[str, float]:
    """CPU seconds so far of each thread of ``root``'s process tree (``tree``) or of ``root``
    alone, summed by thread name."""
    if root is None:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in process_tree(root) if tree else [root]:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                name, rest = (task / "stat").read_text().split(" (", 1)[1].rsplit(")", 1)
            except (OSError, ValueError):
                continue
            fields = rest.split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def trainer_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_config(args: argparse.Namespace, model: Path, data: Path, work: Path, url: str, bound: int) -> dict:
    return {
        "experiment": {"name": f"bound{bound}", "output_dir": str(work / "runs"), "seed": 1},
        "data": {"train_files": [str(data)], "batch_size": args.batch_size},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 3e-3}},
        "rollout": {
            "engine": {"name": args.engine, "dtype": "bfloat16", "server": {"urls": [url]}},
            "weight_sync": "disk",
            "sampling": {"n": args.n, "max_new_tokens": args.max_new_tokens},
            "controller": {
                "max_head_offpolicyness": bound,
                "warn_wait_fraction": 1.0,
                "pause_mode": args.pause_mode,
                # 0: the controller's default, (bound + 1) generation batches: a batch allowed by the
                # bound goes to the server whole, in one round trip, and waits in vLLM's queue for free
                # slots (admitting only as trajectories finish split each batch into ~3 HTTP requests
                # and more engine steps: 1.49-1.51x against 1.57-1.58x with this default)
                "max_concurrent_rollouts": args.max_concurrent_rollouts,
            },
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
    from core_rl.loops import train
    from core_rl.plugins.host import PluginHost

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


def measured_run(config: dict, work: Path, server_pid: int | None) -> dict[str, Any]:
    """One training run with the CPU seconds per step of the trainer and the server process trees."""
    trainer0, (server0, _) = trainer_cpu_s(), tree_usage(server_pid)
    threads0, own0 = thread_usage(server_pid), thread_usage(os.getpid(), tree=False)
    summary = summarise(train_once(config, work))
    steps = summary["steps"]
    for key, before, after in (
        ("server_thread_cpu_s", threads0, thread_usage(server_pid)),
        ("trainer_thread_cpu_s", own0, thread_usage(os.getpid(), tree=False)),
    ):
        spent = {name: (t - before.get(name, 0.0)) / steps for name, t in after.items()}
        summary[key] = dict(sorted(((k, round(v, 3)) for k, v in spent.items() if v >= 0.01), key=lambda kv: -kv[1]))
    summary["trainer_cpu_s"] = (trainer_cpu_s() - trainer0) / steps
    summary["server_cpu_s"] = (tree_usage(server_pid)[0] - server0) / steps
    summary["server_threads"] = tree_usage(server_pid)[1]
    return summary


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one mode: means of the figures, the staleness histogram of all."""
    out = dict(runs[-1])
    for key, value in runs[0].items():
        if isinstance(value, float) and key != "staleness_max":
            out[key] = statistics.fmean(r[key] for r in runs)
    out["staleness_max"] = max(r["staleness_max"] for r in runs)
    out["rounds_step_s"] = [r["step_s"] for r in runs]
    hist: dict[str, float] = {}
    for r in runs:
        for k, v in r["staleness_hist"].items():
            hist[k] = hist.get(k, 0.0) + v / len(runs)
    out["staleness_hist"] = dict(sorted(hist.items()))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="core-rl-async-") as tmp:
        work = Path(tmp)
        model, data = build_task(work)
        if args.trainer_cpus:  # this thread, and every thread the runs start, stay on these cores
            os.sched_setaffinity(0, args.trainer_cpus)
        engine = start_server(args.engine, model, work, args.url, args.server_cpus)
        try:
            url = engine.endpoints[0].url
            server = engine.endpoints[0].server
            server_pid = server.pid if server is not None else None
            runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
            idle = idle_cpu(server_pid)
            for round_ in range(args.rounds):  # alternate, so a change in machine load hits both
                for mode, bound in (("sync", 0), ("async", args.bound)):
                    engine.load_weights_from_path(model, 0)  # every run starts from the same weights
                    config = run_config(args, model, data, work, url, bound)
                    config["experiment"]["name"] += f"_r{round_}"
                    runs[mode].append(measured_run(config, work, server_pid))
        finally:
            engine.close()
    results: dict[str, Any] = {mode: combine(r) for mode, r in runs.items()}
    results["server_idle_cpu"] = idle
    results["trainer_threads"] = threading_count()
    results["speedup"] = results["sync"]["step_s"] / max(results["async"]["step_s"], 1e-9)
    results["speedup_per_round"] = [
        s / max(a, 1e-9) for s, a in zip(results["sync"]["rounds_step_s"], results["async"]["rounds_step_s"])
    ]
    results["settings"] = vars(args)
    return results


def threading_count() -> int:
    """Threads of this (the trainer's) process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def report(results: dict[str, Any]) -> None:
    s = results["settings"]
    print(
        f"{s['engine']} server, tiny task: {s['steps']} steps, {s['batch_size']} prompts x {s['n']} samples, "
        f"{s['max_new_tokens']} new tokens; async bound {s['bound']}; "
        f"server cores {s['server_cpus'] or 'any'}, trainer cores {s['trainer_cpus'] or 'any'}"
    )
    print(f"{'':24}{'sync':>12}{'async':>12}")
    rows = (
        ("wall time per step (s)", "step_s", "{:12.2f}"),
        ("trainer wait (s/step)", "wait_s", "{:12.2f}"),
        ("train (s/step)", "train_s", "{:12.2f}"),
        ("weight sync (s/step)", "weight_sync_s", "{:12.2f}"),
        ("rollout utilisation", "rollout_utilization", "{:12.2f}"),
        ("trainer CPU (s/step)", "trainer_cpu_s", "{:12.2f}"),
        ("server CPU (s/step)", "server_cpu_s", "{:12.2f}"),
        ("server threads", "server_threads", "{:12.0f}"),
        ("staleness mean", "staleness_mean", "{:12.2f}"),
        ("staleness max", "staleness_max", "{:12.0f}"),
        ("reward (last quarter)", "reward_last", "{:12.3f}"),
    )
    for label, key, fmt in rows:
        print(f"{label:24}" + fmt.format(results["sync"][key]) + fmt.format(results["async"][key]))
    print(f"staleness histogram (async): {results['async']['staleness_hist']}")
    for mode in ("sync", "async"):
        for side in ("server", "trainer"):
            print(f"{side} CPU s/step by thread ({mode}): {results[mode][side + '_thread_cpu_s']}")
    print(
        f"server CPU while idle: {results['server_idle_cpu']:.2f} cores; "
        f"trainer threads at the end: {results['trainer_threads']}"
    )
    rounds = ", ".join(f"{x:.2f}x" for x in results["speedup_per_round"])
    print(f"speed-up sync/async: {results['speedup']:.2f}x (per round, sync and async alternating: {rounds})")


def cores(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()]


def default_cores() -> tuple[list[int], list[int]]:
    """Rollout on one core, training on the rest: each side its own cores, so overlapping them
    does not make them compete (no split on a one-core machine)."""
    allowed = sorted(os.sched_getaffinity(0))
    return (allowed[:1], allowed[1:]) if len(allowed) > 1 else ([], [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="vllm", choices=("vllm", "sglang"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--bound", type=int, default=1)
    parser.add_argument(
        "--server-cpus",
        type=cores,
        default=default_cores()[0],
        help="cores of the started server, e.g. 0 or 0,1 (empty: any; default: the first of this machine's)",
    )
    parser.add_argument(
        "--trainer-cpus",
        type=cores,
        default=default_cores()[1],
        help="cores of the trainer (empty: any; default: the others)",
    )
    parser.add_argument(
        "--max-concurrent-rollouts",
        type=int,
        default=0,
        help="trajectories in flight (0: the controller's default, (bound + 1) x --batch-size)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="sync/async pairs, run alternately")
    parser.add_argument(
        "--pause-mode",
        default="keep",
        choices=("abort", "wait", "keep"),
        help="keep (default): requests frozen in place while the weights load; abort re-sends each "
        "interrupted sample with its prefix, which costs more than 8-token generations themselves",
    )
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
