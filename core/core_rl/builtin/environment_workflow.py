"""The built-in rollout workflow ``environment``: drives any environment plugin
(:mod:`core_rl.rollout.environments`) turn by turn.

.. code-block:: yaml

    rollout:
      workflow:
        name: environment
        environment: {name: calculator, parser: {name: tags, tag: c, tool: calculator}}
        # or several, chosen per data row by its `env` column:
        # environments: [{name: calculator}, {name: python}]
        max_turns: 3
        max_tokens: 64          # response tokens of a trajectory, observations included
        tool_timeout_s: 10      # one environment step (a tool call) at most this long
        max_concurrent_steps: 8 # steps running at once, across all trajectories
        train_turns: all        # all | last: which model turns train
        turn_reward: sum        # sum | last | per_turn: how the per-turn rewards are paid
        turn_discount: 1.0      # turn k's reward counts turn_discount ** k (k = 0 first)

Per trajectory (``sampling.n`` of them per row, each with its own environment object)::

    obs = reset(row)
    for turn in 0 .. max_turns-1:
        tokens = generate(prompt + response so far + obs)      (obs appended with mask 0)
        obs, r_turn, done, info = step(Action(text, tokens))
        stop when done, or when the token budget is spent

The sampled tokens are appended exactly as the engine returned them (never re-tokenised), with
their log-probs and weight versions; observations are tokenised once and masked from the loss.
An observation may hold images (content parts, :data:`core_rl.rollout.environments.Observation`):
their placeholders are among its masked tokens, and every later turn is generated with the
prompt's images and the observations' so far, in order, which the sample carries
(``Sample.media``) so that training sees the same inputs.
``Sample.turn_rewards`` holds each turn's reward and ``Sample.reward`` their reduction
(``turn_reward``). With ``sum`` or ``last`` the trajectory's return is paid as an outcome reward, so
every trained token of the trajectory shares its advantage. With ``per_turn``, ``Sample.reward`` is
the sum and ``Sample.turn_ends`` marks where each turn ends: the estimators that work per token
(``gae``, ``reinforce_pp``) pay each turn's reward at its turn's last token, so a turn's tokens are
credited with the rewards from that turn on (discounted), not with those of earlier turns; outcome
estimators (``grpo``, ``rloo``) see the sum. ``turn_discount`` ``d`` in (0, 1] scales turn ``k``'s
reward (0-based) by ``d**k`` before any of this, so an answer reached in fewer turns earns more
(AReaL's ``turn_discount``); the recorded steps keep the environment's own rewards.
``train_turns: last`` masks every model turn but the last from the loss (their tokens stay in the
context).

Deadlines: each environment object's ``reset``, ``step`` and ``close`` run on an event loop of its
own, in a daemon thread (:mod:`core_rl.reliability.own_loop`), so an ``async def`` step that blocks (a
``time.sleep``, a blocking socket) cannot freeze the rollout: ``tool_timeout_s`` fires whatever the
environment does. A step (or reset) past ``tool_timeout_s`` ends the trajectory with reward 0, the
turn's ``info["timeout"]`` and the sample's ``info["failed"]`` (a failed episode: see
``algorithm.max_consecutive_failed_steps``); an environment whose loop stays blocked after that is
asked nothing more (not even ``close``). Every call, timeout and error counts in the metrics
``plugins/environment.<name>/calls``, ``timeouts``, ``errors`` (:mod:`core_rl.plugins.tally`). More than
:data:`MAX_STUCK_LOOPS` environments blocked for good at once stop the run with one line naming the
environment (exit status 1).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from core_rl.config.schema import PluginSpec, plugin_section
from core_rl.config.validators import FieldValueError, in_range, one_of, positive
from core_rl.errors import PluginFault
from core_rl.hookspecs import Register, hookimpl
from core_rl.plugins.attribution import built_by
from core_rl.plugins.kinds import ENVIRONMENT
from core_rl.plugins.tally import PLUGIN_TALLY
from core_rl.protocol import Sample
from core_rl.reliability.deadlines import DeadlinePassed
from core_rl.reliability.own_loop import OwnLoop, stuck_loops
from core_rl.reliability.progress import PROGRESS
from core_rl.rollout.environments import Action, Environment, Observation, StepResult, as_step_result, check_observation
from core_rl.rollout.workflows import (
    FAILED,
    RolloutWorkflow,
    WorkflowContext,
    append_observation,
    extend_turn,
    gather_group,
)
from core_rl.vision.media import concat_media

TRAIN_TURNS = ("all", "last")
TURN_REWARDS = ("sum", "last", "per_turn")
#: more environments than this blocked for good at once (their loops stuck) stops the run
MAX_STUCK_LOOPS = 64
#: what :meth:`EnvironmentWorkflow._call` returns for a call past ``tool_timeout_s``
TIMED_OUT = object()


@attrs.define
class EnvironmentWorkflowConfig:
    """See the module docstring. Exactly one of ``environment`` and ``environments``; with
    ``environments``, a row's ``env_key`` column names the environment that serves it."""

    environment: PluginSpec | None = plugin_section(ENVIRONMENT, default=None)  # noqa: RUF009 (an attrs field, like attrs.field)
    environments: list[PluginSpec] = plugin_section(ENVIRONMENT, factory=list)  # noqa: RUF009 (an attrs field, like attrs.field)
    env_key: str = "env"
    max_turns: int = attrs.field(default=4, validator=positive())
    max_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive()))
    tool_timeout_s: float = attrs.field(default=30.0, validator=positive())
    max_concurrent_steps: int = attrs.field(default=16, validator=positive())
    train_turns: str = attrs.field(default="all", validator=one_of(TRAIN_TURNS))
    turn_reward: str = attrs.field(default="sum", validator=one_of(TURN_REWARDS))
    turn_discount: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0, low_open=True))

    def __attrs_post_init__(self) -> None:
        if (self.environment is None) == (not self.environments):
            raise FieldValueError(
                "environment",
                self.environment,
                "set exactly one of environment ({name: ...}) and environments ([{name: ...}, ...])",
            )
        names = [spec.name for spec in self.environments]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise FieldValueError("environments", names, f"must name distinct environments ({', '.join(repeated)})")


