"""Fault injection for tests and the reliability report (``benchmarks/faults.py``).

Components that misbehave on purpose, registered by :class:`FaultPlugin`:

- reward ``misbehave``: in each call, items whose index in the call is a multiple of ``every`` get
  ``mode``: ``raise`` (the call raises), ``hang`` (the call blocks until :data:`RELEASE` is set or
  the process ends), ``nan``, ``inf``, ``string`` (a numeric-looking string), ``none``,
  ``wrong_count`` (one score too few), ``slow`` (the call sleeps ``sleep_s``), or ``mixed``: call
  ``k`` misbehaves as ``SURVIVABLE[k % 6]``; other items score ``len(response) / 10``. With
  ``calls_file`` set, each call first appends a line to that file (tests wait on it to know a
  step's reward call is under way).
- policy loss ``nan_pg``: the plain policy-gradient surrogate
  ``-A_t * exp(logp_t - old_logp_t)`` (token-mean), NaN at the steps in ``nan_steps``
  (steps counted by its ``loss_weights`` calls, one per step on the main rank).
- logger ``crash_once``: at step ``step`` unless the file ``marker`` exists, which it creates
  first (so a restarted run passes that step), raises (``how: raise``) or kills its own process
  with SIGSEGV sent to the calling thread (``how: segfault``, as a crash in native code would).

Also the plugins that block on purpose of :mod:`core_rl.testing.blocking` (reward, environment,
workflow, sample filter and logger ``block``).

``python -m core_rl.testing.faults train CONFIG ...`` is ``core-rl`` with them installed. Also here:
a tiny task to run (:func:`build_task`) and bitwise comparisons of runs (:func:`stable_metrics`,
:func:`state_digest`).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from core_rl.builtin.loggers import read_metrics
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Logger, LossOutput, PolicyLoss, Reward
from core_rl.ops import aggregation_weights
from core_rl.testing import blocking
from core_rl.testing.processes import environment_of, process_tree

#: set it to release the calls of a ``hang`` reward (tests do, so their threads end)
RELEASE = threading.Event()

#: misbehaviours a run survives (each failed item gets ``reward_runner.on_error``)
SURVIVABLE = ("raise", "hang", "nan", "inf", "string", "none")
MODES = (*SURVIVABLE, "wrong_count", "slow", "mixed")

#: metrics that depend on the clock or the machine's memory, not on the computation
VOLATILE = ("time", "timing/", "throughput/", "memory/")


@attrs.define
class MisbehaveConfig:
    mode: str = attrs.field(default="raise", validator=attrs.validators.in_(MODES))
    every: int = 2
    sleep_s: float = 0.0
    calls_file: str = ""


class MisbehavingReward(Reward):
    """See the module docstring."""

    def __init__(self, config: MisbehaveConfig) -> None:
        self.config = config
        self._calls = itertools.count()

    def score(self, items):
        if self.config.calls_file:
            with open(self.config.calls_file, "a", encoding="utf-8") as calls:
                calls.write(f"{len(items)}\n")
        bad = [i % self.config.every == 0 for i in range(len(items))]
        mode = self.config.mode
        if mode == "mixed":
            mode = SURVIVABLE[next(self._calls) % len(SURVIVABLE)]
        if mode == "slow":
            time.sleep(self.config.sleep_s)
        if mode == "raise" and any(bad):
            raise ValueError("misbehave: this reward raises")
        if mode == "hang" and any(bad):
            RELEASE.wait()
        scores: list[object] = [len(item.response_text) / 10 for item in items]
        replacement = {"nan": float("nan"), "inf": float("inf"), "string": "0.5", "none": None}.get(mode)
        for i, is_bad in enumerate(bad):
            if is_bad and mode in ("nan", "inf", "string", "none"):
                scores[i] = replacement
        if mode == "wrong_count":
            scores = scores[:-1]
        return scores


@attrs.define
class NanLossConfig:
    nan_steps: list[int] = attrs.field(factory=list)


class NanLoss(PolicyLoss):
    """See the module docstring."""

    def __init__(self, config: NanLossConfig) -> None:
        self.nan_steps = set(config.nan_steps)
        self.step = 0

    def loss_weights(self, response_mask):
        self.step += 1
        return aggregation_weights(response_mask, "token-mean")

    def __call__(self, batch, logprobs, entropy) -> LossOutput:
        import torch

        ratio = torch.exp(logprobs - batch["old_logprobs"].to(logprobs.dtype))
        loss = -batch["advantages"].to(logprobs.dtype) * ratio * batch["response_mask"]
        if self.step in self.nan_steps:
            loss = loss * float("nan")
        return LossOutput(per_token_loss=loss)


@attrs.define
class CrashOnceConfig:
    step: int = 3
    marker: str = ""
    how: str = attrs.field(default="raise", validator=attrs.validators.in_(("raise", "segfault")))


class CrashOnceLogger(Logger):
    """See the module docstring."""

    def __init__(self, config: CrashOnceConfig) -> None:
        self.config = config

    def log(self, metrics, step: int) -> None:
        marker = Path(self.config.marker)
        if step == self.config.step and not marker.exists():
            marker.write_text("crashed\n")
            if self.config.how == "segfault":  # to this thread, as a fault in native code here would be
                signal.pthread_kill(threading.get_ident(), signal.SIGSEGV)
            raise RuntimeError(f"crash_once: logger crashed at step {step}")


class FaultPlugin:
    """Registers the misbehaving components (see the module docstring)."""

    @hookimpl
    def core_rl_register_rewards(self, register: Register) -> None:
        register("misbehave", MisbehavingReward, description="misbehaves on purpose", config_cls=MisbehaveConfig)
        register(
            "block", blocking.BlockingReward, description="blocks in one call", config_cls=blocking.BlockOnCallConfig
        )

    @hookimpl
    def core_rl_register_environments(self, register: Register) -> None:
        register(
            "block",
            blocking.BlockingEnvironment,
            description="its async step blocks the event loop",
            config_cls=blocking.BlockingEnvironmentConfig,
        )

    @hookimpl
    def core_rl_register_workflows(self, register: Register) -> None:
        register(
            "block",
            blocking.BlockingWorkflow,
            description="one of its runs blocks the event loop",
            config_cls=blocking.BlockOnCallConfig,
        )

    @hookimpl
    def core_rl_register_sample_filters(self, register: Register) -> None:
        register(
            "block", blocking.BlockingFilter, description="blocks in one call", config_cls=blocking.BlockOnCallConfig
        )

    @hookimpl
    def core_rl_register_policy_losses(self, register: Register) -> None:
        register("nan_pg", NanLoss, description="policy gradient, NaN at given steps", config_cls=NanLossConfig)

    @hookimpl
    def core_rl_register_loggers(self, register: Register) -> None:
        register("crash_once", CrashOnceLogger, description="crashes once", config_cls=CrashOnceConfig)
        register(
            "block", blocking.BlockingLogger, description="blocks at one step", config_cls=blocking.BlockAtStepConfig
        )


def install_into_every_host() -> None:
    """Make every :class:`~core_rl.plugins.host.PluginHost` created from now on hold :class:`FaultPlugin`."""
    from core_rl.plugins import host as plugins

    original = plugins.PluginHost.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self.register_plugin(FaultPlugin(), distribution="core-rl-testing-faults", version="0")

    plugins.PluginHost.__init__ = init  # type: ignore[method-assign]


# -- a tiny task and comparisons of runs ---------------------------------------------------------


def build_task(root: Path, *, prompts: Sequence[str] = ("ab", "ba", "abc", "dca", "bd", "cc")) -> dict[str, Any]:
    """A tiny model, a prompt file (answer: the prompt reversed) and a run configuration using the
    fsdp, hf, grpo and char_match plugins: 2 prompts x 4 samples per step, 4 steps, a checkpoint
    after every step, no final export, output under ``root/runs``."""
    from core_rl.testing.tiny import build_tiny_model

    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s[::-1]}) + "\n" for s in prompts))
    return {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 3},
        "data": {"train_files": [str(data)], "batch_size": 2},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-2}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 4, "max_new_tokens": 4}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "char_match"},
        "trainer": {"total_steps": 4, "torch_threads": 1},
        "saver": {"every_n_steps": 1, "keep_last": 10, "export_hf": False},
        "loggers": [],
    }


def checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def stable_metrics(run: Path) -> dict[int, dict[str, Any]]:
    """Step -> logged metrics without clock-dependent values. Raises ``AssertionError`` if a step
    was logged more than once."""
    from core_rl.builtin.loggers import read_metrics

    rows = read_metrics(run / "metrics.jsonl")
    steps = [r["step"] for r in rows]
    if len(steps) != len(set(steps)):
        raise AssertionError(f"steps logged more than once: {steps}")
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}


def state_digest(checkpoint_dir: Path) -> dict[str, str]:
    """SHA-256 of a checkpoint's weights and optimizer files: equal digests, bitwise equal state."""
    names = ("model.safetensors", "optimizer.safetensors", "optimizer.json")
    return {
        n: hashlib.sha256((checkpoint_dir / n).read_bytes()).hexdigest() for n in names if (checkpoint_dir / n).exists()
    }


