"""Built-in loggers: ``console`` (a progress bar with the key metrics) and ``jsonl`` (one JSON object
per step in ``<run dir>/metrics.jsonl``; the trainer always adds it so every run leaves its metrics)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
from tqdm import tqdm

from core_rl.checkpoint.atomic import write_text_atomic
from core_rl.config.validators import MAX_STEPS, in_range, inside_directory
from core_rl.errors import CoreRLError
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Logger, RunInfo, SampleRecord

DEFAULT_CONSOLE_KEYS = [
    "reward/mean",
    "response_length/mean",
    "actor/loss",
    "actor/entropy",
    "actor/kl",
    "actor/clipped",
    "actor/grad_norm",
    "timing/step_s",
    "eval/reward/mean",
    "eval/pass@1",
]


@attrs.define
class ConsoleLoggerConfig:
    """``keys``: metrics shown (those present); ``every_n_steps``: how often a plain line is printed
    when the output is not a terminal (on a terminal the bar updates every step)."""

    keys: list[str] = attrs.field(factory=lambda: list(DEFAULT_CONSOLE_KEYS))
    every_n_steps: int = attrs.field(default=1, validator=in_range(1, MAX_STEPS))


def _short(name: str) -> str:
    return name.replace("/mean", "").replace("actor/", "").replace("timing/", "")


def format_metrics(metrics: Mapping[str, float], keys: list[str]) -> dict[str, str]:
    """The shown subset of ``metrics`` as short name -> compact string."""
    return {_short(k): f"{metrics[k]:.4g}" for k in keys if k in metrics}


class ConsoleLogger(Logger):
    """A tqdm progress bar over ``trainer.total_steps`` whose postfix holds the key metrics."""

    def __init__(self, config: ConsoleLoggerConfig, stream: IO[str] | None = None) -> None:
        self.config = config
        self.stream = stream if stream is not None else sys.stderr
        self._bar: tqdm | None = None
        self._total: int | None = None

    def start(self, run: RunInfo) -> None:
        total = run.config.get("trainer", {}).get("total_steps")
        self._total = int(total) if total else None
        if self.stream.isatty():
            self._bar = tqdm(total=self._total, desc=run.name, file=self.stream, dynamic_ncols=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        shown = format_metrics(metrics, self.config.keys)
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(shown, refresh=True)
        elif step % self.config.every_n_steps == 0 or step == self._total:
            total = f"/{self._total}" if self._total else ""
            fields = " ".join(f"{k}={v}" for k, v in shown.items())
            print(f"step {step}{total} {fields}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@attrs.define
class JsonlLoggerConfig:
    """``filename``: file name inside the run directory (it cannot point outside it);
    ``samples_filename``: where logged samples go, also inside the run directory (one JSON object per
    sample: ``step``, ``prompt``, ``response``, ``reward``, ``finish_reason``, ``reward/<part>``...)."""

    filename: str = attrs.field(default="metrics.jsonl", validator=inside_directory())
    samples_filename: str = attrs.field(default="samples.jsonl", validator=inside_directory())


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


class JsonlLogger(Logger):
    """Appends ``{"step": n, "time": unix_seconds, <metric>: value, ...}`` per step, flushed each line.

    The file is created at the first step logged, so a run that fails before its first step leaves
    no (empty) metrics file behind."""

    def __init__(self, config: JsonlLoggerConfig) -> None:
        self.config = config
        self.path: Path | None = None
        self.samples_path: Path | None = None
        self._file: IO[str] | None = None

    def start(self, run: RunInfo) -> None:
        """On a resumed run, drop the records of steps after the checkpoint (they run again)."""
        self.path = run.output_dir / self.config.filename
        self.samples_path = run.output_dir / self.config.samples_filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if run.resume_step is not None:
            truncate_jsonl(self.path, run.resume_step)
            truncate_jsonl(self.samples_path, run.resume_step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.path is None:
            raise RuntimeError("JsonlLogger.log called before start")
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        record = {"step": step, "time": time.time(), **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log_samples(self, samples: Sequence[SampleRecord], step: int) -> None:
        if self.samples_path is None:
            raise RuntimeError("JsonlLogger.log_samples called before start")
        lines = [
            json.dumps({"step": step, **{k: _json_value(v) for k, v in s.as_row().items()}}, default=str) + "\n"
            for s in samples
        ]
        self.samples_path.parent.mkdir(parents=True, exist_ok=True)
        with self.samples_path.open("a", encoding="utf-8") as f:
            f.writelines(lines)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Keep only the records of ``path`` whose ``step`` is at most ``last_step`` (and drop lines that
    do not parse, such as one cut short by a killed process), rewriting the file atomically.
    Returns how many lines were dropped; a missing file is left missing."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and int(record["step"]) <= last_step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line + "\n")
        elif line.strip():
            dropped += 1
    if dropped:
        write_text_atomic(path, "".join(kept))
    return dropped


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics (or samples) file written by :class:`JsonlLogger`.

    A last line that does not parse is left out: a write cut short by a killed run (the kernel
    ends a file write early at a page boundary when SIGKILL arrives, so a line can be half there).
    Any other line that does not parse is a :class:`~core_rl.errors.CoreRLError` naming the file
    and line."""
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if i == last:
                break
            raise CoreRLError(f"{path}:{i + 1}: not a JSON record: {line[:120]!r}") from None
        records.append(record)
    return records


@hookimpl
def core_rl_register_loggers(register: Register) -> None:
    register(
        "console",
        ConsoleLogger,
        description="Progress bar (or plain lines) with the key metrics",
        config_cls=ConsoleLoggerConfig,
    )
    register(
        "jsonl",
        JsonlLogger,
        description="One JSON line of metrics per step in the run directory",
        config_cls=JsonlLoggerConfig,
    )