def reduce_turn_rewards(rewards: Sequence[float], how: str) -> float:
    """``sum`` and ``per_turn``: the trajectory's undiscounted return; ``last``: the final turn's
    reward (0 if none)."""
    if how in ("sum", "per_turn"):
        return float(sum(rewards))
    return float(rewards[-1]) if rewards else 0.0


def mask_turns(sample: Sample, spans: Sequence[tuple[int, int]], train_turns: str) -> Sample:
    """``sample`` with the model turns ``train_turns`` excludes masked (mask 0, log-prob 0); ``spans``
    are the turns' ``[start, end)`` positions in ``response_ids``."""
    if train_turns == "all" or len(spans) <= 1:
        return sample
    mask, logprobs = list(sample.token_mask or [1] * len(sample.response_ids)), list(sample.logprobs)
    for start, end in spans[:-1]:
        mask[start:end] = [0] * (end - start)
        logprobs[start:end] = [0.0] * (end - start)
    return attrs.evolve(sample, token_mask=mask, logprobs=logprobs)


class EnvironmentWorkflow(RolloutWorkflow):
    """See the module docstring."""

    def __init__(self, config: EnvironmentWorkflowConfig) -> None:
        self.config = config
        specs = [config.environment] if config.environment is not None else config.environments
        self.specs: dict[str, PluginSpec] = {spec.name: spec for spec in specs}
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def spec_for(self, row: Mapping[str, Any]) -> PluginSpec:
        """The environment section serving ``row``."""
        if self.config.environment is not None:
            return self.config.environment
        key = self.config.env_key
        name = row.get(key)
        if name not in self.specs:
            raise ValueError(
                f"a data row's {key!r} column is {name!r}, which names none of rollout.workflow.environments "
                f"({', '.join(self.specs)}); set {key!r} on every row to one of them"
            )
        return self.specs[name]

    def _pool(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._pools:
            self._pools[loop] = asyncio.Semaphore(self.config.max_concurrent_steps)
        return self._pools[loop]

    async def _call(self, env: Environment, own: OwnLoop, metric: str, what: str, coro: Any) -> Any:
        """``await coro`` (the environment's ``what``) on the environment's own loop (``own``,
        :mod:`core_rl.reliability.own_loop`), within the pool and the step timeout, counted in
        :data:`~core_rl.plugins.tally.PLUGIN_TALLY` as ``metric``. A timeout returns :data:`TIMED_OUT`; an
        exception is a :class:`PluginFault` naming the environment; more than
        :data:`MAX_STUCK_LOOPS` environments blocked for good is a :class:`DeadlinePassed`."""
        words = built_by(env)
        timeout = self.config.tool_timeout_s
        async with self._pool():
            if (stuck := stuck_loops()) > MAX_STUCK_LOOPS:
                coro.close()
                raise DeadlinePassed(
                    f"{words}: {stuck} calls of {what} never returned after rollout.workflow.tool_timeout_s="
                    f"{timeout:g} s; the environment blocks for good and the run stops, keeping its last checkpoint"
                )
            try:
                with PROGRESS.call(f"{words}: {what}"):
                    result = await own.run(coro, timeout)
            except TimeoutError:
                note = f"{what} past rollout.workflow.tool_timeout_s={timeout:g} s"
                PLUGIN_TALLY.record(metric, words, timeouts=1, what=note)
                return TIMED_OUT
            except Exception as exc:
                PLUGIN_TALLY.record(metric, words, errors=1)
                raise PluginFault(f"{words}: {what} raised {type(exc).__name__}: {exc}") from exc
            PLUGIN_TALLY.record(metric, words)
            return result

    async def run(self, prompt: Any, ctx: WorkflowContext) -> list[Sample]:
        spec = self.spec_for(prompt.row)
        n = ctx.sampling.n
        return await gather_group([self.trajectory(spec.build(), prompt, ctx, name=spec.name) for _ in range(n)])

    def _encode(self, ctx: WorkflowContext, observation: Observation, env: Environment) -> tuple[list[int], Any]:
        """The token ids of ``observation`` and the pixel inputs of its images (``None``: none,
        :func:`core_rl.vision.prompts.encode_observation`); an image that cannot be read is a
        :class:`PluginFault` naming the environment."""
        if isinstance(observation, str):
            return (list(ctx.tokenizer.encode(observation, add_special_tokens=False)) if observation else []), None
        from core_rl.vision.images import ImageError
        from core_rl.vision.prompts import encode_observation

        try:
            return encode_observation(observation, ctx.tokenizer)
        except ImageError as exc:
            raise PluginFault(
                f"{built_by(env)} returned an observation with an image that cannot be used: {exc}"
            ) from None

    async def trajectory(self, env: Environment, prompt: Any, ctx: WorkflowContext, name: str = "") -> Sample:
        """One trajectory of ``prompt`` in ``env`` (see the module docstring); ``name``: the
        environment's registered name, for its metrics (default: its class name)."""
        cfg = self.config
        budget = cfg.max_tokens if cfg.max_tokens is not None else cfg.max_turns * ctx.sampling.max_new_tokens
        metric = f"environment.{name or type(env).__name__}"
        own = OwnLoop(f"environment {name or type(env).__name__}")
        failed = ""
        try:
            first = await self._call(env, own, metric, "reset", env.reset(prompt.row))
            if first is TIMED_OUT:  # nothing more to ask of it: one model turn, then the end
                failed, first = "reset timed out", ""
            if first:
                first = check_observation(first, built_by(env), "Environment.reset returns an observation")
            pending, pending_media = self._encode(ctx, first or "", env)
            media = getattr(prompt, "media", None)  # the images of the context so far: the prompt's, then observations'
            sample: Sample | None = None
            spans: list[tuple[int, int]] = []
            rewards: list[float] = []
            steps: list[dict[str, Any]] = []
            done, length_cut = False, False
            for turn_index in range(cfg.max_turns):
                used = len(sample.response_ids) if sample is not None else 0
                room = budget - used - len(pending)
                if room <= 0:
                    length_cut = True
                    break
                context = [*prompt.prompt_ids, *(sample.response_ids if sample else []), *pending]
                if pending_media:
                    media = concat_media([media or {}, pending_media])
                sampling = attrs.evolve(ctx.sampling, n=1, max_new_tokens=min(ctx.sampling.max_new_tokens, room))
                (turn,) = await ctx.generate(context, sampling, media=media)
                sample = self._continue(sample, pending, turn, prompt.prompt_ids)
                spans.append((len(sample.response_ids) - len(turn.response_ids), len(sample.response_ids)))
                if failed:
                    rewards.append(0.0)
                    break
                text = ctx.tokenizer.decode(turn.response_ids, skip_special_tokens=True)
                action = Action(text, tuple(turn.response_ids), turn_index, prompt.text, tuple(prompt.prompt_ids))
                raw = await self._call(env, own, metric, "step", env.step(action))
                if raw is TIMED_OUT:
                    failed = "step timed out"
                result = (
                    StepResult("", 0.0, True, {"timeout": True})
                    if raw is TIMED_OUT
                    else as_step_result(raw, built_by(env))
                )
                rewards.append(result.reward * cfg.turn_discount**turn_index)
                steps.append({"text": text, "reward": result.reward, **result.info})
                if result.done:
                    done = True
                    break
                pending, pending_media = self._encode(ctx, result.observation, env)
        finally:
            try:
                if not own.stuck:
                    await self._call(env, own, metric, "close", env.close())
            finally:
                own.close()
        if sample is None:
            raise ValueError(
                f"rollout.workflow.max_tokens ({budget}) leaves no room for a model turn after the environment's "
                f"first observation ({len(pending)} tokens); raise max_tokens"
            )
        sample = mask_turns(sample, spans, cfg.train_turns)
        return attrs.evolve(
            sample,
            media=media,
            reward=reduce_turn_rewards(rewards, cfg.turn_reward),
            turn_rewards=rewards,
            turn_ends=[end for _, end in spans] if cfg.turn_reward == "per_turn" else None,
            finish_reason="length" if length_cut else sample.finish_reason,
            info={"turns": len(spans), "done": done, "steps": steps, **({FAILED: failed} if failed else {})},
        )

    @staticmethod
    def _continue(sample: Sample | None, observation: Sequence[int], turn: Sample, prompt_ids: Sequence[int]) -> Sample:
        """``sample`` (``None``: nothing yet, a trajectory of ``prompt_ids``) with ``observation``
        (masked) and then ``turn`` appended."""
        if sample is None:
            sample = attrs.evolve(
                turn, prompt_ids=list(prompt_ids), response_ids=[], logprobs=[], token_weight_versions=[], token_mask=[]
            )
        if observation:
            sample = append_observation(sample, observation)
        return extend_turn(sample, turn)


def make_environment_workflow(config: EnvironmentWorkflowConfig) -> EnvironmentWorkflow:
    return EnvironmentWorkflow(config)


@hookimpl
def core_rl_register_workflows(register: Register) -> None:
    register(
        "environment",
        make_environment_workflow,
        config_cls=EnvironmentWorkflowConfig,
        description="multi-turn: drive an environment plugin (tools, games) turn by turn; observations masked",
    )
