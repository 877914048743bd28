"""Synchronous GRPO step time and memory, core-rl against TRL's ``GRPOTrainer``, on the same workloads.

    python benchmarks/trl_grpo.py [--workloads small,medium,large] [--steps 4] [--rounds 2]
                                  [--precision bf16|fp32|defaults] [--activation-checkpointing on|off]
                                  [--threads 1] [--no-trl] [--no-install] [--workdir DIR]
                                  [--core-python OTHER_CHECKOUT/.venv/bin/python]

Each workload is one causal LM, one prompt set, and one sampling setting: ``small``, ``medium`` and
``large`` a random-weight tiny LM (``core_rl.testing.tiny``: Qwen2 layout, character tokenizer over
``abcdefgh=``, built offline) on reversal prompts; ``real`` the real pretrained SmolLM2-135M-Instruct
(``core_rl.testing.real_model``: a 49,152-token BPE vocabulary, tied embeddings) on two-digit addition
questions in its ChatML chat template (core-rl's ``data.apply_chat_template``, TRL's conversational
prompts: the same token ids); both frameworks train it with
GRPO for ``--steps`` steps: the same prompts per step, ``samples`` completions per prompt of exactly
``tokens`` tokens (temperature 1, no top-k/top-p; ``min_new_tokens = max_new_tokens`` so both
generate the same number of tokens whatever a random model samples), token-mean clipped loss
(eps 0.2), no KL term and no reference model, AdamW (lr 1e-5, grad clip 1.0), one optimizer step
per generation batch, no checkpoints, ``--threads`` torch threads. Activation checkpointing is
each framework's default unless ``--activation-checkpointing on|off`` sets it for both (TRL's GRPO
turns it on by default: less memory, a second forward in the backward pass; core-rl's is off).
``--precision`` sets the training forward's precision for both: ``bf16`` (default) is bfloat16
autocast with float32 weights, gradients and optimizer state, TRL's default (its ``bf16=True``:
accelerate's CPU autocast) and core-rl's ``actor.engine.autocast_dtype: bfloat16``; ``fp32`` turns
it off on both sides (TRL ``bf16=False``; core-rl's default); ``defaults`` leaves each framework's
own (TRL bf16 autocast, core-rl float32). Weights are float32 everywhere. Generation runs at the
same precision as training on both sides: TRL generates under its autocast (accelerate wraps the
model's forward), core-rl's ``hf`` engine with ``rollout.engine.autocast_dtype: bfloat16`` under
``bf16`` (its projections in bfloat16, attention in float32, as its training forward).

Every run is a fresh process (so peak resident memory is that run's own). Runs alternate
core-rl / TRL (ABAB..., the order flipping every round) so that load from other jobs on the machine
falls on both alike; the ratio of medians is the comparable figure when absolute times are noisy.

Per step: the median step time over all steps after each run's first (the first pays one-off
costs: allocator warm-up, lazy imports, and with ``--compile`` core-rl's compilation; the ``first``
column shows it), and the split of that time into generation, log-prob recomputation, training
(forward/backward/optimizer), weight sync and other (rewards, batching). ``--compile`` sets
core-rl's ``actor.engine.compile`` and ``rollout.engine.compile`` (the training forward and the
``hf`` engine's decoding step); TRL keeps its defaults (eager).

TRL is a benchmark dependency only: it is installed (with the local CPU torch) into its own
environment under ``$CORE_RL_HOME/server-envs/bench-trl-cpu-<hash>`` the first time the script
runs (``--no-install`` skips TRL instead when that environment does not exist yet).

This file runs under both interpreters: the parent and the core-rl worker in core-rl's
environment, the TRL worker in TRL's (it imports only the standard library at module level).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TRL_VERSION = "1.16.0"
TORCH_PIN = "torch==2.13.0"
LETTERS = "abcdefgh"
PHASES = ("generate", "logprobs", "train", "weight_sync", "other")
#: process CPU seconds per step: all of it, generation with rewards and batching, the rest (update, sync)
CPU_PHASES = ("cpu_step", "cpu_rollout", "cpu_update")


@dataclass(frozen=True)
class Workload:
    """One benchmark row: model size and per-step rollout shape."""

    name: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    prompts: int  # prompts per step
    samples: int  # completions per prompt
    tokens: int  # tokens per completion
    real: bool = False  # the real pretrained model and chat prompts (the tiny-model fields unused)


WORKLOADS = {
    "small": Workload("small", hidden=128, layers=2, heads=4, intermediate=272, prompts=2, samples=8, tokens=8),
    "medium": Workload("medium", hidden=256, layers=4, heads=4, intermediate=704, prompts=8, samples=8, tokens=64),
    "large": Workload("large", hidden=384, layers=6, heads=6, intermediate=1024, prompts=2, samples=8, tokens=256),
    # a new user's first run: 8 prompts x 4 samples x 32 tokens of a 135M instruct model
    "real": Workload("real", hidden=0, layers=0, heads=0, intermediate=0, prompts=8, samples=4, tokens=32, real=True),
}

LR, GRAD_CLIP, EPS_CLIP, SEED = 1e-5, 1.0, 0.2, 0


# ---------------------------------------------------------------------------------------------- data


def prompt_rows(count: int, seed: int = SEED) -> list[dict[str, str]]:
    """``count`` rows ``{"prompt": "abcd=", "answer": "dcba"}`` (strings of 3-4 of ``LETTERS``)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 4)))
        rows.append({"prompt": word + "=", "answer": word[::-1]})
    return rows


