"""The ``environment`` workflow on a real tiny model through the rollout controller and the ``hf``
engine: the tokens of a trajectory are byte-identical to those the engine sampled, turn after turn,
with the environment's observations (tokenised once, masked) in between; per-turn rewards and their
sum; the token budget; several environments chosen per row; a step past its timeout ends its
trajectory; steps run concurrently up to the bound; and its configuration errors."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import attrs
import pytest
from core_rl.builtin import environment_workflow
from core_rl.config.schema import ControllerConfig, PluginSpec
from core_rl.config.sections import validate_plugin_section
from core_rl.environments import Action, Environment, StepResult
from core_rl.errors import ConfigError
from core_rl.hookspecs import hookimpl
from core_rl.interfaces import SamplingParams
from core_rl.kinds import WORKFLOW
from core_rl.plugins import PluginHost
from core_rl.protocol import samples_to_batch
from core_rl.rollout_controller import RolloutController
from core_rl.tiny import build_tiny_model

hf = pytest.importorskip("core_rl_hf.engine")

ALPHABET = "abcdef=:?<>"


class Echo(Environment):
    """Replies ``":" * (turn + 1)`` and pays ``turn + 1`` per turn; done after ``turns`` turns.
    Records what it saw (every instance in ``made``)."""

    made: ClassVar[list[Echo]] = []
    running: ClassVar[int] = 0
    most: ClassVar[int] = 0

    def __init__(self, turns: int, delay: float) -> None:
        self.turns, self.delay = turns, delay
        self.actions: list[Action] = []
        self.observations: list[str] = []
        Echo.made.append(self)

    async def reset(self, row) -> str:
        self.observations.append("?")
        return "?"

    async def step(self, action: Action) -> StepResult:
        Echo.running += 1
        Echo.most = max(Echo.most, Echo.running)
        try:
            await asyncio.sleep(self.delay)
        finally:
            Echo.running -= 1
        self.actions.append(action)
        reply = ":" * (action.turn + 1)
        self.observations.append(reply)
        return StepResult(reply, float(action.turn + 1), action.turn + 1 >= self.turns, {"seen": action.text})


@attrs.define
class EchoConfig:
    turns: int = 3
    delay: float = 0.0


class Plugin:
    @hookimpl
    def core_rl_register_environments(self, register) -> None:
        register("echo", lambda c: Echo(c.turns, c.delay), config_cls=EchoConfig, description="test: echoes")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("env_wf") / "model", alphabet=ALPHABET, seed=0)


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def host() -> PluginHost:
    h = PluginHost(entry_points=[])
    h.register_plugin(environment_workflow, distribution="core-rl")
    h.register_plugin(Plugin(), distribution="test-env")
    return h


def workflow(**options: Any):
    spec = PluginSpec(name="environment", options=options)
    validate_plugin_section(host(), WORKFLOW, spec, "rollout.workflow")
    return spec.build()


class Prompt:
    def __init__(self, text: str, tokenizer, **row: Any) -> None:
        self.text, self.row, self.prompt_ids = text, {"prompt": text, **row}, tokenizer.encode(text)


class Data:
    def __init__(self, prompts) -> None:
        self.prompts, self.position = prompts, 0

    def next_batch(self):
        out = self.prompts[self.position : self.position + 4]
        self.position += 4
        return out

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state) -> None:
        self.position = state["position"]


class Recording:
    """The hf engine, recording each (context, sampled ids) it returned."""

    def __init__(self, engine) -> None:
        self.engine, self.sampled = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, sampling):
        groups = self.engine.generate(prompts, sampling)
        for prompt, group in zip(prompts, groups):
            self.sampled += [(tuple(prompt), tuple(s.response_ids)) for s in group]
        return groups

    async def agenerate(self, prompt_ids, sampling):
        group = await self.engine.agenerate(prompt_ids, sampling)
        self.sampled += [(tuple(prompt_ids), tuple(s.response_ids)) for s in group]
        return group


def rollout(model, tokenizer, wf, prompts, n: int = 2, max_new_tokens: int = 4):
    engine = Recording(hf.HFRolloutEngine(model, hf.HFRolloutConfig(device="cpu", seed=0)))
    sampling = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=1.0)
    controller = RolloutController(
        engine, wf, Data(prompts), sampling, ControllerConfig(wait_timeout_s=120), batch_size=4, tokenizer=tokenizer
    )
    controller.start()
    try:
        wave = controller.take(new_step=True)
    finally:
        controller.close()
        engine.engine.close()
    return wave, engine.sampled


def test_trained_tokens_are_the_sampled_tokens_across_turns(model, tokenizer) -> None:
    Echo.made.clear()
    wf = workflow(environment={"name": "echo", "turns": 3}, max_turns=5, max_tokens=40)
    prompts = [Prompt(t, tokenizer) for t in ("abc=", "fed=", "aab=", "cde=")]
    wave, sampled = rollout(model, tokenizer, wf, prompts)
    samples = [s for group in wave.groups for s in group]
    assert len(samples) == 8 and len(Echo.made) == 8
    by_actions = {tuple(a for act in env.actions for a in act.token_ids): env for env in Echo.made}
    batch = samples_to_batch(samples, [0] * len(samples), tokenizer.pad_token_id)
    for i, sample in enumerate(samples):
        env = by_actions[tuple(t for t, m in zip(sample.response_ids, sample.token_mask) if m)]
        expected, mask = list(sample.prompt_ids), []
        for k, action in enumerate(env.actions):
            inserted = tokenizer.encode(env.observations[k], add_special_tokens=False)
            expected += inserted
            mask += [0] * len(inserted)
            # the engine returned exactly these ids for exactly this context
            assert (tuple(expected), action.token_ids) in sampled
            expected += action.token_ids
            mask += [1] * len(action.token_ids)
        width = len(expected)
        assert batch["input_ids"][i, :width].tolist() == expected
        assert batch["attention_mask"][i].sum() == width
        assert batch["response_mask"][i, len(sample.prompt_ids) : width].tolist() == mask
        assert sample.turn_rewards == [1.0, 2.0, 3.0][: len(env.actions)]
        assert sample.reward == sum(sample.turn_rewards)
        assert sample.info["turns"] == len(env.actions) == 3 and sample.info["done"]


def test_token_budget_and_environments_chosen_per_row(model, tokenizer) -> None:
    Echo.made.clear()
    wf = workflow(
        environments=[{"name": "echo", "turns": 9}],
        max_turns=9,
        max_tokens=12,
    )
    prompts = [Prompt(t, tokenizer, env="echo") for t in ("abc=", "fed=", "aab=", "cde=")]
    wave, _ = rollout(model, tokenizer, wf, prompts, max_new_tokens=3)
    for sample in (s for g in wave.groups for s in g):
        assert len(sample.response_ids) <= 12
        assert sample.info["turns"] < 9 and sample.finish_reason == "length"
    with pytest.raises(ValueError, match=r"'env' column is 'nope', which names none of .*\(echo\)"):
        wf.spec_for({"env": "nope"})


def test_a_slow_step_ends_its_trajectory_and_steps_are_bounded(model, tokenizer) -> None:
    Echo.made.clear()
    Echo.most = 0
    slow = workflow(environment={"name": "echo", "delay": 5.0}, tool_timeout_s=0.2)
    wave, _ = rollout(model, tokenizer, slow, [Prompt("abc=", tokenizer)] * 4)
    for sample in (s for g in wave.groups for s in g):
        assert sample.info["turns"] == 1 and sample.info["steps"][0]["timeout"] and sample.reward == 0.0
    Echo.most = 0
    bounded = workflow(environment={"name": "echo", "delay": 0.05}, max_concurrent_steps=2)
    rollout(model, tokenizer, bounded, [Prompt("abc=", tokenizer)] * 4, n=4)
    assert Echo.most == 2  # 16 trajectories, never more than 2 steps at once


def test_configuration_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.workflow.*exactly one of environment"):
        workflow(max_turns=2)
    with pytest.raises(ConfigError, match=r"rollout\.workflow.*exactly one of environment"):
        workflow(environment={"name": "echo"}, environments=[{"name": "echo"}])
    with pytest.raises(ConfigError, match=r"train_turns"):
        workflow(environment={"name": "echo"}, train_turns="first")
    with pytest.raises(ConfigError, match=r"rollout\.workflow\.environment.*nope"):
        workflow(environment={"name": "nope"})
