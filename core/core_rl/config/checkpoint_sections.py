"""The checkpoint sections of a run: ``saver`` (when checkpoints are written, which are kept, and
what they hold) and ``recover`` (resuming and automatic restarts); the trainer's side is
:mod:`core_rl.checkpoint.resume`."""

from __future__ import annotations

import attrs

from core_rl.config.validators import MAX_COUNT, MAX_STEPS, in_range, not_empty, one_of


@attrs.define
class KeepBestConfig:
    """``saver.keep_best``: keep the ``count`` checkpoints (0: none besides ``keep_last``) with the
    best value of ``metric`` logged at their step, the largest with ``mode: max``
    (:mod:`core_rl.checkpoint.policy`)."""

    count: int = attrs.field(default=0, validator=in_range(0, MAX_COUNT))
    metric: str = attrs.field(default="eval/reward/mean", validator=not_empty())
    mode: str = attrs.field(default="max", validator=one_of(("max", "min")))


@attrs.define
class SaverConfig:
    """Checkpoints (full training state, for resuming) every ``every_n_steps`` steps (0: never),
    after the first step ending ``every_n_minutes`` after the newest checkpoint or the start (0:
    never) and at the end; the newest ``keep_last`` are kept, and the best ``keep_best.count`` by
    a metric (:mod:`core_rl.checkpoint.policy`). ``export_hf`` also writes the final
    policy as a Hugging Face directory (``<run>/final_hf``); ``export_hf_every_n_steps`` writes the
    policy of every such step to ``<run>/hf/step_<N>`` (0: never), keeping the newest
    ``export_hf_keep_last`` (0: all) (:mod:`core_rl.checkpoint.hf_exports`).

    ``save_optimizer`` (default true): checkpoints hold the optimizer state of every trained role
    (actor, critic). False leaves it out (with AdamW and float32 weights a checkpoint about a third
    the size: no moments); such a checkpoint resumes only with ``recover.load_optimizer: false``,
    unless it was saved before any optimizer step. Each engine's ``meta.json`` records which
    (``optimizer_state``: ``saved``, ``left_out`` or ``none_yet``; :mod:`core_rl_train_kit.state`)."""

    every_n_steps: int = attrs.field(default=0, validator=in_range(0, MAX_STEPS))
    every_n_minutes: float = attrs.field(default=0.0, validator=in_range(0.0, 1e6))
    at_end: bool = True
    keep_last: int = attrs.field(default=2, validator=in_range(1, MAX_COUNT))
    keep_best: KeepBestConfig = attrs.field(factory=KeepBestConfig)
    export_hf: bool = True
    export_hf_every_n_steps: int = attrs.field(default=0, validator=in_range(0, MAX_STEPS))
    export_hf_keep_last: int = attrs.field(default=0, validator=in_range(0, MAX_COUNT))
    save_optimizer: bool = True


@attrs.define
class RecoverConfig:
    """Resuming and automatic restarts.

    ``mode``: ``disabled`` (start fresh; a run directory that already holds a run is refused),
    ``auto`` (continue from the newest valid checkpoint if there is one, else start fresh; after a
    crash, restart from the newest valid checkpoint up to ``retries`` times), ``resume`` (continue
    from the newest valid checkpoint, an error if there is none; no restarts). Restarts happen in
    the process for a single-process run, and through the launcher's worker restarts for
    ``core-rl train --nproc-per-node N``. Configuration errors, a stop asked for by the
    configuration (``on_error: stop``, ``on_nonfinite: stop``) and signals are never retried.

    ``load_optimizer`` (default true): a resume restores the optimizer state of every trained
    role. False restores weights, step, data position, learning-rate schedule and RNG but starts
    each optimizer afresh (one warning says so); it is how a checkpoint saved with
    ``saver.save_optimizer: false`` resumes (true refuses one, unless it was saved before any
    optimizer step, when there was no state to save). It applies to every resume of the run,
    automatic restarts included; ``save_optimizer: false`` with restarts and ``load_optimizer: true``
    is refused (:func:`core_rl.config.problems.restart_problems`)."""

    mode: str = attrs.field(default="disabled", validator=one_of(("disabled", "auto", "resume")))
    retries: int = attrs.field(default=3, validator=in_range(0, 1000))
    load_optimizer: bool = True
