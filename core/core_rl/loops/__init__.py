"""Trainer loops. ``train(cfg, host=...)`` runs the loop ``trainer.loop`` selects
(:func:`core_rl.loops.run.train`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core_rl.config.schema import RunConfig
from core_rl.plugins.host import PluginHost


def train(cfg: RunConfig, *, host: PluginHost) -> Mapping[str, Any]:
    """Run training as configured; return where the run's metrics, checkpoint and model are."""
    from core_rl.loops.run import train as run_train

    return run_train(cfg, host=host)
