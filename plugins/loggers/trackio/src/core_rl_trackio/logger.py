"""The ``trackio`` logger: each step's metrics as a Trackio log row, logged samples as a
``trackio.Table`` (key ``samples``), in the project's local SQLite database.

Trackio keeps its databases in one directory per process, fixed when trackio is first imported:
``log_dir`` if set (exported as ``TRACKIO_DIR`` before that import), else ``TRACKIO_DIR`` or
Trackio's default (``~/.cache/huggingface/trackio``). ``space_id`` syncs to a Hugging Face Space
(network); without it nothing leaves the machine.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core_rl.errors import CoreRLError
from core_rl.interfaces import Logger, RunInfo, SampleRecord, sample_table

from core_rl_trackio.plugin import TrackioConfig


def _import_trackio(log_dir: str | None) -> Any:
    if log_dir is not None:
        wanted = Path(log_dir).resolve()
        if "trackio" in sys.modules:
            current = Path(sys.modules["trackio"].TRACKIO_DIR).resolve()
            if current != wanted:
                raise CoreRLError(
                    f"logger 'trackio': log_dir {wanted} differs from the directory trackio already uses in "
                    f"this process ({current}); use one log_dir per process, or set TRACKIO_DIR instead"
                )
        os.environ["TRACKIO_DIR"] = str(wanted)
    import trackio

    return trackio


class TrackioLogger(Logger):
    def __init__(self, config: TrackioConfig) -> None:
        self.config = config
        self.run: Any = None
        self.trackio: Any = None

    def start(self, run: RunInfo) -> None:
        cfg = self.config
        self.trackio = _import_trackio(cfg.log_dir)
        self.run = self.trackio.init(
            project=cfg.project,
            name=cfg.name or run.name,
            group=cfg.group,
            space_id=cfg.space_id,
            config=dict(run.config),
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log({k: float(v) for k, v in metrics.items()}, step=step)

    def log_samples(self, samples: Sequence[SampleRecord], step: int) -> None:
        if self.run is not None and samples:
            columns, rows = sample_table(samples)
            self.run.log({"samples": self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            try:
                run.finish()
            finally:
                # trackio finishes its current run again at exit (printing as it does) unless cleared
                if self.trackio.context_vars.current_run.get() is run:
                    self.trackio.context_vars.current_run.set(None)
