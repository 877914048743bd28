"""The worker side of the ``verifiers`` plugin: runs in verifiers' own venv (never imported by
core-rl; standard library and verifiers only), served by :mod:`core_rl_server_kit.worker_loop`.

It loads a verifiers (``verifiers.v1``) taskset and the ``Env`` that plays it, then maps them onto
core-rl's environment contract turn by turn:

- ``rows()``: one row per task of the taskset (``{"prompt": its system prompt and prompt as text,
  "verifiers_idx": its index, "verifiers_key": its key}``);
- ``reset(episode, row)``: the task of the row's index, and the ``Env``'s own ``run(task, agents)``
  started, in which the trained policy plays the role ``role``: each time that ``run`` hands the
  role a turn (``interaction.turn(message)`` or ``agent.run(task)``), the message becomes the
  observation and the ``run`` waits for the policy's reply;
- ``step(episode, text, turn)``: the reply is recorded on the role's trace as the assistant's
  message and handed back to the ``run``, which goes on to its next turn (``[observation, 0,
  False, {}]``) or ends; then the task's own ``@vf.reward`` functions score the trace (and whatever
  the ``run`` recorded on it, e.g. an OpenEnv reward) and the trajectory is done with
  ``trace.reward``, the weighted sum;
- ``close(episode)``: the ``run`` is cancelled if it is still going.

A role's harness (a program started in a runtime, with its own tools) is not run: the policy's
turn is one sampled reply. Roles other than ``role`` would need a model of their own and are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects import parse_message
from verifiers.v1.graph import prepare_turn
from verifiers.v1.trace import AgentInfo, TraceTask


def message_text(message: Any) -> str:
    """A message's (or a turn's messages') text, images dropped."""
    if message is None:
        return ""
    if isinstance(message, str):
        return message
    if isinstance(message, list):
        return "\n\n".join(message_text(m) for m in message)
    content = message.get("content") if isinstance(message, dict) else message.content
    return vf.types.content_text(content) if not isinstance(content, str) else content


def prompt_messages(data: Any) -> list[Any]:
    """The messages a task opens with: its system prompt, then its prompt."""
    messages: list[Any] = []
    if data.system_prompt:
        messages.append(vf.SystemMessage(content=data.system_prompt))
    if isinstance(data.prompt, str):
        messages.append(vf.UserMessage(content=data.prompt))
    elif data.prompt:
        messages.extend(data.prompt)
    return messages


class Episode:
    """One trajectory: the ``Env``'s ``run`` as a task, talking to the policy through two queues."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self.asks: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()  # ("turn", text) or ("end", reward info)
        self.replies: asyncio.Queue[str] = asyncio.Queue()
        self.run: asyncio.Task[None] | None = None

    async def next_event(self) -> tuple[str, Any]:
        """The ``run``'s next turn for the policy, or its end (its exception re-raised)."""
        assert self.run is not None
        getter = asyncio.ensure_future(self.asks.get())
        await asyncio.wait({getter, self.run}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        self.run.result()  # raises what the run raised
        if not self.asks.empty():
            return self.asks.get_nowait()
        raise RuntimeError("the verifiers Env's run() ended without handing the policy a turn or a score")


class PolicyInteraction:
    """What ``agent.interaction(task)`` yields: ``turn(message)`` asks the policy (through the
    episode's queues) and records its reply on ``trace``; leaving the context scores the trace."""

    def __init__(self, episode: Episode, task: Any, role: str) -> None:
        self.episode = episode
        self.task = task
        self.trace = vf.Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=AgentInfo(config=vf.AgentConfig(), name=role),
        )
        self.history: list[Any] = prompt_messages(task.data)

    async def turn(self, message: Any = None) -> vf.Segment:
        if message is not None:
            if isinstance(message, str):
                self.history.append(vf.UserMessage(content=message))
            else:  # Messages, typed or as wire dicts (as verifiers' own Interaction accepts them)
                self.history.extend(parse_message(m) if isinstance(m, dict) else m for m in message)
        await self.episode.asks.put(("turn", message_text(message)))
        reply = await self.episode.replies.get()
        response = vf.Response(
            id=f"core-rl-{self.trace.num_turns}",
            created=int(time.time()),
            model="policy",
            message=vf.AssistantMessage(content=reply),
            finish_reason="stop",
        )
        prepare_turn(self.trace, list(self.history)).commit(response)
        self.history.append(response.message)
        return vf.Segment(messages=[response.message])

    async def score(self) -> None:
        """The task's rewards on the finished trace (no runtime: those that need one are skipped)."""
        self.trace.is_completed = True
        self.trace.ok = True
        await self.task.score(self.trace)
        rewards = {name: r.score for name, r in self.trace.rewards.items() if r is not None}
        await self.episode.asks.put(("end", {"reward": self.trace.reward, "rewards": rewards}))


