"""The ``wandb`` logger: each step's metrics as a W&B history row, logged samples as a
``wandb.Table`` (key ``samples``).

``mode``: ``online`` (needs ``WANDB_API_KEY`` or ``wandb login``), ``offline`` (files under
``dir``, default the run directory; ``wandb sync`` uploads later), ``disabled`` (nothing, no
network, no background service). W&B is not allowed to capture the console.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import wandb
from core_rl.errors import CoreRLError
from core_rl.interfaces import Logger, RunInfo, SampleRecord, sample_table

from core_rl_wandb.plugin import WandbConfig


class WandbLogger(Logger):
    def __init__(self, config: WandbConfig) -> None:
        self.config = config
        self.run: Any = None
        self.dir: Path | None = None

    def start(self, run: RunInfo) -> None:
        cfg = self.config
        self.dir = Path(cfg.dir) if cfg.dir else run.output_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=cfg.name or run.name,
                group=cfg.group,
                tags=list(cfg.tags) or None,
                mode=cfg.mode,
                dir=str(self.dir),
                config=dict(run.config),
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            )
        except Exception as exc:
            hint = " (set WANDB_API_KEY or run 'wandb login'; or use mode: offline)" if cfg.mode == "online" else ""
            raise CoreRLError(f"logger 'wandb' could not start in mode {cfg.mode}: {exc}{hint}") from exc

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log({k: float(v) for k, v in metrics.items()}, step=step)

    def log_samples(self, samples: Sequence[SampleRecord], step: int) -> None:
        if self.run is not None and samples:
            columns, rows = sample_table(samples)
            self.run.log({"samples": wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()
