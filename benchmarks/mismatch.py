"""The train/rollout mismatch of each rollout engine, measured on real ``core-rl train`` runs and
printed as one table (docs/when-stuck.md, "Train/rollout mismatch").

    python benchmarks/mismatch.py                          # the real model, hf/vllm/sglang, float32 and bfloat16
    python benchmarks/mismatch.py --engines hf --steps 5
    python benchmarks/mismatch.py --smoke                  # tiny model, hf float32, 1 step (the test runs this)

Each case is plain on-policy GRPO (fsdp actor in float32, no recompute: the update's first
optimiser step measures the mismatch, :mod:`core_rl.loops.rl.mismatch_probe`) on addition prompts
rendered with the chat template: ``--prompts`` prompts x ``--n`` samples of at most
``--max-new-tokens`` tokens at temperature 1, learning rate 1e-5, for ``--steps`` steps (every step
after the first samples with weights the trainer synced to the engine). Per case: the mean over the
steps of ``mismatch/abs_logprob_diff`` (mean |log pi_train - log pi_behave| over the loss tokens),
of ``mismatch/kl_behave_trainer`` (k3 KL(pi_behave || pi_train)) and of
``mismatch/ratio_out_of_bounds`` (share of tokens with the ratio outside [1/2, 2]), their largest
step value, and the probe's own time per step (``timing/mismatch_s``) against the update's
(``timing/train_s``). A server case whose environment is not built (``core-rl server-env create``)
is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: (engine, dtype) cases of the full run
CASES = [(e, d) for e in ("hf", "vllm", "sglang") for d in ("float32", "bfloat16")]
KEYS = ("mismatch/abs_logprob_diff", "mismatch/kl_behave_trainer", "mismatch/ratio_out_of_bounds")


def _prompts(root: Path, count: int) -> Path:
    path = root / "add.jsonl"
    rows = [(3 + 7 * i % 89, 11 + 13 * i % 83) for i in range(count)]
    prompts = (f"What is {a} + {b}? Answer with the number only." for a, b in rows)
    answers = (str(a + b) for a, b in rows)
    path.write_text("".join(json.dumps({"prompt": p, "answer": s}) + "\n" for p, s in zip(prompts, answers)))
    return path


def _config(root: Path, model: Path, engine: str, dtype: str, args: argparse.Namespace, *, chat: bool) -> Path:
    import yaml

    rollout_engine: dict[str, Any] = {"name": engine, "dtype": dtype}
    rollout: dict[str, Any] = {
        "engine": rollout_engine,
        "sampling": {"n": args.n, "max_new_tokens": args.max_new_tokens, "temperature": 1.0},
    }
    if engine != "hf":
        rollout["weight_sync"] = "collective"
    config = {
        "experiment": {"name": f"{engine}_{dtype}", "output_dir": str(root / "runs"), "seed": 1},
        "data": {"train_files": [str(_prompts(root, args.prompts))], "batch_size": args.prompts},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-5}},
        "rollout": rollout,
        "algorithm": {"name": "grpo", "loss": {"name": "ppo_clip"}},
        "reward": {"name": "char_match"},
        "trainer": {"total_steps": args.steps, "torch_threads": 1},
        "saver": {"at_end": False},
        "loggers": [{"name": "console"}],
    }
    if chat:
        config["data"]["apply_chat_template"] = True
    path = root / f"{engine}_{dtype}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _server_env_missing(engine: str) -> str | None:
    """Why ``engine``'s server environment cannot run here (``None``: it can)."""
    if engine == "hf":
        return None
    from core_rl_server_kit.env import find, get_spec

    if find(get_spec(engine)) is None:
        return f"no {engine} server environment (core-rl server-env create {engine})"
    return None


def run_case(root: Path, model: Path, engine: str, dtype: str, args: argparse.Namespace, *, chat: bool) -> dict:
    """One case's figures (module docstring), or ``{"skipped": why}``."""
    from core_rl.builtin.loggers import read_metrics

    missing = _server_env_missing(engine)
    if missing is not None:
        return {"skipped": missing}
    config = _config(root, model, engine, dtype, args, chat=chat)
    cmd = [sys.executable, "-m", "core_rl.cli", "train", str(config)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"skipped": f"core-rl train exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    rows = read_metrics(root / "runs" / f"{engine}_{dtype}" / "metrics.jsonl")
    out: dict[str, Any] = {"steps": len(rows)}
    for key in KEYS:
        values = [r[key] for r in rows if key in r]
        out[key] = (statistics.fmean(values), max(values))
    # a step whose first optimiser step was zero-signal (every advantage 0) skips its forward pass:
    # the probe then runs one forward pass of its own, the rest read the step's own log-probs
    forward = [r for r in rows if r.get("actor/zero_signal_update", 0.0) > 0]
    in_step = [r for r in rows if r.get("actor/zero_signal_update", 0.0) == 0]
    out["probe_s"] = statistics.fmean(r["timing/mismatch_s"] for r in in_step) if in_step else None
    out["train_s"] = statistics.fmean(r["timing/train_s"] for r in in_step) if in_step else None
    out["forward_s"] = statistics.fmean(r["timing/mismatch_s"] for r in forward) if forward else None
    out["forward_steps"] = len(forward)
    return out


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def table(results: dict[tuple[str, str], dict]) -> str:
    """The markdown table of docs/when-stuck.md: per case the mean over the steps (the largest step
    value in brackets) of each mismatch metric, and the probe's cost: seconds per trained step
    against the update's, and seconds of its own forward pass on the zero-signal steps (how many)."""
    lines = [
        "| engine | dtype | mean abs dlogprob (max) | KL behave->trainer (max) | ratio outside [1/2, 2] (max) "
        "| probe s / update s | own forward s (steps) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (engine, dtype), r in results.items():
        if "skipped" in r:
            lines.append(f"| {engine} | {dtype} | skipped: {r['skipped']} | | | | |")
            continue
        cells = [f"{r[k][0]:.2e} ({r[k][1]:.2e})" for k in KEYS]
        cost = f"{_seconds(r['probe_s'])} / {_seconds(r['train_s'])}"
        forward = f"{_seconds(r['forward_s'])} ({r['forward_steps']})"
        lines.append(f"| {engine} | {dtype} | {' | '.join(cells)} | {cost} | {forward} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm", "sglang"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--smoke", action="store_true", help="tiny model, hf float32, 1 step")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.smoke:
            from core_rl.testing.tiny import build_tiny_model

            model, chat = build_tiny_model(root / "model", alphabet="0123456789+? =", seed=0), False
            args.engines, args.dtypes, args.steps, args.prompts, args.n, args.max_new_tokens = (
                ["hf"],
                ["float32"],
                1,
                2,
                2,
                4,
            )
        else:
            from core_rl.testing.real_model import smollm2

            model, chat = smollm2(), True
        results = {}
        for engine in args.engines:
            for dtype in args.dtypes:
                results[(engine, dtype)] = run_case(root, model, engine, dtype, args, chat=chat)
                print(f"{engine} {dtype}: {results[(engine, dtype)]}", file=sys.stderr, flush=True)
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
