"""``rollout.dump`` (each step's scored rollouts saved to disk) and ``rollout.replay_from`` (a run
that trains on saved rollouts instead of generating). How they combine with the rest of a run:
:func:`core_rl.config.problems.replay_config_problems`; the files: :mod:`core_rl.rollout.dump`;
the replay: :mod:`core_rl.rollout.replay`."""

from __future__ import annotations

import attrs

from core_rl.config.validators import MAX_STEPS, in_range, not_empty


@attrs.define
class RolloutDumpConfig:
    """``every_n_steps``: write the scored rollouts of every step ``N`` divisible by it to
    ``<dir>/step_<N>.parquet`` (0: never); ``dir``: where (null: ``<run>/rollouts``)."""

    every_n_steps: int = attrs.field(default=0, validator=in_range(0, MAX_STEPS))
    dir: str | None = attrs.field(default=None, validator=not_empty())
