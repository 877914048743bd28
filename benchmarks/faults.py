"""Reliability report: inject faults into real ``core-rl train`` processes on a tiny model and count
what survives.

    python -m benchmarks.faults                   # every scenario (a few minutes on 2 cores)
    python -m benchmarks.faults --quick           # one signal and one reward fault (the smoke test)
    python -m benchmarks.faults --only sigkill,sigterm --repeat 5 --seed 7

Every scenario runs real processes (``core-rl train``, or ``python -m core_rl.testing.faults
train`` where it needs the misbehaving components of :mod:`core_rl.testing.faults`) and compares
with an uninterrupted reference run of the same configuration:

- ``sigkill`` / ``sigterm`` / ``sigint``: the signal at a random moment of training, then a resume;
  ``sigterm``/``sigint`` must exit with status 3 after saving;
- ``crash``: a component raises once; ``recover.mode=auto`` restarts the run in the process;
- ``latest``: the ``latest`` pointer names a missing checkpoint, holds garbage, or names a
  checkpoint whose weights are truncated; resume must fall back to the newest valid one;
- ``reward``: the reward raises, hangs, returns NaN, inf, strings or None on some items (the run
  must go on), or a wrong number of scores (the run must stop with a clear message);
- ``nonfinite``: the loss is NaN at one step (the step must be skipped, nothing else lost);
- ``disk_full``: a checkpoint save fills a small tmpfs (needs ``unshare``); the run must stop
  naming the newest valid checkpoint, which must resume to the reference;
- ``sigstop``: one of 2 ranks is stopped; the other must fail within ``collective_timeout_s``;
- ``rank_kill``: one of 2 ranks is SIGKILLed; the launcher must restart both and resume.

"survived": the run went on, or resumed to the end; "stopped cleanly": the run could not go on
and stopped with one clear message, nothing hanging or half-written. "bitwise" compares the logged
metrics (without clock times) and the final weights and optimizer state (SHA-256 of the checkpoint
files) with the reference. "steps lost": steps missing from, or logged twice in, the final metrics.
"steps redone": steps trained again after a resume (the work since the last checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml
from core_rl.testing.faults import (
    build_task,
    checkpoint,
    finish,
    merged,
    run_dir,
    same_run,
    stable_metrics,
    wait_for_random_moment,
    wait_for_steps,
    worker_of_rank,
)

STEPS = 12


@attrs.define
class Outcome:
    """One row of the report."""

    scenario: str
    injected: int = 0
    survived: int = 0
    detected: int = 0
    steps_lost: int = 0
    steps_redone: int = 0
    resumes: int = 0
    bitwise: int = 0
    notes: list[str] = attrs.field(factory=list)
    seconds: float = 0.0


class Bench:
    """Runs the scenarios under ``root``; ``rng`` picks the random moments."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        self.root = root
        self.rng = rng
        self.base = merged(build_task(root), trainer={"total_steps": STEPS}, saver={"every_n_steps": 4, "keep_last": 2})
        self.counter = 0
        self._references: dict[str, Path] = {}

    # -- running ----------------------------------------------------------------------------

    def config(self, name: str, **sections: Any) -> dict[str, Any]:
        self.counter += 1
        return merged(self.base, experiment={"name": f"{self.counter:03d}-{name}"}, **sections)

    def command(self, config: Mapping[str, Any], *extra: str, faults: bool = False, nproc: int = 0) -> list[str]:
        path = self.root / f"{config['experiment']['name']}.yaml"
        path.write_text(yaml.safe_dump(dict(config)))
        module = "core_rl.testing.faults" if faults else "core_rl.cli"
        launch = ["--nproc-per-node", str(nproc)] if nproc else []
        return [sys.executable, "-m", module, "train", *launch, str(path), *extra]

    @staticmethod
    def env(**extra: str) -> dict[str, str]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)
        return env

    def run(self, config, *extra: str, faults: bool = False, nproc: int = 0, timeout: float = 600, **env):
        return subprocess.run(
            self.command(config, *extra, faults=faults, nproc=nproc),
            capture_output=True,
            text=True,
            env=self.env(**env),
            timeout=timeout,
        )

    def start(self, config, *extra: str, faults: bool = False, nproc: int = 0, **env) -> subprocess.Popen:
        return subprocess.Popen(
            self.command(config, *extra, faults=faults, nproc=nproc),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(**env),
            start_new_session=True,
        )

    def reference(self, key: str, config: dict[str, Any], nproc: int = 0) -> Path:
        """An uninterrupted run of ``config`` (once per key)."""
        if key not in self._references:
            proc = self.run(config, nproc=nproc)
            if proc.returncode != 0:
                raise RuntimeError(f"reference run {key} failed:\n{proc.stderr[-3000:]}")
            self._references[key] = run_dir(config)
        return self._references[key]

    def resume_and_compare(self, out: Outcome, config: dict, reference: Path, *, before: set[int], nproc: int = 0):
        """Resume ``config``; count it as survived if it completes, bitwise if it equals ``reference``."""
        proc = self.run(merged(config, recover={"mode": "auto"}), nproc=nproc)
        out.resumes += 1
        if proc.returncode != 0:
            out.notes.append(f"resume failed: {proc.stderr.strip().splitlines()[-1:]}")
            return
        self.account(out, run_dir(config), reference, before=before, stderr=proc.stderr)

    @staticmethod
    def account(out: Outcome, run: Path, reference: Path, *, before: set[int], stderr: str) -> None:
        """A run that completed: its lost and redone steps, and whether it equals ``reference``.
        ``before``: the steps trained before the fault; the resume point is read from ``stderr``."""
        out.survived += 1
        try:
            steps = set(stable_metrics(run))
        except AssertionError as exc:
            out.notes.append(str(exc))
            out.steps_lost += STEPS
            return
        out.steps_lost += STEPS - len(steps & set(range(1, STEPS + 1)))
        resumed = re.findall(r"resumed from \S+ \(step (\d+)\)", stderr)
        resumed_from = int(resumed[-1]) if resumed else 0
        out.steps_redone += len([s for s in before if s > resumed_from])
        out.bitwise += same_run(run, reference, STEPS)

    # -- scenarios ----------------------------------------------------------------------------

    def signals(self, sig: signal.Signals, repeat: int) -> Outcome:
        out = Outcome(f"{sig.name} at a random moment, then resume")
        reference = self.reference("plain", self.config("reference"))
        for _ in range(repeat):
            config = self.config(sig.name.lower())
            proc = self.start(config)
            run = run_dir(config)
            moment = wait_for_random_moment(run, proc, self.rng, STEPS)
            if moment is None:
                out.notes.append(f"ended before the signal: {finish(proc, 60).strip().splitlines()[-1:]}")
                continue
            os.kill(proc.pid, sig)
            err = finish(proc, 300)
            out.injected += 1
            before = set(stable_metrics(run)) if (run / "metrics.jsonl").exists() else set()
            if sig != signal.SIGKILL and (proc.returncode != 3 or "Traceback" in err):
                out.notes.append(f"exit {proc.returncode} after {sig.name} {moment}: {err.strip().splitlines()[-1:]}")
                continue
            self.resume_and_compare(out, config, reference, before=before)
        return out

    def crash(self) -> Outcome:
        out = Outcome("a component crashes once, restarted in the process")
        reference = self.reference("plain", self.config("reference"))
        marker = self.root / f"crashed-{self.counter}"
        config = self.config(
            "crash",
            loggers=[{"name": "crash_once", "step": 6, "marker": str(marker)}],
            recover={"mode": "auto", "retries": 1},
        )
        proc = self.run(config, faults=True)
        out.injected += int(marker.exists())
        out.resumes += int(marker.exists())
        if proc.returncode == 0:
            self.account(out, run_dir(config), reference, before=set(range(1, 7)), stderr=proc.stderr)
        else:
            out.notes.append(proc.stderr.strip().splitlines()[-1])
        return out

    def latest(self) -> Outcome:
        out = Outcome("broken `latest` (missing, garbage, truncated weights)")
        reference = self.reference("plain", self.config("reference"))
        for damage in ("missing", "garbage", "truncated"):
            config = self.config(f"latest-{damage}")
            run = run_dir(config)
            shutil.copytree(reference, run)
            for step in range(9, STEPS + 1):
                shutil.rmtree(checkpoint(run, step), ignore_errors=True)
            latest = run / "checkpoints" / "latest"
            if damage == "missing":
                latest.write_text("step_00000099")
            elif damage == "garbage":
                latest.write_text("../../x")
            else:
                latest.write_text("step_00000008")
                weights = checkpoint(run, 8) / "model.safetensors"
                weights.write_bytes(weights.read_bytes()[:64])
            out.injected += 1
            self.resume_and_compare(out, config, reference, before=set(range(1, STEPS + 1)))
        return out

    def reward(self) -> Outcome:
        out = Outcome("reward raises / hangs / NaN / inf / string / None; wrong count")
        config = self.config(
            "reward-mixed",
            trainer={"total_steps": 3},
            saver={"every_n_steps": 0},
            reward={"name": "misbehave", "mode": "mixed", "every": 2},
            reward_runner={"items_per_call": 2, "timeout_s": 1.0, "max_error_fraction": 1.0},
        )
        proc = self.run(config, faults=True)
        if proc.returncode != 0:
            out.notes.append(f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        else:
            rows = stable_metrics(run_dir(config))
            failed = int(sum(r["reward/errors"] for r in rows.values()))
            kinds = sorted({k.split("_", 1)[1] for r in rows.values() for k in r if k.startswith("reward/errors_")})
            out.injected += failed
            out.survived += failed
            out.steps_lost += 3 - len(rows)
            out.notes.append(f"{failed} items failed ({', '.join(k for k in kinds if k != 'total')}), scored 0")
        config = self.config("reward-wrong_count", reward={"name": "misbehave", "mode": "wrong_count"})
        proc = self.run(config, faults=True)
        out.injected += 1
        if proc.returncode == 1 and "Reward.score must return one score per item" in proc.stderr:
            out.detected += 1
            out.notes.append("wrong count: stopped with a clear message")
        else:
            out.notes.append(f"wrong count: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        return out

    def nonfinite(self) -> Outcome:
        out = Outcome("NaN loss at one step (skipped)")
        config = self.config(
            "nonfinite",
            algorithm={"name": "grpo", "loss": {"name": "nan_pg", "nan_steps": [3]}},
            trainer={"total_steps": 6},
        )
        proc = self.run(config, faults=True)
        out.injected += 1
        if proc.returncode != 0:
            out.notes.append(proc.stderr.strip().splitlines()[-1])
            return out
        rows = stable_metrics(run_dir(config))
        out.survived += int(rows[3]["actor/nonfinite"] == 1.0 and rows[6]["actor/nonfinite_total"] == 1.0)
        out.steps_lost += 6 - len(rows)
        out.notes.append("1 update skipped, its batch saved")
        return out

    def disk_full(self) -> Outcome:
        out = Outcome("disk full during a checkpoint (2.6 MB tmpfs)")
        if shutil.which("unshare") is None:
            out.notes.append("skipped: no unshare")
            return out
        reference = self.reference("plain", self.config("reference"))
        mount = self.root / f"tmpfs-{self.counter}"
        mount.mkdir()
        config = self.config("disk-full")
        config["experiment"]["output_dir"] = str(mount)
        copy_to = Path(self.base["experiment"]["output_dir"]) / config["experiment"]["name"]
        script = (
            'mount -t tmpfs -o size=2600k tmpfs "$1" || exit 97; shift; "$@"; rc=$?; cp -r "$RUN" "$COPY"; exit $rc'
        )
        unshare = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", str(mount)]
        proc = subprocess.run(
            [*unshare, *self.command(config)],
            capture_output=True,
            text=True,
            env=self.env(RUN=str(mount / config["experiment"]["name"]), COPY=str(copy_to)),
            timeout=600,
        )
        if proc.returncode == 97:
            out.notes.append("skipped: cannot mount a tmpfs here")
            return out
        out.injected += 1
        clean = not [p for p in (copy_to / "checkpoints").iterdir() if p.name.startswith(".")]
        if proc.returncode == 1 and "no space left on device" in proc.stderr and clean:
            out.detected += 1
            out.notes.append("stopped naming the newest valid checkpoint, no partial files; then resumed with space")
            config["experiment"]["output_dir"] = self.base["experiment"]["output_dir"]
            self.resume_and_compare(out, config, reference, before=set(stable_metrics(copy_to)))
        else:
            out.notes.append(f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        return out

    def sigstop(self) -> Outcome:
        out = Outcome("one of 2 ranks SIGSTOPped (collective_timeout_s=15)")
        config = self.config("sigstop", trainer={"collective_timeout_s": 15})
        proc = self.start(config, nproc=2)
        lines: list[tuple[float, str]] = []
        reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in proc.stderr))
        reader.start()
        pid = worker_of_rank(proc.pid, 1) if wait_for_steps(run_dir(config), proc) else None
        if pid is None:
            finish(proc, 60)
            out.notes.append("did not start")
            return out
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            proc.wait(300)
        finally:
            ended = time.monotonic() - stopped_at
            reader.join(10)
            finish(proc, 1)
        out.injected += 1
        reported = [t - stopped_at for t, line in lines if "waited more than 15 s for the other ranks" in line]
        if proc.returncode == 1 and reported:
            out.detected += 1
            out.notes.append(
                f"rank 0 failed {reported[0]:.0f} s after the stop, naming what it waited for; the launcher "
                f"ended {ended:.0f} s after the stop (torch's agent gives the stopped worker 30 s before SIGKILL)"
            )
        else:
            out.notes.append(f"exit {proc.returncode} after {ended:.0f} s")
        return out

    def rank_kill(self) -> Outcome:
        out = Outcome("one of 2 ranks SIGKILLed, launcher restarts")
        reference = self.reference("two-ranks", self.config("reference-2"), nproc=2)
        config = self.config("rank-kill", recover={"mode": "auto", "retries": 2})
        proc = self.start(config, nproc=2)
        run = run_dir(config)
        moment = wait_for_random_moment(run, proc, self.rng, STEPS)
        pid = worker_of_rank(proc.pid, 1)
        if moment is None or pid is None:
            out.notes.append(f"ended before the kill: {finish(proc, 60).strip().splitlines()[-1:]}")
            return out
        before = set(stable_metrics(run))
        os.kill(pid, signal.SIGKILL)
        out.injected += 1
        err = finish(proc, 600)
        out.resumes += 1
        if proc.returncode == 0:
            self.account(out, run, reference, before=before, stderr=err)
        else:
            out.notes.append(f"exit {proc.returncode}: {err.strip().splitlines()[-1:]}")
        return out


SCENARIOS: dict[str, Callable[[Bench, int], Outcome]] = {
    "sigkill": lambda b, n: b.signals(signal.SIGKILL, n),
    "sigterm": lambda b, n: b.signals(signal.SIGTERM, n),
    "sigint": lambda b, n: b.signals(signal.SIGINT, n),
    "crash": lambda b, n: b.crash(),
    "latest": lambda b, n: b.latest(),
    "reward": lambda b, n: b.reward(),
    "nonfinite": lambda b, n: b.nonfinite(),
    "disk_full": lambda b, n: b.disk_full(),
    "sigstop": lambda b, n: b.sigstop(),
    "rank_kill": lambda b, n: b.rank_kill(),
}
QUICK = ("sigterm", "reward")


COLUMNS = ("injected", "survived", "detected", "steps_lost", "steps_redone")


def render(outcomes: list[Outcome]) -> str:
    """The report as a Markdown table with a total row."""
    lines = [
        "| scenario | injected | survived | stopped cleanly | steps lost | steps redone | resumes bitwise equal "
        "| notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for o in outcomes:
        bitwise = f"{o.bitwise}/{o.resumes}" if o.resumes else "-"
        values = " | ".join(str(getattr(o, c)) for c in COLUMNS)
        lines.append(f"| {o.scenario} | {values} | {bitwise} | {'; '.join(o.notes)} |")
    totals = " | ".join(str(sum(getattr(o, c) for o in outcomes)) for c in COLUMNS)
    bitwise = f"{sum(o.bitwise for o in outcomes)}/{sum(o.resumes for o in outcomes)}"
    lines.append(f"| **total** | {totals} | {bitwise} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, once")
    parser.add_argument("--only", default="", help=f"comma-separated scenarios of: {', '.join(SCENARIOS)}")
    parser.add_argument("--repeat", type=int, default=3, help="random moments per signal scenario (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random moments (default 0)")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the outcomes to this JSON file")
    args = parser.parse_args(argv)
    names = list(QUICK) if args.quick else [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    repeat = 1 if args.quick else args.repeat
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="core-rl-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    bench = Bench(root, random.Random(args.seed))
    outcomes = []
    started = time.monotonic()
    for name in names:
        t0 = time.monotonic()
        outcome = SCENARIOS[name](bench, repeat)
        outcome.seconds = time.monotonic() - t0
        outcomes.append(outcome)
        print(f"{name}: {outcome.injected} injected, {outcome.survived} survived ({outcome.seconds:.0f} s)", flush=True)
    print()
    print(render(outcomes))
    print(f"\n{time.monotonic() - started:.0f} s in all; runs under {root}")
    if args.json:
        Path(args.json).write_text(json.dumps([attrs.asdict(o) for o in outcomes], indent=2))
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
