"""``algorithm.reward_shaping.aggregation: normalize_then_sum`` (GDPO) against the rest of the run:
the weighted parts it normalises (a ``combine`` reward's), the groups it normalises them in (a
group-relative advantage estimator) and a reward it cannot see the parts of (a ``reward_model:``
role's score, added later). :func:`combine_part_weights` gives the trainer those parts' weights.
"""

from __future__ import annotations

from core_rl.config.schema import RunConfig

KEY = "algorithm.reward_shaping.aggregation"
WEIGHTED = "normalize_then_sum"


def combine_part_weights(cfg: RunConfig) -> dict[str, float] | None:
    """``label -> weight`` of the ``combine`` reward's parts (the names its parts are reported under,
    :attr:`core_rl.builtin.rewards.CombinePart.metric_name`), in order, when
    ``aggregation`` is ``normalize_then_sum``; ``None`` otherwise (the reward's score is used)."""
    if cfg.algorithm.reward_shaping.aggregation != WEIGHTED or cfg.reward is None:
        return None
    return {part.metric_name: float(part.weight) for part in cfg.reward.config.parts}


def reward_aggregation_problems(cfg: RunConfig, *, rl_loop: bool) -> list[str]:
    """Where ``normalize_then_sum`` cannot apply: a loop that scores no rollouts, a reward without
    weighted parts (anything but ``combine``), a ``reward_model:`` role, or an advantage estimator
    that does not compare the samples of each prompt's group (its config class's
    ``group_relative`` is not true)."""
    if cfg.algorithm.reward_shaping.aggregation != WEIGHTED:
        return []
    head = f"{KEY}: {WEIGHTED} normalises each weighted part of a 'combine' reward within its group"
    fallback = f"or set {KEY}: sum"
    if not rl_loop:
        return [f"{head}, and the {cfg.trainer.loop.name!r} loop scores no rollouts; {fallback}"]
    reward = cfg.reward.name if cfg.reward is not None else None
    if reward != "combine":
        what = f"reward.name is {reward!r}, a single score" if reward else "this run has no reward: section"
        return [f"{head}, but {what} with no weighted parts; select reward.name: combine with its parts, {fallback}"]
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