def same_run(a: Path, b: Path, last_step: int) -> bool:
    """Whether runs ``a`` and ``b`` logged the same metrics and ended in bitwise the same state."""
    try:
        return stable_metrics(a) == stable_metrics(b) and state_digest(checkpoint(a, last_step)) == state_digest(
            checkpoint(b, last_step)
        )
    except (AssertionError, OSError):
        return False


# -- configurations and processes ----------------------------------------------------------------


def merged(base: Mapping[str, Any], **sections: Any) -> dict[str, Any]:
    """A copy of configuration ``base`` with each given section updated one level deep
    (``merged(cfg, trainer={"total_steps": 3})``); a non-mapping value replaces the section."""
    out = copy.deepcopy(dict(base))
    for key, value in sections.items():
        out[key] = {**out[key], **value} if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
    return out


def run_dir(config: Mapping[str, Any]) -> Path:
    return Path(config["experiment"]["output_dir"]) / config["experiment"]["name"]


def wait_for_steps(run: Path, proc: subprocess.Popen, steps: int = 1, timeout: float = 300) -> bool:
    """Wait until ``run`` has logged ``steps`` steps (True), or ``proc`` ended or ``timeout``
    seconds passed first (False)."""
    deadline = time.monotonic() + timeout
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and len(read_metrics(metrics)) >= steps:  # a half-written last line is not a step
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


