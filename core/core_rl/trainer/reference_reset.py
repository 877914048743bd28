"""Resetting the reference model to the policy (``algorithm.reference_reset_every_n_steps``), as
prolonged RL runs do to keep a KL penalty from holding the policy near where it started.

After each ``k``-th step the policy is exported to ``<run>/reference/step_<N>`` (the engine's atomic
``export_hf``) and the reference engine is built again from that directory, with the reference
section's other settings; from step ``N + 1`` on, ``ref_logprobs`` are the step-``N`` policy's. The
reference of step ``S`` is therefore the policy of step ``reset_step(S) = floor(S / k) * k`` (the
original reference before the first reset), which is how a resumed run finds it again. Exports
no kept checkpoint can need (older than the reset step of the oldest one, and not the newest) are
removed after each reset and each checkpoint.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import attrs

from core_rl.config.schema import ActorConfig, RunConfig
from core_rl.errors import ConfigError, CoreRLError
from core_rl.interfaces import TrainEngine
from core_rl.plugins import PluginHost
from core_rl.trainer.checkpoints import list_checkpoints
from core_rl.trainer.hf_exports import export_dir, exported_steps
from core_rl.trainer.ranks import waiting_for

#: builds the reference engine of a section (``core_rl.roles.build_engine`` with the run's host)
BuildReference = Callable[[ActorConfig], TrainEngine]


def reset_step(step: int, every: int) -> int:
    """The step whose policy is the reference during step ``step + 1`` (0: the original one)."""
    return step // every * every if every else 0


def reference_dir(run_dir: Path, step: int) -> Path:
    """``<run>/reference/step_<N>``: the policy of step ``N``, the reference after it."""
    return export_dir(run_dir, step, "reference")


@attrs.define
class ReferenceReset:
    """The reset schedule of one run; :meth:`after_step` and :meth:`restore` hand back the reference
    engine to use from then on (the old one closed)."""

    every: int
    section: ActorConfig
    run_dir: Path
    build: BuildReference
    is_main: bool

    @classmethod
    def of_run(cls, cfg: RunConfig, host: PluginHost, ref: TrainEngine | None, is_main: bool) -> ReferenceReset:
        """The schedule of ``cfg`` (``algorithm.reference_reset_every_n_steps`` > 0); refused when
        the run has no reference model to reset."""
        if ref is None:
            raise ConfigError(
                [
                    "algorithm.reference_reset_every_n_steps: the run has no reference model (nothing reads "
                    "reference log-probs, e.g. algorithm.loss.kl_coef is 0); remove it or add a KL term"
                ]
            )

        def build(section: ActorConfig) -> TrainEngine:
            from core_rl.roles import build_engine

            return build_engine(host, section, trainable=False, role="ref")

        every = cfg.algorithm.reference_reset_every_n_steps
        return cls(every, cfg.ref or cfg.actor, cfg.experiment.run_dir, build, is_main)

    def _rebuilt(self, old: TrainEngine, step: int) -> TrainEngine:
        path = reference_dir(self.run_dir, step)
        old.close()  # its memory first: the new one takes as much
        return self.build(attrs.evolve(self.section, model_path=str(path), tokenizer_path=None))

    def after_step(self, step: int, actor: TrainEngine, ref: TrainEngine) -> TrainEngine:
        """At a reset step, the policy exported and the reference built from it; else ``ref``."""
        if not self.every or step % self.every:
            return ref
        with waiting_for(f"the other ranks to export the policy of step {step} as the new reference"):
            actor.export_hf(reference_dir(self.run_dir, step))
        self.prune(self.run_dir)
        return self._rebuilt(ref, step)

    def restore(self, step: int, ref: TrainEngine) -> TrainEngine:
        """The reference of a run resumed after step ``step``: the export of its reset step."""
        at = reset_step(step, self.every)
        if not at:
            return ref
        if not reference_dir(self.run_dir, at).is_dir():
            raise CoreRLError(
                f"algorithm.reference_reset_every_n_steps: the run resumes after step {step}, whose reference is the "
                f"policy of step {at}, but {reference_dir(self.run_dir, at)} is gone; restore it or start a new run"
            )
        return self._rebuilt(ref, at)

    def prune(self, run_dir: Path) -> list[int]:
        """Remove the exports that no kept checkpoint of ``run_dir`` (nor the running step) can need;
        main rank only."""
        steps = exported_steps(self.run_dir, "reference")
        if not self.is_main or not steps:
            return []
        kept = [step for step, _path in list_checkpoints(run_dir)]
        needed = min((reset_step(s, self.every) for s in kept), default=steps[-1])
        removed = [s for s in steps[:-1] if s < needed]
        for s in removed:
            shutil.rmtree(reference_dir(self.run_dir, s), ignore_errors=True)
        return removed
