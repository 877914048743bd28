"""Built-in rewards: ``combine``, a weighted sum of other rewards, each scored concurrently and each
reported as its own metric; and ``workflow``, the reward a rollout workflow assigned to each sample
(:attr:`core_rl.protocol.Sample.reward`: an environment's or a game's outcome).

.. code-block:: yaml

    reward:
      name: combine
      parts:
        - reward: {name: math, answer_key: answer}    # any installed reward, with its own options
          weight: 0.9
        - reward: {name: format, tags: [think, answer]}
          weight: 0.1
          label: tags                                   # metric reward/tags/mean (default: the name)

``score = sum_i weight_i * score_i``. Each part's section is validated by its own plugin's config
class (errors name ``reward.parts[1].reward.<key>``); parts may themselves be ``combine``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs

from core_rl.config.checks import (
    EnvironmentContext,
    SectionContext,
    config_problems,
    data_problems,
    environment_problems,
    required_columns,
)
from core_rl.config.schema import PluginSpec, plugin_section
from core_rl.config.validators import FieldValueError, finite, non_negative
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Reward, RewardScores
from core_rl.plugins.kinds import REWARD
from core_rl.protocol import RewardInput

if TYPE_CHECKING:
    from core_rl.data.files import DataRow


@attrs.define
class CombinePart:
    """One part: ``reward`` (a reward section, validated by that reward), its ``weight`` (any finite
    number; negative weights make penalties) and ``label``, the name its metric is reported under
    (default: the reward's name)."""

    reward: PluginSpec = plugin_section(REWARD)  # noqa: RUF009 (an attrs field, like attrs.field)
    weight: float = attrs.field(default=1.0, validator=finite())
    label: str = ""

    @property
    def metric_name(self) -> str:
        return self.label or self.reward.name


@attrs.define
class CombineConfig:
    """``parts``: at least one; their labels must differ. ``num_workers``: parts scored at once
    (0: all of them)."""

    parts: list[CombinePart] = attrs.field(factory=list)
    num_workers: int = attrs.field(default=0, validator=non_negative())

    def __attrs_post_init__(self) -> None:
        if not self.parts:
            raise FieldValueError("parts", self.parts, "must list at least one part ({reward: {name: ...}, weight: w})")
        labels = [p.metric_name for p in self.parts]
        repeated = sorted({x for x in labels if labels.count(x) > 1})
        if repeated:
            raise FieldValueError(
                "parts", labels, f"must have distinct labels ({', '.join(repeated)} repeated); set 'label' on each"
            )

    # the parts' own checks, as if each part were the run's reward (at its own key path)

    def _part_contexts(self, context: SectionContext) -> list[tuple[Any, SectionContext]]:
        out = []
        for i, part in enumerate(self.parts):
            path = f"{context.path}.parts[{i}].reward"
            out.append((part.reward.config, attrs.evolve(context, path=path, name=part.reward.name)))
        return out

    def check_config(self, context: SectionContext) -> list[str]:
        return [line for config, ctx in self._part_contexts(context) for line in config_problems(config, ctx)]

    def check_environment(self, context: EnvironmentContext) -> list[str]:
        return [line for config, ctx in self._part_contexts(context) for line in environment_problems(config, ctx)]

    def check_data(self, rows: Sequence[DataRow], context: SectionContext) -> list[str]:
        """Each part's own ``check_data`` (on every row: a part scores them all)."""
        return [line for config, ctx in self._part_contexts(context) for line in data_problems(config, rows, ctx)]

    def required_columns(self) -> list[str]:
        """Every column any part reads."""
        return sorted({c for part in self.parts for c in required_columns(part.reward.config)})

    def weighted_parts(self) -> dict[str, float]:
        """``label -> weight`` of the parts, in order (what ``normalize_then_sum`` normalises:
        :mod:`core_rl.config.reward_aggregation`)."""
        return {part.metric_name: float(part.weight) for part in self.parts}


@attrs.define
class WorkflowRewardConfig:
    """``default``: the score of a sample whose workflow assigned none (``null``, the default: such a
    sample is an error, handled by ``reward_runner.on_error``)."""

    default: float | None = attrs.field(default=None, validator=attrs.validators.optional(finite()))

    def check_config(self, context: SectionContext) -> list[str]:
        workflow = context.run.rollout.workflow.name
        if self.default is None and workflow == "single_turn":
            return [
                f"{context.path}: reward 'workflow' reads the reward a rollout workflow assigns to each "
                f"sample, but rollout.workflow.name is {workflow!r}, which assigns none; select a workflow "
                f"plugin that sets Sample.reward, or set {context.key('default')}"
            ]
        return []


class WorkflowReward(Reward):
    """``score = item.workflow_reward`` (the sample's :attr:`~core_rl.protocol.Sample.reward`), or
    ``config.default`` where the workflow assigned none."""

    def __init__(self, config: WorkflowRewardConfig) -> None:
        self.config = config

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        missing = [item for item in items if item.workflow_reward is None]
        if missing and self.config.default is None:
            from core_rl.loops.rl.reward_runner import describe_item  # the trainer's modules import torch

            raise ValueError(
                f"the rollout workflow assigned no reward to {len(missing)} of {len(items)} samples "
                f"(Sample.reward is None; first: {describe_item(missing[0])}); reward 'workflow' scores what "
                "the workflow assigns: set Sample.reward in the workflow, or set reward.default"
            )
        return [self.config.default if item.workflow_reward is None else item.workflow_reward for item in items]


def score_nested(reward: Reward, items: Sequence[RewardInput], what: str) -> RewardScores:
    """``reward.score_with_parts(items)`` for a reward nested in another (``what`` names it in
    errors: a note on what it raises, and a ``ValueError`` when it returns a wrong count)."""
    try:
        result = reward.score_with_parts(items)
    except Exception as exc:
        exc.add_note(f"in {what}")
        raise
    if len(result.scores) != len(items):
        raise ValueError(f"{what} returned {len(result.scores)} scores for {len(items)} items")
    return result


class CombinedReward(Reward):
    """``score = sum_i weight_i * score_i`` over the configured parts; ``parts`` of
    :meth:`score_with_parts` holds each part's own score under its label (and a part's own parts
    under ``label/name``); ``answers`` are those of the first part that reads answers."""

    def __init__(self, config: CombineConfig) -> None:
        self.config = config
        self.parts: list[tuple[CombinePart, Reward]] = []
        try:
            for part in config.parts:
                self.parts.append((part, part.reward.build()))
        except BaseException:
            self.close()
            raise

    def _score_part(self, part: CombinePart, reward: Reward, items: Sequence[RewardInput]) -> RewardScores:
        what = f"part {part.metric_name!r} (reward {part.reward.name!r}) of reward 'combine'"
        return score_nested(reward, items, what)

    def score_with_parts(self, items: Sequence[RewardInput]) -> RewardScores:
        if not items:
            return RewardScores(scores=[], parts={p.metric_name: [] for p, _ in self.parts})
        workers = self.config.num_workers or len(self.parts)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="combine") as pool:
            futures = [pool.submit(self._score_part, part, reward, items) for part, reward in self.parts]
            results = [f.result() for f in futures]
        totals = [0.0] * len(items)
        parts: dict[str, list[float | None]] = {}
        for (part, _), result in zip(self.parts, results):
            values = [float(x) for x in result.scores]
            for i, v in enumerate(values):
                totals[i] += part.weight * v
            parts[part.metric_name] = values
            for name, sub in result.parts.items():
                parts[f"{part.metric_name}/{name}"] = [None if x is None else float(x) for x in sub]
        answers = next((r.answers for r in results if r.answers is not None), None)
        return RewardScores(scores=totals, parts=parts, answers=answers)

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return self.score_with_parts(items).scores

    def close(self) -> None:
        for _, reward in self.parts:
            reward.close()


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    register(
        "combine",
        CombinedReward,
        description="Weighted sum of other rewards, scored concurrently, each part reported as a metric",
        config_cls=CombineConfig,
    )
    register(
        "workflow",
        WorkflowReward,
        description="The reward the rollout workflow assigned to each sample (an environment's outcome)",
        config_cls=WorkflowRewardConfig,
    )