class PolicyAgent:
    """The stand-in for the role the policy plays: ``interaction(task)`` and ``run(task)``."""

    trainable = True

    def __init__(self, episode: Episode, role: str) -> None:
        self.episode, self.name = episode, role

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **_: Any) -> Any:
        interaction = PolicyInteraction(self.episode, task, self.name)
        yield interaction
        await interaction.score()

    async def run(self, task: Any, **_: Any) -> Any:
        async with self.interaction(task) as interaction:
            await interaction.turn()
        return interaction.trace


class OtherRole:
    """A role the policy does not play: it would need a model of its own."""

    def __init__(self, name: str, policy_role: str) -> None:
        self.name, self.policy_role = name, policy_role

    def __getattr__(self, attribute: str) -> Any:
        raise RuntimeError(
            f"the verifiers Env uses its role {self.name!r}, which would need a model of its own; "
            f"core-rl's policy plays only role {self.policy_role!r}"
        )


class Adapter:
    """See the module docstring. ``options``: ``taskset`` (id), ``taskset_options``, ``env`` (an
    ``Env`` id; empty: the taskset's own, else verifiers' single-agent env), ``env_options``, ``role``
    (empty: the env's first role)."""

    def __init__(self, options: dict[str, Any]) -> None:
        config = vf.resolve_env_config(
            {
                **options.get("env_options", {}),
                "id": options.get("env", ""),
                "taskset": {**options.get("taskset_options", {}), "id": options["taskset"]},
            }
        )
        self.env = vf.load_environment(config)
        self.tasks = list(self.env.taskset)
        roles = list(vf.configs.agent.agent_config_fields(config))
        self.role = options.get("role") or roles[0]
        if self.role not in roles:
            raise ValueError(f"role {self.role!r} is not one of the env's roles {roles}")
        self.config = config
        self.episodes: dict[str, Episode] = {}

    async def rows(self) -> list[dict[str, Any]]:
        return [
            {
                "prompt": message_text(prompt_messages(task.data)),
                "verifiers_idx": task.data.idx,
                "verifiers_key": task.key,
            }
            for task in self.tasks
        ]

    def _task(self, row: dict[str, Any]) -> Any:
        idx = row.get("verifiers_idx")
        if not isinstance(idx, int) or not 0 <= idx < len(self.tasks):
            raise ValueError(
                f"the row's verifiers_idx {idx!r} names no task of taskset {self.config.taskset.id!r} "
                f"({len(self.tasks)} tasks); train on the verifiers data source's rows"
            )
        task = self.tasks[idx]
        if row.get("verifiers_key", task.key) != task.key:
            raise ValueError(f"task {idx} of the taskset is not the row's (its key differs): the taskset changed")
        return task

    async def reset(self, episode: str, row: dict[str, Any]) -> str:
        task = self._task(row)
        play = self.episodes[episode] = Episode(task)
        agents = vf.Agents(
            self.config,
            lambda name, _spec: PolicyAgent(play, name) if name == self.role else OtherRole(name, self.role),
        )
        play.run = asyncio.create_task(self._play(task, agents))
        kind, value = await play.next_event()
        if kind != "turn":
            raise RuntimeError("the verifiers Env's run() ended before the policy's first turn")
        return value

    async def _play(self, task: Any, agents: Any) -> None:
        """The ``Env``'s ``setup(agents)`` and ``run(task, agents)``, as verifiers runs an episode
        (its ``finalize``, judgement across several agents' traces, has no traces to judge here)."""
        await self.env.setup(agents)
        await self.env.run(task, agents)

    async def step(self, episode: str, text: str, turn: int) -> list[Any]:
        play = self.episodes.get(episode)
        if play is None:
            raise ValueError(f"no open episode {episode!r} (step before reset, or after the end)")
        await play.replies.put(text)
        kind, value = await play.next_event()
        if kind == "turn":
            return [value, 0.0, False, {}]
        await self.close(episode)
        return ["", float(value["reward"]), True, {"rewards": value["rewards"]}]

    async def close(self, episode: str) -> None:
        play = self.episodes.pop(episode, None)
        if play is not None and play.run is not None and not play.run.done():
            play.run.cancel()
            with contextlib.suppress(BaseException):
                await play.run

    async def shutdown(self) -> None:
        for episode in list(self.episodes):
            await self.close(episode)


async def open_adapter(options: dict[str, Any]) -> Adapter:
    """The entry point :mod:`core_rl_server_kit.worker_loop` calls."""
    return Adapter(options)
