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


from core_rl.plugins.lazy_exports import lazy_exports  # noqa: E402

# what plugins import from this package: its public names (core_rl.testing.public_api)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.loops.errors": ("TrainingInterrupted",),
        "core_rl.loops.rl.reference_reset": ("ReferenceReset",),
        "core_rl.loops.step_metrics": ("StepMetrics",),
        "core_rl.loops.token_budget": (
            "ModelShape",
            "optimizer_states",
            "tokens_per_mb",
        ),
    },
)
