"""Trainer loops. ``train(cfg, host=...)`` runs the loop ``trainer.loop`` selects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core_rl.config.schema import RunConfig
from core_rl.plugins import PluginHost


def train(cfg: RunConfig, *, host: PluginHost) -> Mapping[str, Any]:
    """Run training as configured; return where the run's metrics, checkpoint and model are."""
    from core_rl.trainer.sync import train as train_sync

    return train_sync(cfg, host=host)
