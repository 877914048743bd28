"""Built-in reward ``route``: each sample is scored by the reward its data row's ``key`` column
selects, so one run can train on several tasks (a math source, a code source) with a reward each.

.. code-block:: yaml

    reward:
      name: route
      key: data_source                 # the column naming each row's task
      routes:
        gsm8k: {name: math, answer_key: answer}
        mbpp: {name: code}
      default: null                    # the reward of any other value; null: such rows are refused

A row whose value is a key of ``routes`` is scored by that reward, any other row by ``default``.
Each routed reward is validated by its own plugin at ``reward.routes.<value>`` (as ``combine``'s
parts are) and sees only its rows; the routes with samples in a call are scored concurrently.
Each route is reported as a part named after its value (``reward/gsm8k/mean``, ``std``, ``min``,
``max`` over the samples routed there; ``default`` for the default's), its reward's own parts as
``<value>/<part>``; a part holds ``None`` for the samples of other routes (left out of its
statistics, so ``reward/<value>/nonfinite`` counts only real NaN/inf scores of that route). The
answers the routed rewards read (``RewardScores.answers``) are passed on.

Before the run (``check_data``, with the other data problems): every row of ``data.train_files``
must hold ``key`` (not null) and a value with a route, or a default; the rows without one are
listed per value with their file and line. Each routed reward's own ``required_columns`` and
``check_data`` apply to the rows routed to it alone. The rows of ``eval.files`` are checked the
same way (preflight runs the reward's ``check_data`` on them too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs

from core_rl.builtin.rewards import score_nested
from core_rl.config.checks import (
    EnvironmentContext,
    SectionContext,
    config_problems,
    data_problems,
    environment_problems,
    required_columns,
)
from core_rl.config.schema import PluginSpec, plugin_section
from core_rl.config.validators import FieldValueError, non_negative, not_empty
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Reward, RewardScores
from core_rl.plugins.kinds import REWARD
from core_rl.protocol import RewardInput

if TYPE_CHECKING:
    from core_rl.data.files import DataRow

#: the part name of the default route's scores
DEFAULT = "default"


@attrs.define
class RouteConfig:
    """``key``: the data column naming each row's route; ``routes``: value -> reward section;
    ``default``: the reward section of every other value (``null``: such rows are refused before
    the run); ``num_workers``: routes scored at once (0: all of them)."""

    key: str = attrs.field(default="data_source", validator=not_empty())
    routes: dict[str, PluginSpec] = plugin_section(REWARD, factory=dict)  # noqa: RUF009 (an attrs field)
    default: PluginSpec | None = plugin_section(REWARD, default=None)  # noqa: RUF009 (an attrs field)
    num_workers: int = attrs.field(default=0, validator=non_negative())

    def __attrs_post_init__(self) -> None:
        if not self.routes and self.default is None:
            need = "must map at least one value to a reward ({value: {name: ...}})"
            raise FieldValueError("routes", self.routes, need)
        if self.default is not None and DEFAULT in self.routes:
            raise FieldValueError(
                "routes", sorted(self.routes), f"must not name a route {DEFAULT!r} beside default (both report as it)"
            )

    def named_sections(self) -> list[tuple[str, PluginSpec, str]]:
        """``(part name, section, its key below this section)`` of every route, the default last."""
        named = [(value, spec, f"routes.{value}") for value, spec in self.routes.items()]
        if self.default is not None:
            named.append((DEFAULT, self.default, "default"))
        return named

    def sections(self, context: SectionContext) -> list[tuple[str, PluginSpec, SectionContext]]:
        """``(part name, section, its context)`` of every route, the default last."""
        return [
            (part, spec, attrs.evolve(context, path=context.key(key), name=spec.name))
            for part, spec, key in self.named_sections()
        ]

    def route_of(self, row: Any) -> str | None:
        """The part name of the route that scores ``row`` (a mapping), or ``None`` for none."""
        value = row.get(self.key)
        if isinstance(value, str) and value in self.routes:
            return value
        return DEFAULT if self.default is not None else None

    def check_config(self, context: SectionContext) -> list[str]:
        return [line for _, spec, ctx in self.sections(context) for line in config_problems(spec.config, ctx)]

    def check_environment(self, context: EnvironmentContext) -> list[str]:
        return [line for _, spec, ctx in self.sections(context) for line in environment_problems(spec.config, ctx)]

    def required_columns(self) -> list[str]:
        """The route column, on every row (each route's own columns: :meth:`check_data`, on its rows)."""
        return [self.key]

    def check_data(self, rows: Sequence[DataRow], context: SectionContext) -> list[str]:
        """Rows whose value has no route (listed per value), and each route's own columns and
        ``check_data`` on the rows routed to it."""
        from core_rl.data.files import MAX_PROBLEMS_PER_FILE, Problems
        from core_rl.data.prompts import missing_column_problems  # the trainer's data module: preflight only

        routed: dict[str, list[DataRow]] = {}
        unrouted: dict[str, list[DataRow]] = {}
        for r in rows:
            if r.row.get(self.key) is None:
                continue  # reported as a missing column (required_columns)
            route = self.route_of(r.row)
            if route is None:
                unrouted.setdefault(repr(r.row[self.key]), []).append(r)
            else:
                routed.setdefault(route, []).append(r)
        problems = Problems()
        for value, where in unrouted.items():
            shown = ", ".join(r.where for r in where[1 : 1 + MAX_PROBLEMS_PER_FILE])
            more = len(where) - 1 - MAX_PROBLEMS_PER_FILE
            also = f" (also {shown}{f' and {more} more' if more > 0 else ''})" if shown else ""
            problems.add(
                where[0].file,
                f"{where[0].where}: column {self.key!r} is {value}{also}, which {context.key('routes')} has no route "
                f"for and there is no {context.key('default')}; add a route for it, or set a default",
            )
        lines = problems.result()
        for part, spec, ctx in self.sections(context):
            mine = routed.get(part, [])
            readers = {c: f"reward {spec.name!r} ({ctx.path})" for c in required_columns(spec.config)}
            own = Problems()
            missing_column_problems(mine, readers, own, remedy=f"add it to the rows routed to {ctx.path}")
            lines += own.result() + data_problems(spec.config, mine, ctx)
        return lines


class RouteReward(Reward):
    """Scores each item by the reward of its row's route (see the module docstring)."""

    def __init__(self, config: RouteConfig) -> None:
        self.config = config
        self.rewards: dict[str, tuple[PluginSpec, Reward]] = {}
        try:
            for part, spec, _ in config.named_sections():
                self.rewards[part] = (spec, spec.build())
        except BaseException:
            self.close()
            raise

    def _groups(self, items: Sequence[RewardInput]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        unrouted = []
        for i, item in enumerate(items):
            route = self.config.route_of(item.row)
            if route is None:
                unrouted.append(item.row.get(self.config.key))
            else:
                groups.setdefault(route, []).append(i)
        if unrouted:
            values = ", ".join(sorted({repr(v) for v in unrouted}))
            raise ValueError(
                f"reward 'route': {len(unrouted)} of {len(items)} items have no route for column "
                f"{self.config.key!r} ({values}) and there is no default; add routes, or set reward.default"
            )
        return groups

    def score_with_parts(self, items: Sequence[RewardInput]) -> RewardScores:
        groups = self._groups(items)
        workers = self.config.num_workers or max(len(groups), 1)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="route") as pool:
            futures = {
                part: pool.submit(
                    score_nested,
                    self.rewards[part][1],
                    [items[i] for i in indices],
                    f"route {part!r} (reward {self.rewards[part][0].name!r}) of reward 'route'",
                )
                for part, indices in groups.items()
            }
            results = {part: f.result() for part, f in futures.items()}
        scores: list[Any] = [math.nan] * len(items)
        parts: dict[str, list[float | None]] = {part: [None] * len(items) for part in self.rewards}
        for part, result in results.items():
            for name, values in [(part, result.scores), *((f"{part}/{n}", v) for n, v in result.parts.items())]:
                column = parts.setdefault(name, [None] * len(items))
                for i, value in zip(groups[part], values):
                    column[i] = value
            for i, value in zip(groups[part], result.scores):
                scores[i] = value
        answers: list[str | None] = [None] * len(items)
        for part, result in results.items():
            for i, answer in zip(groups[part], result.answers or ()):
                answers[i] = answer
        read = any(result.answers is not None for result in results.values())
        return RewardScores(scores=scores, parts=parts, answers=answers if read else None)

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return self.score_with_parts(items).scores

    def close(self) -> None:
        for _, reward in self.rewards.values():
            reward.close()


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    register(
        "route",
        RouteReward,
        description="Each sample scored by the reward its data row's column selects (one reward per task)",
        config_cls=RouteConfig,
    )
