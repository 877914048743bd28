"""The ``tensorboard`` logger: each metric a scalar (tag = metric name), logged samples a Markdown
table in the text tab (tag ``samples``), the run's configuration as text (tag ``config``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from core_rl.interfaces import Logger, RunInfo, SampleRecord, sample_table
from torch.utils.tensorboard import SummaryWriter

from core_rl_tensorboard.plugin import TensorboardConfig


def markdown_table(columns: list[str], rows: list[list[object]]) -> str:
    """A Markdown table; ``|`` and newlines inside cells are escaped so each row stays one line."""

    def cell(value: object) -> str:
        text = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "\\n")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class TensorboardLogger(Logger):
    def __init__(self, config: TensorboardConfig) -> None:
        self.config = config
        self.writer: SummaryWriter | None = None
        self.log_dir: Path | None = None

    def start(self, run: RunInfo) -> None:
        self.log_dir = Path(self.config.log_dir) if self.config.log_dir else run.output_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=self.config.flush_secs)
        config = json.dumps(dict(run.config), indent=2, default=str)
        self.writer.add_text("config", "```\n" + config + "\n```", global_step=0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, float(value), global_step=step)

    def log_samples(self, samples: Sequence[SampleRecord], step: int) -> None:
        if self.writer is not None and samples:
            self.writer.add_text("samples", markdown_table(*sample_table(samples)), global_step=step)

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()
