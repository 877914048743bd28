"""Multi-turn rollouts on a real rollout engine, for the engine contracts and the workflow's tests:
the :class:`Echo` environment (registered by :data:`ECHO_PLUGIN`), an engine wrapper recording what
it sampled, and :func:`check_sampled_tokens_are_trained`, which runs the ``environment`` workflow
through the rollout controller and checks that every trajectory's batch row is exactly the prompt,
then each observation's ids and each turn's ids as the engine returned them for that very context
(no re-tokenisation of earlier turns)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from core_rl.hookspecs import hookimpl
from core_rl.rollout.environments import Action, Environment, StepResult


class Echo(Environment):
    """Starts with ``"?"``, replies ``":" * (turn + 1)`` and pays ``turn + 1`` per turn; done after
    ``turns`` turns; each step takes ``delay`` seconds. Every instance is kept in ``made``, with
    what it saw; ``most`` is the most steps that ran at once."""

    made: ClassVar[list[Echo]] = []
    running: ClassVar[int] = 0
    most: ClassVar[int] = 0
    #: each instance runs on an event loop of its own, in a thread of its own (core_rl/reliability/own_loop.py)
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, turns: int = 3, delay: float = 0.0) -> None:
        self.turns, self.delay = turns, delay
        self.actions: list[Action] = []
        self.observations: list[str] = []
        Echo.made.append(self)

    @classmethod
    def clear(cls) -> None:
        cls.made.clear()
        cls.most = 0

    async def reset(self, row: Any) -> str:
        self.observations.append("?")
        return "?"

    async def step(self, action: Action) -> StepResult:
        with Echo._lock:
            Echo.running += 1
            Echo.most = max(Echo.most, Echo.running)
        try:
            await asyncio.sleep(self.delay)
        finally:
            with Echo._lock:
                Echo.running -= 1
        self.actions.append(action)
        reply = ":" * (action.turn + 1)
        self.observations.append(reply)
        return StepResult(reply, float(action.turn + 1), action.turn + 1 >= self.turns, {"seen": action.text})


@attrs.define
class EchoConfig:
    turns: int = 3
    delay: float = 0.0


class _EchoPlugin:
    @hookimpl
    def core_rl_register_environments(self, register: Any) -> None:
        register("echo", lambda c: Echo(c.turns, c.delay), config_cls=EchoConfig, description="test: echoes turns")


#: registers the ``echo`` environment
ECHO_PLUGIN = _EchoPlugin()


def environment_workflow(*, plugins: Sequence[object] = (), **options: Any) -> Any:
    """The built-in ``environment`` workflow with ``options`` (validated as ``rollout.workflow``;
    the ``echo`` environment is available, and those ``plugins`` register)."""
    from core_rl.builtin import environment_workflow as builtin
    from core_rl.config.schema import PluginSpec
    from core_rl.config.sections import validate_plugin_section
    from core_rl.plugins.host import PluginHost
    from core_rl.plugins.kinds import WORKFLOW

    host = PluginHost(entry_points=[])
    host.register_plugin(builtin, distribution="core-rl")
    for plugin in (ECHO_PLUGIN, *plugins):
        host.register_plugin(plugin, distribution="core-rl (testing)")
    spec = PluginSpec(name="environment", options=options)
    validate_plugin_section(host, WORKFLOW, spec, "rollout.workflow")
    return spec.build()


class PromptRow:
    """A prompt as the controller hands it to a workflow (``row``, ``text``, ``prompt_ids``)."""

    def __init__(self, text: str, tokenizer: Any, **row: Any) -> None:
        self.text, self.row, self.prompt_ids = text, {"prompt": text, **row}, list(tokenizer.encode(text))


class PromptList:
    """Data of the controller: ``prompts`` in batches of ``batch_size``."""

    def __init__(self, prompts: list[PromptRow], batch_size: int) -> None:
        self.prompts, self.batch_size, self.position = prompts, batch_size, 0

    def next_batch(self) -> list[PromptRow]:
        out = self.prompts[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return out

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class Recording:
    """``engine``, recording each ``(context, sampled ids)`` its ``generate``/``agenerate`` returned
    (the pixel inputs of a vision-language model's prompts, ``media=``, go to the engine)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.sampled = engine, set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, prompts: Any, sampling: Any, **media: Any) -> Any:
        groups = self.engine.generate(prompts, sampling, **media)
        for prompt, group in zip(prompts, groups):
            self.sampled |= {(tuple(prompt), tuple(s.response_ids)) for s in group}
        return groups

    async def agenerate(self, prompt_ids: Any, sampling: Any, **media: Any) -> Any:
        group = await self.engine.agenerate(prompt_ids, sampling, **media)
        self.sampled |= {(tuple(prompt_ids), tuple(s.response_ids)) for s in group}
        return group


def roll_out(engine: Any, tokenizer: Any, workflow: Any, prompts: list[PromptRow], *, n: int, max_new_tokens: int):
    """One generation batch of ``prompts`` through a real :class:`~core_rl.rollout.controller.RolloutController`;
    returns ``(wave, what the engine sampled)``. The engine stays open."""
    from core_rl.config.schema import ControllerConfig
    from core_rl.interfaces import SamplingParams
    from core_rl.rollout.controller import RolloutController

    recording = Recording(engine)
    sampling = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=1.0)
    controller = RolloutController(
        recording,
        workflow,
        PromptList(prompts, len(prompts)),
        sampling,
        ControllerConfig(wait_timeout_s=300),
        batch_size=len(prompts),
        tokenizer=tokenizer,
    )
    controller.start()
    try:
        return controller.take(new_step=True), recording.sampled
    finally:
        controller.close()


