"""Resetting the reference model to the policy (``algorithm.reference_reset_every_n_steps``), as
prolonged RL runs do to keep a KL penalty from holding the policy near where it started.

After each ``k``-th step the policy is exported to ``<run>/reference/step_<N>`` (the engine's atomic
``export_hf``) and the reference engine is built again from that directory, with the reference
section's other settings; from step ``N + 1`` on, ``ref_logprobs`` are the step-``N`` policy's. The
reference of step ``S`` is therefore the policy of step ``reset_step(S) = floor(S / k) * k`` (the
original reference before the first reset), which is how a resumed run finds it again. Exports
no kept checkpoint can need (neither the newest nor the reset step's of a kept checkpoint) are
removed after each reset and each checkpoint.

With ``algorithm.reference_reset_alpha`` ``alpha`` < 1 each reset is a soft update: the export of
step ``N`` holds ``alpha * policy_N + (1 - alpha) * reference`` (float32 mixing, stored in the
reference's dtype; :mod:`core_rl.loops.rl.reference_mix` defines it per tensor). The policy is exported
as for a hard reset, but into the partial directory of ``<run>/reference/step_<N>``; rank 0 then mixes
its weights with the current reference's, read from disk, and moves the directory into place; the
other ranks wait for that (a collective, bounded by ``trainer.collective_timeout_s``). The current
reference is read from the previous export (``<run>/reference/step_<N - k>``; the reference role's
``model_path`` before the first reset) rather than gathered from the reference engine: the files are
exactly what that engine loaded (the mix is stored in its dtype), reading them needs no collective
and no second gathered copy of the model on rank 0 (the tensors are streamed from memory-mapped
files), and a resumed run reads the same files. Each reference then depends on every earlier one,
but only through the newest export, which pruning always keeps (and the export of each kept
checkpoint's reset step, from which a resumed run's next mix starts).

With ``algorithm.reference_reset_optimizer`` each reset also drops the actor's optimizer state
(:meth:`~core_rl.interfaces.TrainEngine.reset_optimizer`, ProRL's reference-and-optimizer reset):
the update after it starts Adam afresh. A checkpoint of the reset step holds no optimizer state
(none existed: its ``optimizer_state`` says so), and a run resumed from it goes on the same way.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import attrs

from core_rl.checkpoint.atomic import commit_partial, partial_path
from core_rl.checkpoint.hf_exports import export_dir, exported_steps
from core_rl.checkpoint.store import list_checkpoints
from core_rl.config.schema import ActorConfig, RunConfig
from core_rl.errors import ConfigError, CoreRLError
from core_rl.interfaces import TrainEngine
from core_rl.launch.ranks import agree_after, waiting_for
from core_rl.loops.rl.reference_mix import mismatch, weight_files
from core_rl.plugins.host import PluginHost

#: builds the reference engine of a section (``core_rl.roles.build.build_engine`` with the run's host)
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
    #: ``algorithm.reference_reset_alpha``: 1 resets to the policy, below 1 mixes it in
    alpha: float = 1.0
    #: ``algorithm.reference_reset_optimizer``: each reset also drops the actor's optimizer state
    reset_optimizer: bool = False

    @classmethod
    def of_run(
        cls, cfg: RunConfig, host: PluginHost, ref: TrainEngine | None, is_main: bool, actor: TrainEngine | None = None
    ) -> ReferenceReset:
        """The schedule of ``cfg`` (``algorithm.reference_reset_every_n_steps`` > 0); refused when
        the run has no reference model to reset, or with ``algorithm.reference_reset_optimizer``
        when ``actor`` (the policy's engine) cannot reset its optimizer state."""
        reset_optimizer = cfg.algorithm.reference_reset_optimizer
        if reset_optimizer and getattr(type(actor), "reset_optimizer", None) in (None, TrainEngine.reset_optimizer):
            raise ConfigError(
                [
                    f"algorithm.reference_reset_optimizer: the actor's engine {cfg.actor.engine.name!r} cannot reset "
                    "its optimizer state (it implements no TrainEngine.reset_optimizer); remove it, or choose an "
                    "engine that can (fsdp, deepspeed, megatron)"
                ]
            )
        if ref is None:
            raise ConfigError(
                [
                    "algorithm.reference_reset_every_n_steps: the run has no reference model (nothing reads "
                    "reference log-probs, e.g. algorithm.loss.kl_coef is 0); remove it or add a KL term"
                ]
            )

        def build(section: ActorConfig) -> TrainEngine:
            from core_rl.roles.build import build_engine

            return build_engine(host, section, trainable=False, role="ref")

        every, alpha = cfg.algorithm.reference_reset_every_n_steps, cfg.algorithm.reference_reset_alpha
        section = cfg.ref or cfg.actor
        if alpha != 1.0:
            try:
                weight_files(Path(section.model_path))
            except CoreRLError as exc:
                raise ConfigError(
                    [
                        f"algorithm.reference_reset_alpha: soft updates read the first reference's weights from "
                        f"safetensors files: {exc}; save the model with safetensors, or set reference_reset_alpha: 1"
                    ]
                ) from exc
            try:  # the same weights in both, as the first mix needs: known now rather than at that step
                different = mismatch(Path(cfg.actor.model_path), Path(section.model_path))
            except CoreRLError:  # the policy's directory holds no safetensors: its export will
                different = None
            if different is not None:
                raise ConfigError(
                    [
                        f"algorithm.reference_reset_alpha: {different}; soft updates mix the same model's weights "
                        "(use the actor's model as ref:, or set reference_reset_alpha: 1)"
                    ]
                )
        return cls(every, section, cfg.experiment.run_dir, build, is_main, alpha, reset_optimizer)

    def _rebuilt(self, old: TrainEngine, step: int) -> TrainEngine:
        path = reference_dir(self.run_dir, step)
        old.close()  # its memory first: the new one takes as much
        return self.build(attrs.evolve(self.section, model_path=str(path), tokenizer_path=None))

    def after_step(self, step: int, actor: TrainEngine, ref: TrainEngine) -> TrainEngine:
        """At a reset step, the policy exported and the reference built from it (with
        :attr:`reset_optimizer`, the actor's optimizer state dropped); else ``ref``."""
        if not self.every or step % self.every:
            return ref
        if self.reset_optimizer:
            with waiting_for(f"the other ranks to reset the optimizer state after step {step}"):
                actor.reset_optimizer()
        if self.alpha == 1.0:
            with waiting_for(f"the other ranks to export the policy of step {step} as the new reference"):
                actor.export_hf(reference_dir(self.run_dir, step))
        else:
            self._mix(step, actor)
        self.prune(self.run_dir)
        return self._rebuilt(ref, step)

    def previous_dir(self, step: int) -> Path:
        """The directory of the reference during step ``step`` (the one a reset after it mixes
        with): the export of ``reset_step(step - 1)``, or the section's ``model_path`` before any."""
        at = reset_step(step - 1, self.every)
        return reference_dir(self.run_dir, at) if at else Path(self.section.model_path)

    def _mix(self, step: int, actor: TrainEngine) -> None:
        """The soft update of step ``step`` (module docstring): the policy exported into the partial
        directory of the step's export, mixed there by rank 0 and moved into place."""
        from core_rl.loops.rl.reference_mix import mix_into
        from core_rl.roles.hf import torch_dtype

        final = reference_dir(self.run_dir, step)
        with waiting_for(f"the other ranks to export the policy of step {step} for the new reference"):
            actor.export_hf(partial_path(final))
        error: Exception | None = None
        if self.is_main:
            try:
                previous = self.previous_dir(step)
                if not previous.is_dir():
                    raise CoreRLError(
                        f"algorithm.reference_reset_alpha: the reference after step {step} mixes the policy with "
                        f"the reference in {previous}, which is gone; restore it or start a new run"
                    )
                mix_into(partial_path(final), previous, self.alpha, torch_dtype(self.section.dtype))
                commit_partial(final)
            except Exception as exc:
                shutil.rmtree(partial_path(final), ignore_errors=True)
                error = exc
        agree_after(f"mixing the reference of step {step} (rank 0)", error)

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
        """Remove the exports that no kept checkpoint of ``run_dir`` (nor the running step) can need:
        all but the newest (the running reference, which the next soft update mixes with) and the
        reset step's of each kept checkpoint (a resumed run's reference; ``saver.keep_best`` may keep
        an old checkpoint, which then pins its own export, never the ones between); main rank only."""
        steps = exported_steps(self.run_dir, "reference")
        if not self.is_main or not steps:
            return []
        needed = {reset_step(step, self.every) for step, _path in list_checkpoints(run_dir)}
        removed = [s for s in steps[:-1] if s not in needed]
        for s in removed:
            shutil.rmtree(reference_dir(self.run_dir, s), ignore_errors=True)
        return removed
