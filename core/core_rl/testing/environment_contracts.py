"""Contract test classes of environments and tool-call parsers (see :mod:`core_rl.testing`).

An environment's tests set ``episodes``: scripted trajectories ``(row, actions, rewards)``: the
model's turns as text and the reward each step must return; the last action must end the
trajectory (``done``), no earlier one may. A parser's tests set ``calls`` (calls its format can
express: each must survive ``parse(format_call(call))``) and ``malformed`` (texts that must parse
into errors, not exceptions).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import pytest

from core_rl.plugins.kinds import ENVIRONMENT, TOOL_PARSER
from core_rl.rollout.environments import Action, Environment, StepResult, as_step_result
from core_rl.rollout.tool_parsers import ParsedTurn, ToolCall, ToolParser
from core_rl.testing.contracts import ComponentContract

#: one scripted trajectory: the data row, the model's turns, the reward of each step
Episode = tuple[Mapping[str, Any], Sequence[str], Sequence[float]]


async def play(env: Environment, row: Mapping[str, Any], actions: Sequence[str]) -> list[StepResult]:
    """Reset ``env`` with ``row`` and step it through ``actions``; every result checked."""
    first = await env.reset(row)
    assert isinstance(first, str), f"Environment.reset returned {type(first).__name__}, not the observation text"
    results = []
    try:
        for i, text in enumerate(actions):
            raw = await env.step(Action(text, tuple(range(len(text))), i, str(row.get("prompt", ""))))
            results.append(as_step_result(raw, type(env).__name__))
    finally:
        await env.close()
    return results


class EnvironmentContract(ComponentContract):
    """Set ``episodes`` (module docstring); ``extra_plugins`` for the rewards or parsers its options
    select. ``fuzz_examples``: how many arbitrary texts a fresh environment must answer without
    raising."""

    kind = ENVIRONMENT
    episodes: ClassVar[list[Episode]] = []
    fuzz_examples: ClassVar[int] = 25

    def build(self) -> Environment:
        return self.entry().factory(self.config())

    def test_factory_builds_a_fresh_environment_per_trajectory(self) -> None:
        a, b = self.build(), self.build()
        try:
            assert a is not b, "the factory runs once per trajectory and must return a new environment each time"
            for env in (a, b):
                assert isinstance(env, Environment) or all(hasattr(env, m) for m in ("reset", "step", "close"))
                assert inspect.iscoroutinefunction(env.reset) and inspect.iscoroutinefunction(env.step)
        finally:
            for env in (a, b):  # closing one that was never reset is part of the contract too
                asyncio.run(env.close())

    def test_scripted_episodes(self) -> None:
        if not self.episodes:
            pytest.skip("no episodes given")
        for row, actions, rewards in self.episodes:
            results = asyncio.run(play(self.build(), row, actions))
            assert [r.reward for r in results] == pytest.approx(list(rewards)), (row, actions)
            assert [r.done for r in results] == [False] * (len(actions) - 1) + [True], (row, actions)
            assert all(isinstance(json.dumps(r.info, default=str), str) for r in results)

    def test_concurrent_trajectories_do_not_share_state(self) -> None:
        """All episodes at once, each in its own environment, give what each gives alone."""
        if not self.episodes:
            pytest.skip("no episodes given")

        async def together() -> list[list[StepResult]]:
            return list(await asyncio.gather(*(play(self.build(), row, acts) for row, acts, _ in self.episodes)))

        alone = [asyncio.run(play(self.build(), row, acts)) for row, acts, _ in self.episodes]
        assert [[(r.observation, r.reward, r.done) for r in ep] for ep in asyncio.run(together())] == [
            [(r.observation, r.reward, r.done) for r in ep] for ep in alone
        ]

    def test_arbitrary_text_is_answered_not_raised(self) -> None:
        """Whatever a model writes (malformed calls, unknown tools, binary junk) is an observation."""
        from hypothesis import given, settings
        from hypothesis import strategies as st

        row = self.episodes[0][0] if self.episodes else {}

        @settings(max_examples=self.fuzz_examples, deadline=None)
        @given(st.text(max_size=60))
        def check(text: str) -> None:
            asyncio.run(play(self.build(), row, [text]))

        check()


def default_calls():
    """Hypothesis strategy of tool calls: identifier names, arguments of JSON scalars."""
    from hypothesis import strategies as st

    names = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True)
    scalars = st.one_of(st.integers(-(10**9), 10**9), st.text(max_size=20), st.booleans(), st.none())
    arguments = st.dictionaries(names, scalars, max_size=3)
    return st.builds(ToolCall, names, arguments)


class ToolParserContract(ComponentContract):
    """Set ``calls`` and ``malformed`` (module docstring); ``call_strategy`` (a function returning a
    hypothesis strategy of the calls the format expresses: default :func:`default_calls`) drives the
    round-trip property."""

    kind = TOOL_PARSER
    calls: ClassVar[list[ToolCall]] = []
    malformed: ClassVar[list[str]] = []
    call_strategy: ClassVar[Any] = staticmethod(default_calls)

    def build(self) -> ToolParser:
        parser = self.entry().factory(self.config())
        assert isinstance(parser, ToolParser) or all(hasattr(parser, m) for m in ("parse", "format_call"))
        return parser

    def test_formatted_calls_parse_back(self) -> None:
        parser = self.build()
        for call in self.calls:
            text = parser.format_call(call)
            assert parser.parse(text).calls == (call,), text
            two = parser.parse(text + ";" + text if "{" == text[:1] else text + text)
            assert two.calls == (call, call), text

    def test_round_trip_property(self) -> None:
        from hypothesis import given, settings

        parser = self.build()

        @settings(max_examples=60, deadline=None)
        @given(self.call_strategy())
        def check(call: ToolCall) -> None:
            parsed = parser.parse(parser.format_call(call))
            assert parsed.calls == (call,) and not parsed.errors

        check()

    def test_malformed_calls_are_errors_not_exceptions(self) -> None:
        parser = self.build()
        for text in self.malformed:
            parsed = parser.parse(text)
            assert isinstance(parsed, ParsedTurn) and parsed.errors and not parsed.calls, text

    def test_any_text_parses_without_raising(self) -> None:
        from hypothesis import given, settings
        from hypothesis import strategies as st

        parser = self.build()

        @settings(max_examples=80, deadline=None)
        @given(st.text(max_size=80))
        def check(text: str) -> None:
            assert isinstance(parser.parse(text), ParsedTurn)

        check()