def char_match(response: str, answer: str) -> float:
    """The TRL side's reward: the ``char_match`` reward plugin's score (which the core-rl side uses),
    ``sum_i [r[i] == a[i]] / max(len(a), len(r))`` on the stripped strings (1.0 if both are empty);
    the smoke test checks the two agree."""
    response, answer = response.strip(), answer.strip()
    width = max(len(answer), len(response))
    return sum(r == a for r, a in zip(response, answer)) / width if width else 1.0


def addition_rows(count: int, seed: int = SEED) -> list[dict[str, str]]:
    """``count`` rows ``{"prompt": "What is 47 + 38?", "answer": "85"}`` (the real workload's)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def prepare(work: Path, workload: Workload, steps: int) -> tuple[Path, Path]:
    """Write the workload's model directory (the real one: cached once per machine) and prompts
    (JSONL) under ``work``; return both paths."""
    from core_rl.testing.tiny import build_tiny_model

    if workload.real:
        from core_rl.testing.real_model import smollm2

        work.mkdir(parents=True, exist_ok=True)
        data = work / "prompts.jsonl"
        rows = addition_rows(workload.prompts * steps)
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return smollm2(), data
    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        build_tiny_model(
            model_dir,
            alphabet=LETTERS + "=",
            hidden_size=workload.hidden,
            num_layers=workload.layers,
            num_heads=workload.heads,
            intermediate_size=workload.intermediate,
            max_position_embeddings=workload.tokens + 16,
            seed=SEED,
            architecture="qwen2",
        )
    data = work / "prompts.jsonl"
    rows = prompt_rows(workload.prompts * steps)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return model_dir, data


def param_count(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------------------------------ workers


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_device_mib() -> float | None:
    """The most CUDA memory this process's tensors held at once, or ``None`` without CUDA."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def core_rl_worker(spec: dict) -> dict:
    """Train with core-rl (``fsdp`` + embedded ``hf``) through ``core-rl train``; per-step timings
    from the run's ``metrics.jsonl``."""
    import yaml
    from core_rl import cli

    work = Path(spec["work"])
    wl = Workload(**spec["workload"])
    run = work / "core-rl-run"
    shutil.rmtree(run, ignore_errors=True)  # every run starts fresh
    config = {
        "experiment": {"name": "bench", "output_dir": str(run), "seed": SEED},
        "data": {
            "train_files": [spec["data"]],
            "prompt_key": "prompt",
            "batch_size": wl.prompts,
            "shuffle": False,
            "apply_chat_template": wl.real,
        },
        "actor": {
            "model_path": spec["model"],
            "engine": {
                "name": "fsdp",
                **({"autocast_dtype": "bfloat16"} if spec.get("precision") == "bf16" else {}),
                **({"compile": True} if spec.get("compile") else {}),
                **spec.get("actor_engine", {}),
            },
            "optimizer": {"name": "adamw", "lr": LR},
            "lr_scheduler": {"name": "constant"},
            "grad_clip": GRAD_CLIP,
            "gradient_checkpointing": spec.get("activation_checkpointing") == "on",
        },
        "rollout": {
            "engine": {
                "name": "hf",
                **({"autocast_dtype": "bfloat16"} if spec.get("precision") == "bf16" else {}),
                **({"compile": True} if spec.get("compile") else {}),
                **spec.get("rollout_engine", {}),
            },
            "sampling": {"n": wl.samples, "temperature": 1.0, "max_new_tokens": wl.tokens, "min_new_tokens": wl.tokens},
        },
        "algorithm": {"name": "grpo", "loss": {"name": "ppo_clip", "eps_clip": EPS_CLIP, "aggregation": "token-mean"}},
        "reward": {"name": "char_match", "answer_key": "answer"},
        "trainer": {"total_steps": spec["steps"], "torch_threads": spec["threads"]},
        "saver": {"every_n_steps": 0, "at_end": False, "export_hf": False},
        "loggers": [],
        **spec.get("overrides", {}),
    }
    path = work / "core-rl.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    cpu = _clock_core_rl_steps()
    code = cli.main(["train", str(path), *spec.get("cli_overrides", [])])
    if code != 0:
        raise SystemExit(f"core-rl train exited {code}")
    rows = [json.loads(line) for line in (run / "bench" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = []
    for r in (r for r in rows if "timing/step_s" in r):
        step = {
            "step": r["timing/step_s"],
            "generate": r.get("timing/generate_s", 0.0),
            "logprobs": r.get("timing/logprobs_s", 0.0),
            "weight_sync": r.get("timing/weight_sync_s", 0.0),
        }
        step["train"] = r.get("timing/train_s", 0.0) - step["logprobs"]
        step["other"] = step["step"] - sum(step[p] for p in ("generate", "logprobs", "train", "weight_sync"))
        steps.append(step)
    for step, (cpu_step, cpu_rollout) in zip(steps, cpu):
        step.update(cpu_step=cpu_step, cpu_rollout=cpu_rollout, cpu_update=cpu_step - cpu_rollout)
    return {"steps": steps, "peak_rss_mib": peak_rss_mib(), "peak_device_mib": peak_device_mib()}


def _clock_core_rl_steps() -> list[tuple[float, float]]:
    """Patch the synchronous trainer so each step appends ``(CPU s of the step, CPU s of its rollout
    and scoring)`` to the returned list (process CPU time: with one thread, what the step computed,
    whatever else loads the machine)."""
    from core_rl.loops.rl.loop import SyncTrainer
    from core_rl.loops.rl.scoring import RolloutScoringStage

    clocks: list[tuple[float, float]] = []
    rollout = [0.0]
    step, rollout_and_score = SyncTrainer.step, RolloutScoringStage.rollout_and_score

    def timed_step(self, *a, **k):
        rollout[0] = 0.0
        start = time.process_time()
        try:
            return step(self, *a, **k)
        finally:
            clocks.append((time.process_time() - start, rollout[0]))

    def timed_rollout(self, *a, **k):
        start = time.process_time()
        try:
            return rollout_and_score(self, *a, **k)
        finally:
            rollout[0] += time.process_time() - start

    SyncTrainer.step, RolloutScoringStage.rollout_and_score = timed_step, timed_rollout
    return clocks


# ------------------------------------------------------------------------------------- environments


def trl_env_spec():
    """TRL's benchmark environment: the local CPU torch first (so nothing pulls a CUDA build), then TRL."""
    from core_rl.interfaces.servers import ServerEnvSpec

    steps = [["-m", "pip", "install", "-q", TORCH_PIN], ["-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"]]
    return ServerEnvSpec(
        name="bench-trl",
        steps={"cpu": steps, "cuda": steps},
        check="import trl, torch; print(trl.__version__, torch.__version__)",
        description=f"TRL {TRL_VERSION} for benchmarks/trl_grpo.py",
    )


def trl_python(install: bool) -> Path | None:
    """The TRL environment's interpreter: built on first use, or ``None`` if absent and not ``install``."""
    from core_rl_server_kit import env as server_env

    spec = trl_env_spec()
    found = server_env.find(spec, variant="cpu")
    if found is None and install:
        found = server_env.create(spec, variant="cpu", echo=print)
    return server_env.env_python(found) if found is not None else None


# -------------------------------------------------------------------------------------------- parent


_LAUNCHER_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "ROLE_RANK"}
)