def check_sampled_tokens_are_trained(engine: Any, tokenizer: Any, texts: list[str], *, turns: int = 3) -> None:
    """See the module docstring: ``texts`` as prompts, 2 trajectories each, ``turns`` turns."""
    from core_rl.protocol import samples_to_batch

    Echo.clear()
    workflow = environment_workflow(environment={"name": "echo", "turns": turns}, max_turns=turns + 2)
    wave, sampled = roll_out(
        engine, tokenizer, workflow, [PromptRow(t, tokenizer) for t in texts], n=2, max_new_tokens=4
    )
    samples = [s for group in wave.groups for s in group]
    assert len(samples) == 2 * len(texts) == len(Echo.made)
    by_actions = {tuple(t for a in env.actions for t in a.token_ids): env for env in Echo.made}
    batch = samples_to_batch(samples, [0] * len(samples), tokenizer.pad_token_id)
    for i, sample in enumerate(samples):
        env = by_actions[tuple(t for t, m in zip(sample.response_ids, sample.token_mask) if m)]
        expected, mask = list(sample.prompt_ids), []
        for k, action in enumerate(env.actions):
            inserted = list(tokenizer.encode(env.observations[k], add_special_tokens=False))
            expected += inserted
            mask += [0] * len(inserted)
            assert (tuple(expected), action.token_ids) in sampled, f"turn {k} is not what the engine sampled there"
            expected += action.token_ids
            mask += [1] * len(action.token_ids)
        assert batch["input_ids"][i, : len(expected)].tolist() == expected
        assert int(batch["attention_mask"][i].sum()) == len(expected)
        assert batch["response_mask"][i, len(sample.prompt_ids) : len(expected)].tolist() == mask
        assert sample.turn_rewards == [float(k + 1) for k in range(turns)] and sample.reward == sum(sample.turn_rewards)
        assert sample.info["turns"] == len(env.actions) == turns and sample.info["done"]


class MultiTurnEngineTests:
    """Mixed into :class:`~core_rl.testing.RolloutEngineContract` (the ``engine`` and ``model_path``
    fixtures are its own)."""

    def test_multi_turn_trajectories_train_exactly_the_sampled_tokens(self, engine: Any, model_path: Any) -> None:
        """The ``environment`` workflow through the rollout controller on this engine: the batch row of
        each trajectory is the prompt, then per turn the observation's ids and the ids the engine
        sampled for exactly that context (:func:`check_sampled_tokens_are_trained`)."""
        from transformers import AutoTokenizer

        check_sampled_tokens_are_trained(engine, AutoTokenizer.from_pretrained(model_path), ["abc=", "xyz="])
