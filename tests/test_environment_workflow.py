"""The ``environment`` workflow on a real tiny model through the rollout controller and the ``hf``
engine: per-turn rewards and their sum; the token budget; several environments chosen per row; a
step past its timeout ends its trajectory; steps run concurrently up to the bound; and its
configuration errors. (That trained tokens are byte-identical to the sampled ones across turns is
a rollout-engine contract test, :func:`core_rl.testing.multi_turn.check_sampled_tokens_are_trained`,
run for ``hf``, vLLM and SGLang by their conformance classes.)"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from core_rl.builtin import environment_workflow as builtin
from core_rl.errors import ConfigError, PluginFault
from core_rl.rollout.environments import StepResult, as_step_result
from core_rl.testing import WorkflowContract
from core_rl.testing.multi_turn import ECHO_PLUGIN, Echo, PromptRow, environment_workflow, roll_out
from core_rl.testing.tiny import build_tiny_model

hf = pytest.importorskip("core_rl_hf.engine")


class TestEnvironmentWorkflowContract(WorkflowContract):
    plugin = builtin
    name = "environment"
    distribution = "core-rl"
    extra_plugins: ClassVar[list[object]] = [ECHO_PLUGIN]
    options: ClassVar[dict[str, Any]] = {"environment": {"name": "echo"}, "max_turns": 2}


@pytest.fixture(scope="module")
def engine_and_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path_factory.mktemp("env_wf") / "model", alphabet="abcdef=:?", seed=0)
    engine = hf.HFRolloutEngine(model, hf.HFRolloutConfig(device="cpu", seed=0))
    yield engine, AutoTokenizer.from_pretrained(model)
    engine.close()


def prompts(tokenizer, **row):
    return [PromptRow(t, tokenizer, **row) for t in ("abc=", "fed=", "aab=", "cde=")]


def test_token_budget_and_environments_chosen_per_row(engine_and_tokenizer) -> None:
    engine, tokenizer = engine_and_tokenizer
    Echo.clear()
    wf = environment_workflow(environments=[{"name": "echo", "turns": 9}], max_turns=9, max_tokens=12)
    wave, _ = roll_out(engine, tokenizer, wf, prompts(tokenizer, env="echo"), n=2, max_new_tokens=3)
    samples = [s for g in wave.groups for s in g]
    assert len(samples) == 8
    for sample in samples:
        assert len(sample.response_ids) <= 12
        assert sample.info["turns"] < 9 and sample.finish_reason == "length"
        assert sample.turn_rewards == [float(k + 1) for k in range(sample.info["turns"])]
    with pytest.raises(ValueError, match=r"'env' column is 'nope', which names none of .*\(echo\)"):
        wf.spec_for({"env": "nope"})


def test_a_slow_step_ends_its_trajectory_and_steps_are_bounded(engine_and_tokenizer) -> None:
    engine, tokenizer = engine_and_tokenizer
    Echo.clear()
    slow = environment_workflow(environment={"name": "echo", "delay": 5.0}, tool_timeout_s=0.2)
    wave, _ = roll_out(engine, tokenizer, slow, prompts(tokenizer), n=2, max_new_tokens=3)
    for sample in (s for g in wave.groups for s in g):
        assert sample.info["turns"] == 1 and sample.info["steps"][0]["timeout"] and sample.reward == 0.0
    Echo.clear()
    bounded = environment_workflow(environment={"name": "echo", "delay": 0.05}, max_concurrent_steps=2)
    roll_out(engine, tokenizer, bounded, prompts(tokenizer), n=4, max_new_tokens=3)
    assert Echo.most == 2  # 16 trajectories of 3 steps, never more than 2 steps at once


def test_configuration_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.workflow.*exactly one of environment"):
        environment_workflow(max_turns=2)
    with pytest.raises(ConfigError, match=r"rollout\.workflow.*exactly one of environment"):
        environment_workflow(environment={"name": "echo"}, environments=[{"name": "echo"}])
    with pytest.raises(ConfigError, match=r"train_turns"):
        environment_workflow(environment={"name": "echo"}, train_turns="first")
    with pytest.raises(ConfigError, match=r"rollout\.workflow\.environment.*nope"):
        environment_workflow(environment={"name": "nope"})


def test_what_a_step_returns_is_checked() -> None:
    assert as_step_result(("obs", 1, 0, {}), "env 'x'") == StepResult("obs", 1.0, False, {})
    for bad, what in [
        ("obs", r"str .obs."),
        ((1, 0.0, True, {}), r"observation of type int"),
        (("", float("nan"), True, {}), r"reward nan"),
        (("", True, True, {}), r"reward True"),
        (("", 0.0, True, []), r"info of type list"),
    ]:
        with pytest.raises(PluginFault, match=rf"env 'x' returned .*{what}.*Environment\.step returns"):
            as_step_result(bad, "env 'x'")


class _FirstFails:
    """Environment ``first_fails``: the first instance built raises in ``reset``; the others wait
    in ``reset`` for a minute, and record being cancelled."""

    built: ClassVar[int] = 0
    cancelled: ClassVar[int] = 0

    def __init__(self) -> None:
        self.index = _FirstFails.built
        _FirstFails.built += 1

    async def reset(self, row: Any) -> str:
        import asyncio

        if self.index == 0:
            raise RuntimeError("no sandbox left")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            _FirstFails.cancelled += 1
            raise
        return "?"

    async def step(self, action: Any) -> StepResult:
        return StepResult("", 0.0, True, {})

    async def close(self) -> None:
        pass


class _FirstFailsPlugin:
    from core_rl.hookspecs import hookimpl

    @hookimpl
    def core_rl_register_environments(self, register: Any) -> None:
        register("first_fails", lambda c: _FirstFails(), description="test: the first instance fails")


def test_a_failed_trajectory_cancels_the_rest_of_its_group() -> None:
    """One trajectory's environment raises: the group fails with the error naming it at once, and
    its other trajectories are cancelled, not left running on the loop."""
    import asyncio
    import time
    from types import SimpleNamespace

    from core_rl.interfaces import SamplingParams
    from core_rl.rollout.workflows import WorkflowContext

    wf = environment_workflow(environment={"name": "first_fails"}, plugins=[_FirstFailsPlugin()])
    _FirstFails.built = _FirstFails.cancelled = 0

    async def generate(*args: Any, **kwargs: Any) -> list:
        raise AssertionError("no trajectory gets as far as generating")

    async def main() -> list[asyncio.Task]:
        ctx = WorkflowContext(generate=generate, sampling=SamplingParams(n=4, max_new_tokens=3))
        prompt = SimpleNamespace(row={}, prompt_ids=[1, 2], text="x", media=None)
        with pytest.raises(PluginFault, match=r"first_fails.*reset raised RuntimeError: no sandbox left"):
            await wf.run(prompt, ctx)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    started = time.monotonic()
    assert asyncio.run(main()) == []
    assert time.monotonic() - started < 30
    assert _FirstFails.built == 4 and _FirstFails.cancelled == 3


def test_gather_group_keeps_order_and_reports_the_first_failure() -> None:
    import asyncio

    from core_rl.rollout.workflows import gather_group

    ended: list[str] = []

    async def after(delay: float, value: Any = None, error: Exception | None = None) -> Any:
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            ended.append(f"cancelled {delay}")
            raise
        if error is not None:
            raise error
        return value

    assert asyncio.run(gather_group([after(0.03, "a"), after(0.01, "b"), after(0.0, "c")])) == ["a", "b", "c"]
    assert asyncio.run(gather_group([])) == []

    async def failing() -> list:
        group = [after(0.01, error=ValueError("first")), after(0.05, error=KeyError("second")), after(5, "slow")]
        with pytest.raises(ValueError, match="first"):
            await gather_group(group)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(failing()) == []
    assert sorted(ended) == ["cancelled 0.05", "cancelled 5"]
