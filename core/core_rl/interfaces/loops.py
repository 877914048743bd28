"""The training loop's contract (``trainer.loop``): what every loop, built-in or a plugin's, keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the components themselves, not by their registration
    pass


class TrainingLoop(ABC):
    """A whole training run of one kind (``trainer.loop``): built by its factory from the
    configuration (see :func:`core_rl.hookspecs.core_rl_register_loops`), then :meth:`run` once and
    :meth:`close`.

    The contract every loop keeps (the built-in ``rl`` loop, :class:`core_rl.loops.rl.loop.SyncTrainer`,
    and the supervised base :class:`core_rl.loops.supervised.loop.SupervisedLoop` keep it for their
    subclasses through the run scaffold they share, :class:`core_rl.loops.scaffold.RunScaffold`):
    metrics of each step go to every configured logger (the ``jsonl`` one always, so
    ``<run>/metrics.jsonl`` exists); checkpoints are written atomically under ``<run>/checkpoints``
    on ``saver``'s schedule; ``recover.mode`` resumes from the newest valid one exactly (weights,
    optimiser, data position, RNGs); a first SIGINT/SIGTERM ends the run after the current step with
    a checkpoint and :class:`core_rl.loops.errors.TrainingInterrupted`.
    """

    @abstractmethod
    def run(self) -> Mapping[str, Any]:
        """Train to the end; return ``run_dir``, ``metrics`` (the metrics file), ``checkpoint``
        (the last one saved, or ``None``) and ``export`` (the exported model directory, or ``None``)."""

    @abstractmethod
    def close(self) -> None:
        """Release engines and other resources (also after a failure); safe to call twice."""
