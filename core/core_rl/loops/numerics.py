"""Steps whose loss or gradient norm is NaN or inf.

The train engine already skipped such a step's update on every rank (``nonfinite`` in its metrics,
see :meth:`core_rl.interfaces.TrainEngine.train_step`). :class:`NonFiniteGuard` counts it
(``actor/nonfinite_total``), saves each rank's batch to ``<run>/nonfinite/step_<N>/rank<r>.*`` for
inspection (:func:`core_rl.checkpoint.files.load_tree` reads it back), and ends the run when
``trainer.on_nonfinite`` is ``stop`` or ``trainer.max_consecutive_nonfinite`` steps in a row were
non-finite. Every rank sees the same reduced metrics, so every rank decides the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from core_rl.checkpoint.files import save_tree
from core_rl.config.schema import TrainerConfig
from core_rl.errors import warn
from core_rl.loops.errors import NonFiniteError
from core_rl.loops.streaks import StreakCounter
from core_rl.protocol import TensorBatch


def is_nonfinite(metrics: Mapping[str, float]) -> bool:
    """The engine's ``nonfinite`` flag, or a NaN/inf ``loss`` or ``grad_norm`` (an engine that does
    not report the flag)."""
    if metrics.get("nonfinite", 0.0) > 0:
        return True
    return any(not math.isfinite(metrics[k]) for k in ("loss", "grad_norm") if k in metrics)


class NonFiniteGuard(StreakCounter):
    """See the module docstring. ``total``/``streak``: non-finite steps so far / in a row."""

    def __init__(self, run_dir: Path, rank: int, config: TrainerConfig) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.rank = rank
        self.config = config

    def dump_dir(self, step: int) -> Path:
        return self.run_dir / "nonfinite" / f"step_{step:08d}"

    def check(self, step: int, shard: TensorBatch, metrics: Mapping[str, float]) -> dict[str, float]:
        """Account for step ``step`` given its engine ``metrics``; return ``actor/nonfinite`` and
        ``actor/nonfinite_total``. Raises :class:`NonFiniteError` when the run must end."""
        self.count(is_nonfinite(metrics))
        if not self.streak:
            return {"actor/nonfinite": 0.0, "actor/nonfinite_total": float(self.total)}
        where = self.dump_dir(step)
        saved = f"its batch is saved under {where}"
        try:
            save_tree(
                where, f"rank{self.rank}", {"batch": {k: shard[k] for k in shard.keys()}, "metrics": dict(metrics)}
            )
        except OSError as exc:
            saved = f"saving its batch under {where} failed ({exc})"
        values = ", ".join(f"{k}={metrics[k]:.4g}" for k in ("loss", "grad_norm") if k in metrics)
        message = f"step {step}: the loss or gradient norm is not finite ({values}); the update was skipped and {saved}"
        limit = self.config.max_consecutive_nonfinite
        if self.config.on_nonfinite == "stop":
            raise NonFiniteError(f"{message}; trainer.on_nonfinite=stop ends the run")
        if limit and self.streak >= limit:
            raise NonFiniteError(
                f"{message}; {self.streak} non-finite steps in a row reach trainer.max_consecutive_nonfinite="
                f"{limit}, so the run ends (lower the learning rate, check the loss and the data)"
            )
        if self.rank == 0:
            warn(message)
        return {"actor/nonfinite": 1.0, "actor/nonfinite_total": float(self.total)}