def run_worker(python: str, kind: str, spec: dict, timeout: float) -> dict:
    """Run one worker process and return its JSON result."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        spec_file = f.name
    # Each worker is one process on its own: launcher variables left in this process (a torchrun
    # parent, or an engine that set LOCAL_RANK) would make accelerate wait for a process group.
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env.update(OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
    try:
        proc = subprocess.run(
            [python, __file__, "--worker", kind, "--spec", spec_file],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    finally:
        os.unlink(spec_file)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{kind} worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    marker = "BENCH-RESULT "
    line = next(li for li in reversed(proc.stdout.splitlines()) if li.startswith(marker))
    return json.loads(line[len(marker) :])


@dataclass
class Summary:
    """Medians over the steps after each run's first, and the largest peak RSS of the runs."""

    step: float
    first_step: float  # median over runs of the first step (one-off costs: warm-up, compilation)
    split: dict[str, float]
    peak_rss_mib: float
    runs: int


def summarise(results: list[dict]) -> Summary:
    steps = [s for r in results for s in r["steps"][1:]] or [s for r in results for s in r["steps"]]
    return Summary(
        step=statistics.median(s["step"] for s in steps),
        first_step=statistics.median(r["steps"][0]["step"] for r in results if r["steps"]),
        split={p: statistics.median(s[p] for s in steps) for p in PHASES + CPU_PHASES if all(p in s for s in steps)},
        peak_rss_mib=max(r["peak_rss_mib"] for r in results),
        runs=len(results),
    )