def wait_for_file(path: Path, proc: subprocess.Popen, lines: int = 0, timeout: float = 120) -> bool:
    """Wait until the file ``path`` exists with at least ``lines`` lines (True), or ``proc`` ended or
    ``timeout`` seconds passed first (False): a marker a fault hook writes when it is reached."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


def wait_for_random_moment(run: Path, proc: subprocess.Popen, rng: random.Random, total_steps: int) -> str | None:
    """Wait for a random moment of training, judged by the run's own progress (so load on the
    machine does not push it past the end): after step ``k - 1`` is logged, for ``k`` drawn from
    ``[2, total_steps - 2]``, a random part of that step's duration so far. Returns where that is,
    or ``None`` if the run ended first."""
    step = rng.randint(2, total_steps - 2)
    if not wait_for_steps(run, proc, step - 1):
        return None
    last = read_metrics(run / "metrics.jsonl")[-1]  # the run may be writing its next line
    delay = rng.uniform(0.0, float(last.get("timing/step_s", 0.1)))
    time.sleep(delay)
    return f"during step {step}, {delay:.3f} s after step {step - 1} was logged"


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """Wait at most ``timeout`` s for ``proc`` (started with ``start_new_session=True``) and return
    its stderr; then end what is left of its process group, stopped processes included."""
    try:
        _, err = proc.communicate(timeout=timeout)
        return err or ""
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def worker_of_rank(launcher: int, rank: int) -> int | None:
    """The pid of the worker of ``rank`` that launcher process ``launcher`` started, if any."""
    for pid in process_tree(launcher)[1:]:
        try:
            environ = environment_of(pid)
        except OSError:
            continue
        if environ.get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in environ:
            return pid
    return None


if __name__ == "__main__":
    install_into_every_host()
    from core_rl.cli import main
    from core_rl.launch import local

    local.RANK_MODULE = "core_rl.testing.faults"  # ranks under --nproc-per-node hold the fault plugins too

    sys.exit(main())
