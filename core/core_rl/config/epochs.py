"""``trainer.total_epochs``: a run's length as passes over its training prompts.

A run gives either ``trainer.total_steps`` (default 100) or ``trainer.total_epochs`` (``E``). With
``total_epochs`` the number of steps is derived when the run starts, once the data is read and
filtered (``data.filter_overlong_prompts``), from the ``P`` prompts left and the ``B =
data.batch_size`` prompts a step draws::

    trainer.total_steps = ceil(E x P / B)

Every loop draws its rows from the same stream (:class:`core_rl.data.prompts.PromptSource`): ``B``
at a time, reshuffled at each pass, with no partial batch dropped: a batch that reaches the end of
a pass is filled from the start of the next. So ``E x P / B`` steps draw every prompt exactly ``E``
times; the rounding up lets the last step finish its batch with up to ``B - 1`` prompts of pass
``E + 1`` (when ``B`` divides ``P`` this is ``E x P / B`` exactly, ``P / B`` steps per epoch).
The supervised loops (``sft``, ``dpo``, ``kto``, ``rm``) read ``data.batch_size`` rows per step
from the same stream, so the same count holds for them. With dynamic sampling
(``algorithm.max_num_gen_batches > 1``) a step may draw more than one batch; the count stays that
of trained batches, so such a run draws more than ``E`` passes. So with ``data.difficulty_filter``
(:mod:`core_rl.loops.rl.difficulty`): a prompt it skips counts as drawn in its pass (the data
position moves past it) while the step still trains ``B`` others, so the same ``ceil(E x P / B)``
steps reach further into the epoch order than ``E`` passes.

Setting ``trainer.total_steps`` (to anything but ``0``, the value that keeps it derived) together
with ``trainer.total_epochs`` is a configuration error naming both: one of them says how long the
run is. (To stop an epoch run early, give ``trainer.total_steps`` alone.)

When the configuration loads, ``trainer.total_steps`` is ``0`` and recorded as derived at the start
(:func:`defer_total_steps`): ``core-rl config show`` prints the formula, and what depends on the
count (the learning-rate schedules' ``total_steps`` and ``warmup_steps``, the checks of
``trainer.profile.steps`` and of schedules reaching 0) waits for it. :func:`derive_total_steps`
then fills it in, derives the schedules, runs those checks and states the count on stderr; the
run's ``config.yaml`` keeps ``total_steps: 0`` with the count in its comment. A resumed run derives
the count again from the data as it is then: over the same data the same count; over more (or
fewer) prompts, the count ``E`` passes over the new data take from step 1, so the run continues to
that step (a checkpoint already past it is refused, naming ``trainer.total_epochs``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from core_rl.config.derived import derive_schedules, record
from core_rl.config.derived_key import Derived
from core_rl.config.paths import node_at
from core_rl.config.problems import step_count_problems
from core_rl.config.schema import RunConfig
from core_rl.config.validators import MAX_STEPS
from core_rl.errors import ConfigError

STEPS_KEY = ("trainer", "total_steps")
FORMULA = "ceil(trainer.total_epochs x prompts / data.batch_size)"


def epoch_steps(epochs: int, prompts: int, batch_size: int) -> int:
    """``ceil(epochs x prompts / batch_size)``: the steps that draw each of ``prompts`` prompts
    ``epochs`` times, ``batch_size`` per step (see the module docstring); exact integer arithmetic."""
    return -(-epochs * prompts // batch_size)


def defer_total_steps(cfg: RunConfig, data: Mapping[str, Any]) -> list[str]:
    """At load: with ``trainer.total_epochs`` set, the problem of a ``trainer.total_steps`` also
    written in ``data`` (the resolved configuration data), else set ``total_steps`` to ``0`` and
    record it as derived when the run starts. No problem and no change without ``total_epochs``."""
    epochs = cfg.trainer.total_epochs
    if epochs is None:
        return []
    written = node_at(data, STEPS_KEY)
    if written not in (None, 0):
        return [
            f"trainer.total_epochs: {epochs} is set together with trainer.total_steps ({written}); the run's length is "
            "one of them: remove trainer.total_steps (override ~trainer.total_steps) to train "
            f"{epochs} epoch(s), or remove trainer.total_epochs to train {written} steps"
        ]
    cfg.trainer.total_steps = 0
    record(cfg, Derived(STEPS_KEY, None, 0, f"{FORMULA}, when the run starts", at_start=True))
    return []


def derive_total_steps(cfg: RunConfig, prompts: int, *, out: TextIO | None = None) -> int | None:
    """When the run starts: fill ``trainer.total_steps`` from ``trainer.total_epochs`` and the
    ``prompts`` training prompts left after filtering (:func:`epoch_steps`), record it, derive the
    schedules from it and check what depends on it (:func:`core_rl.config.problems.step_count_problems`,
    a :class:`ConfigError` listing each problem); rank 0 states the count on ``out`` (stderr).
    Returns the count, or ``None`` (nothing done) without ``total_epochs``."""
    epochs = cfg.trainer.total_epochs
    if epochs is None:
        return None
    batch = cfg.data.batch_size
    steps = epoch_steps(epochs, prompts, batch)
    if steps > MAX_STEPS:
        raise ConfigError(
            [
                f"trainer.total_epochs: {epochs} epochs of {prompts} prompts, {batch} per step, are {steps} steps, "
                f"more than {MAX_STEPS}; lower trainer.total_epochs"
            ]
        )
    cfg.trainer.total_steps = steps
    source = f"{FORMULA} = ceil({epochs} x {prompts} / {batch})"
    record(cfg, Derived(STEPS_KEY, steps, 0, source, at_start=True))
    derive_schedules(cfg, at_start=True)
    problems = step_count_problems(cfg)
    if problems:
        raise ConfigError(problems)
    if os.environ.get("RANK", "0") == "0":
        per_epoch = f"{prompts / batch:g}" if prompts % batch else str(prompts // batch)
        line = (
            f"core-rl: trainer.total_steps: {steps} = ceil({epochs} epoch(s) x {prompts} prompts / {batch} per step) "
            f"({per_epoch} steps per epoch; trainer.total_epochs)"
        )
        print(line, file=out if out is not None else sys.stderr, flush=True)
    return steps