def add_run_options(parser: argparse.ArgumentParser, *, steps: int, threads: int) -> None:
    """The options of both GRPO benchmarks (this one and ``gpu_grpo.py``) about their runs."""
    parser.add_argument("--steps", type=int, default=steps, help="steps per run (the first is not counted)")
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds per workload (one run of each per round)")
    parser.add_argument("--threads", type=int, default=threads, help="torch intra-op threads in every run")
    parser.add_argument(
        "--core-rl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the core-rl runs (as on `core-rl train`'s command line); repeatable",
    )
    parser.add_argument("--no-trl", action="store_true", help="run core-rl only")
    parser.add_argument("--no-install", action="store_true", help="skip TRL if its environment is not built yet")
    parser.add_argument("--workdir", default=None, help="where models, prompts and runs go (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="small,medium,large", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    add_run_options(parser, steps=4, threads=1)
    parser.add_argument(
        "--activation-checkpointing",
        choices=("defaults", "on", "off"),
        default="defaults",
        help="defaults: each framework's own (TRL's GRPO: on, core-rl: off); on/off: the same for both",
    )
    parser.add_argument(
        "--precision",
        choices=("bf16", "fp32", "defaults"),
        default="bf16",
        help="training forward precision for both: bf16 autocast (TRL's default), fp32, or each framework's own",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="core-rl trains and decodes with torch.compile (actor.engine.compile, rollout.engine.compile; "
        "its first step pays the compilation)",
    )
    parser.add_argument(
        "--core-python",
        default=sys.executable,
        help="interpreter of the core-rl side (default: this one; another checkout's venv compares versions)",
    )
    parser.add_argument("--worker", choices=("core-rl", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        if args.worker == "core-rl":
            result = core_rl_worker(spec)
        else:
            from trl_worker import trl_worker  # this folder's TRL side, run in TRL's environment

            result = trl_worker(spec)
        print("BENCH-RESULT " + json.dumps(result), flush=True)
        return 0

    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    trl_py = None if args.no_trl else trl_python(install=not args.no_install)
    if trl_py is None and not args.no_trl:
        print("TRL environment not built (run without --no-install to build it): core-rl only")
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="core-rl-bench-"))
    print(
        f"GRPO step, {args.threads} torch thread(s), {args.steps} steps per run ({args.steps - 1} timed), "
        f"{args.rounds} alternating round(s) per workload; activation checkpointing: {args.activation_checkpointing}; "
        f"precision: {args.precision}; core-rl torch.compile: {'on' if args.compile else 'off'}; "
        f"work dir {root}",
        flush=True,
    )
    table = []
    for name in names:
        wl = WORKLOADS[name]
        work = root / name
        work.mkdir(parents=True, exist_ok=True)
        model_dir, data = prepare(work, wl, args.steps)
        spec = {
            "work": str(work),
            "model": str(model_dir),
            "data": str(data),
            "workload": asdict(wl),
            "steps": args.steps,
            "threads": args.threads,
            "activation_checkpointing": args.activation_checkpointing,
            "precision": args.precision,
            "compile": args.compile,
            "cli_overrides": args.core_rl_set,
        }
        sides = [("core-rl", args.core_python)] + ([("trl", str(trl_py))] if trl_py else [])
        results: dict[str, list[dict]] = {k: [] for k, _ in sides}
        for r in range(args.rounds):
            for kind, python in sides if r % 2 == 0 else sides[::-1]:
                start = time.perf_counter()
                results[kind].append(run_worker(python, kind, spec, args.timeout))
                print(f"  {name} round {r + 1} {kind}: {time.perf_counter() - start:.1f} s", flush=True)
        table.append((wl, param_count(model_dir), {k: summarise(v) for k, v in results.items()}))
        if len(names) > 1:
            print_table(table[-1:])  # this workload's rows now, in case a later one is interrupted
    print_table(table)
    return 0


def print_table(table: list[tuple[Workload, int, dict[str, Summary]]]) -> None:
    header = (
        f"{'workload':<30}{'framework':<10}{'s/step':>8}{'first':>8}{'generate':>10}{'logprobs':>10}{'train':>8}"
        f"{'sync':>7}{'other':>7}{'peak MiB':>10}{'vs TRL':>8}{'':<8}"
        f"{'cpu s':>7}{'rollout':>8}{'update':>8}{'vs TRL':>8}"
    )
    print()
    print(header)
    print("-" * len(header))
    for wl, params, sides in table:
        label = f"{wl.name} {params / 1e6:.2f}M {wl.prompts}x{wl.samples}x{wl.tokens}"
        trl = sides.get("trl")
        for kind, s in sides.items():
            ratio = f"{s.step / trl.step:.3f}x" if trl is not None else "-"
            mem = f" ({s.peak_rss_mib / trl.peak_rss_mib:.2f}x)" if trl is not None and kind != "trl" else ""
            print(
                f"{label:<30}{kind:<10}{s.step:>8.4f}{s.first_step:>8.3f}{s.split['generate']:>10.3f}{s.split['logprobs']:>10.3f}"
                f"{s.split['train']:>8.3f}{s.split['weight_sync']:>7.3f}{s.split['other']:>7.3f}"
                f"{s.peak_rss_mib:>10.0f}{ratio:>8}{mem:<8}{_cpu_columns(s, trl)}"
            )
            label = ""


def _cpu_columns(s: Summary, trl: Summary | None) -> str:
    """CPU seconds per step (all, rollout, update) and the CPU-time ratio to TRL, if measured."""
    if not all(p in s.split for p in CPU_PHASES):
        return ""
    ratio = "-"
    if trl is not None and "cpu_step" in trl.split:
        ratio = f"{s.split['cpu_step'] / trl.split['cpu_step']:.3f}x"
    return f"{s.split['cpu_step']:>7.3f}{s.split['cpu_rollout']:>8.3f}{s.split['cpu_update']:>8.3f}{ratio:>8}"


if __name__ == "__main__":
    sys.exit(main())
