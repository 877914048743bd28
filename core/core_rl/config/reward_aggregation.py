"""``algorithm.reward_shaping.aggregation: normalize_then_sum`` (GDPO) against the rest of the run:
the weighted parts it normalises, the groups it normalises them in (a group-relative advantage
estimator) and a reward it cannot see the parts of (a ``reward_model:`` role's score, added later).

A reward has weighted parts when its config class has a method ``weighted_parts() -> dict[str,
float]``: ``label -> weight``, in order, where each label is a name its
:meth:`~core_rl.interfaces.Reward.score_with_parts` reports a part's own scores under and its score
is ``sum_label weight * part``. The built-in ``combine`` reward has one; so may any reward plugin's.
:func:`reward_part_weights` gives the trainer those weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Real
from typing import Any, Protocol, runtime_checkable

from core_rl.config.schema import RunConfig

KEY = "algorithm.reward_shaping.aggregation"
WEIGHTED = "normalize_then_sum"


@runtime_checkable
class DeclaresWeightedParts(Protocol):
    """A reward config class whose score is a weighted sum of parts (see the module docstring)."""

    def weighted_parts(self) -> Mapping[str, float]: ...


def weighted_parts(reward_config: Any) -> dict[str, float] | None:
    """``label -> weight`` that a reward's config declares (its ``weighted_parts()``), in order, or
    ``None`` for a reward of a single score. A declaration that is no mapping of labels to numbers
    is a ``TypeError`` naming the class, as for the other optional config methods
    (:func:`core_rl.config.checks.required_columns`)."""
    if not isinstance(reward_config, DeclaresWeightedParts):
        return None
    parts = reward_config.weighted_parts()
    if not isinstance(parts, Mapping) or not all(
        isinstance(label, str) and isinstance(weight, Real) and not isinstance(weight, bool)
        for label, weight in parts.items()
    ):
        raise TypeError(
            f"{type(reward_config).__qualname__}.weighted_parts must return a mapping of labels to weights, "
            f"got {parts!r}"
        )
    return {label: float(weight) for label, weight in parts.items()}


def reward_part_weights(cfg: RunConfig) -> dict[str, float] | None:
    """The selected reward's :func:`weighted_parts` when ``aggregation`` is ``normalize_then_sum``;
    ``None`` otherwise (the reward's score is used)."""
    if cfg.algorithm.reward_shaping.aggregation != WEIGHTED or cfg.reward is None:
        return None
    return weighted_parts(cfg.reward.config)


def reward_aggregation_problems(cfg: RunConfig, *, rl_loop: bool) -> list[str]:
    """Where ``normalize_then_sum`` cannot apply: a loop that scores no rollouts, a reward without
    weighted parts (its config has no ``weighted_parts()``), a ``reward_model:`` role, or an advantage estimator
    that does not compare the samples of each prompt's group (its config class's
    ``group_relative`` is not true)."""
    if cfg.algorithm.reward_shaping.aggregation != WEIGHTED:
        return []
    head = f"{KEY}: {WEIGHTED} normalises each weighted part of the reward within its group"
    fallback = f"or set {KEY}: sum"
    if not rl_loop:
        return [f"{head}, and the {cfg.trainer.loop.name!r} loop scores no rollouts; {fallback}"]
    if cfg.reward is None or weighted_parts(cfg.reward.config) is None:
        what = "this run has no reward: section"
        if cfg.reward is not None:
            what = f"reward.name is {cfg.reward.name!r}, a single score"
        return [
            f"{head}, but {what} with no weighted parts; select a reward with weighted parts (reward.name: "
            f"combine, with its parts), {fallback}"
        ]
    problems = []
    if cfg.reward_model is not None:
        problems.append(
            f"{head}, but the reward_model: role's score is added to the reward after the parts are normalised "
            f"and is no part of them; remove the reward_model: section, {fallback}"
        )
    advantage = cfg.algorithm.advantage
    if advantage is not None and not getattr(advantage.config, "group_relative", False):
        problems.append(
            f"{head}, but the advantage estimator {advantage.name!r} (algorithm.advantage.name) does not compare the "
            "samples of each prompt's group; select a group-relative one (grpo, rloo, reinforce_pp with "
            f"group_baseline: true), {fallback}"
        )
    return problems
