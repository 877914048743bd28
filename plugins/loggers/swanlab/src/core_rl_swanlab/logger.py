"""The ``swanlab`` logger: each step's metrics as SwanLab scalars, logged samples as a table.

``mode``: ``cloud`` (upload; needs ``SWANLAB_API_KEY`` or a ``swanlab login``), ``local`` and
``offline`` (files under ``log_dir``, default ``<run dir>/swanlab``; ``swanlab sync`` uploads an
offline run later, ``swanlab watch`` shows local ones), ``disabled`` (nothing). SwanLab is never
asked to prompt (a missing key is an error) nor to capture the terminal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import swanlab
from core_rl.errors import CoreRLError
from core_rl.interfaces import Logger, RunInfo, SampleRecord, sample_table

from core_rl_swanlab.plugin import MODES, SwanlabConfig


class SwanlabLogger(Logger):
    def __init__(self, config: SwanlabConfig) -> None:
        self.config = config
        self.run: Any = None
        self.log_dir: Path | None = None

    def start(self, run: RunInfo) -> None:
        cfg = self.config
        self.log_dir = Path(cfg.log_dir) if cfg.log_dir else run.output_dir / "swanlab"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        settings = swanlab.Settings(
            interactive=False,
            terminal={"proxy_type": "none"},
            probe={"monitor": cfg.system_monitor, "hardware": cfg.system_monitor, "requirements": False},
        )
        try:
            self.run = swanlab.init(
                project=cfg.project,
                workspace=cfg.workspace,
                name=cfg.experiment_name or run.name,
                description=cfg.description,
                tags=list(cfg.tags) or None,
                mode=MODES[cfg.mode],
                log_dir=str(self.log_dir),
                config=dict(run.config),
                settings=settings,
                reinit=True,
            )
        except Exception as exc:
            hint = " (set SWANLAB_API_KEY or run 'swanlab login'; or use mode: offline)" if cfg.mode == "cloud" else ""
            raise CoreRLError(f"logger 'swanlab' could not start in mode {cfg.mode}: {exc}{hint}") from exc

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log({k: float(v) for k, v in metrics.items()}, step=step)

    def log_samples(self, samples: Sequence[SampleRecord], step: int) -> None:
        if self.run is None or not samples:
            return
        columns, rows = sample_table(samples)
        table = swanlab.echarts.Table()
        table.add(columns, [["" if v is None else v for v in row] for row in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()
