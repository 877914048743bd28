"""Keys whose value is derived from other keys of the run, and how they stay derived.

Five kinds of key are derived:

- the core's own defaults (:func:`derive_schedules`): ``actor.lr_scheduler.total_steps`` and
  ``critic.lr_scheduler.total_steps`` (``0``: ``trainer.total_steps`` x the optimiser steps of an
  RL step) and each schedule's ``warmup_steps`` (``0`` with ``warmup_ratio > 0``:
  ``floor(warmup_ratio x total_steps)``);
- a plugin's fields declared with :func:`core_rl.config.schema.default_from` (unset or ``null``:
  the value of another key), recorded by :func:`record_default`;
- ``${...}`` interpolations written in the YAML file or the overrides (:func:`interpolations`);
- ``trainer.total_steps`` with ``trainer.total_epochs`` (:mod:`core_rl.config.epochs`), which
  depends on the number of training prompts: written ``0`` and derived when the run starts, with
  the schedules derived from it, all marked ``at_start``;
- settings whose good value depends on the machine, written ``auto`` and chosen when the run starts
  (:mod:`core_rl.loops.auto_budget`: the micro-batch token budgets), marked ``at_start``. They
  are not the loader's: ``core-rl config show`` prints ``auto``; a run records the value it chose
  in ``<run>/config.yaml``'s comment, and a resumed run chooses anew without calling it a change.

The loader fills the first three with their values, so components only ever see values, and records it in
:attr:`core_rl.config.schema.RunConfig.derived`. The YAML of a configuration
(:func:`core_rl.config.loader.to_yaml`: what ``core-rl config show`` prints and
``<run>/config.yaml`` holds) writes each such key as what keeps it derived (``0``, ``null`` or the
interpolation) with its value in a comment::

    lr_scheduler:
      total_steps: 0  # derived: 20 = trainer.total_steps x algorithm.ppo_n_minibatches x ...

so a run started again from that file with another ``trainer.total_steps`` derives them anew
(:mod:`core_rl.loops.run_config` names, on resume, each derived value that changed).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from core_rl.config.derived_key import INTERPOLATION as INTERPOLATION  # re-exported with the functions
from core_rl.config.derived_key import Derived as Derived
from core_rl.config.model_sections import SchedulerConfig
from core_rl.config.paths import Path, parse_key
from core_rl.config.schema import RunConfig


def record(cfg: RunConfig, derived: Derived) -> None:
    """Note in ``cfg.derived`` that ``derived.key`` was derived."""
    cfg.derived[derived.key] = derived


def record_default(run: RunConfig, path: str, value: Any, source: str) -> None:
    """Note that the plugin field at dotted ``path`` (``algorithm.loss.norm_length``) took
    ``value`` from the key ``source`` (a ``default_from`` field; ``null`` keeps it derived)."""
    record(run, Derived(parse_key(path), value, None, source))


def derive_schedules(cfg: RunConfig, *, at_start: bool = False) -> None:
    """Fill the unset ``total_steps`` and ``warmup_steps`` of the actor's learning-rate schedule
    and, when there is a critic, of the critic's (see the module docstring); record each.
    While ``trainer.total_steps`` is itself still to be derived (``0``: from
    ``trainer.total_epochs`` when the run starts, :mod:`core_rl.config.epochs`, which calls this
    again with ``at_start``) they are only recorded as to be derived then (value ``None``)."""
    algorithm = cfg.algorithm
    steps = cfg.trainer.total_steps
    schedules: list[tuple[str, SchedulerConfig]] = [("actor", cfg.actor.lr_scheduler)]
    if cfg.critic is not None:
        schedules.append(("critic", cfg.critic.lr_scheduler))
    for role, schedule in schedules:
        if schedule.total_steps == 0:
            source = "trainer.total_steps x algorithm.ppo_n_minibatches x algorithm.ppo_epochs"
            if steps:
                schedule.total_steps = steps * algorithm.optimizer_steps_per_step
                source += f" = {steps} x {algorithm.ppo_n_minibatches} x {algorithm.ppo_epochs}"
            _record_schedule_key(cfg, role, "total_steps", schedule.total_steps or None, source, at_start or not steps)
        if schedule.warmup_steps == 0 and schedule.warmup_ratio > 0:
            source = "floor(warmup_ratio x total_steps)"
            if steps:
                schedule.warmup_steps = int(schedule.warmup_ratio * schedule.total_steps)
                source += f" = floor({schedule.warmup_ratio} x {schedule.total_steps})"
            value = schedule.warmup_steps if steps else None
            _record_schedule_key(cfg, role, "warmup_steps", value, source, at_start or not steps)


def _record_schedule_key(cfg: RunConfig, role: str, key: str, value: int | None, source: str, at_start: bool) -> None:
    """Record ``<role>.lr_scheduler.<key>`` as derived (``value`` ``None``: when the run starts)."""
    if value is None:
        source += ", when the run starts"
    record(cfg, Derived((role, "lr_scheduler", key), value, 0, source, at_start))


def interpolations(unresolved: Any, resolved: Any, prefix: Path = ()) -> Iterator[Derived]:
    """Each leaf of ``unresolved`` plain data that holds a ``${...}`` interpolation, with its
    value in ``resolved`` (the same data with the interpolations resolved)."""
    if isinstance(unresolved, Mapping) and isinstance(resolved, Mapping):
        for key, value in unresolved.items():
            if key in resolved:
                yield from interpolations(value, resolved[key], (*prefix, key))
    elif isinstance(unresolved, list) and isinstance(resolved, list):
        for i, (value, done) in enumerate(zip(unresolved, resolved)):
            yield from interpolations(value, done, (*prefix, i))
    elif isinstance(unresolved, str) and "${" in unresolved:
        yield Derived(prefix, resolved, unresolved, INTERPOLATION)
