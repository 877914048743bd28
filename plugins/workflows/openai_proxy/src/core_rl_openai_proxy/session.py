"""A session: the calls of one agent episode, grouped into trajectories.

Each call's prompt either continues the session's current trajectory (its exact prompt and
sampled ids, then the inserted tokens: :mod:`core_rl_openai_proxy.chat`) or, on a history
mismatch, starts a new trajectory. A trajectory is a :class:`~core_rl.protocol.Sample`: ``prompt_ids``
are its first call's prompt, ``response_ids`` everything after; inserted tokens have mask 0 and
log-prob 0 (:func:`core_rl.rollout.workflows.append_observation`), sampled tokens mask 1 with the engine's
log-probs and versions (:func:`core_rl.rollout.workflows.extend_turn`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
from core_rl.interfaces import SamplingParams
from core_rl.protocol import Sample
from core_rl.rollout import append_observation, extend_turn
from core_rl.vision.media import concat_media

from core_rl_openai_proxy.chat import ChatTemplate, Mismatch
from core_rl_openai_proxy.errors import RequestError

#: the workflow's generation: prompt ids, sampling and the pixel inputs of the prompt's images (or ``None``)
Generate = Callable[[Sequence[int], SamplingParams, Any], Awaitable[list[Sample]]]


@attrs.define
class LastCall:
    """What the next call must extend: the previous call's kind (``chat`` or ``completion``), its
    messages and tools (chat), the full text so far (completion), the sampled text (``reply``), the
    assistant message returned for it (``message``, chat: :meth:`~core_rl_openai_proxy.tools.Reply.message`)
    and its stop token's text."""

    kind: str
    messages: list[dict[str, Any]] = attrs.field(factory=list)
    tools: Any = None
    text: str = ""
    reply: str = ""
    stop_text: str = ""
    message: dict[str, Any] = attrs.field(factory=dict)


def request_record(last: LastCall) -> dict[str, Any]:
    """What the agent sent in a call, as a trajectory's ``info["request"]`` keeps it (and
    ``rollout.dump`` records it, where the dump's ``prompt_text`` is the data row's): a chat call's
    ``messages`` and the names of its ``tools``; a completion call's ``prompt``."""
    if last.kind == "chat":
        tools = [t.get("function", {}).get("name") for t in last.tools or [] if isinstance(t, dict)]
        return {"messages": last.messages, "tools": tools}
    return {"prompt": last.text[: len(last.text) - len(last.reply)]}


@attrs.define
class Plan:
    """The prompt of a call and how it joins the session: ``inserted`` tokens after the current
    trajectory (``None``: the call starts a new trajectory from ``prompt_ids``); ``media``: the
    pixel inputs of every image whose placeholders ``prompt_ids`` hold (``None``: none)."""

    prompt_ids: list[int]
    inserted: list[int] | None
    media: dict[str, Any] | None = None


@attrs.define(eq=False)
class Session:
    """One episode's calls (see the module docstring). ``generate`` reaches the rollout engine
    through the workflow's context; ``reward`` is what the agent set; ``error`` an engine failure
    the workflow re-raises; ``responses``: by response id, the messages and reply of each Responses
    call (what ``previous_response_id`` continues)."""

    id: str
    generate: Generate
    sampling: SamplingParams
    row: Any
    trajectories: list[Sample] = attrs.field(factory=list)
    last: LastCall | None = None
    reward: float | None = None
    calls: int = 0
    mismatches: list[str] = attrs.field(factory=list)
    #: what the agent sent in the call that started each trajectory (:func:`request_record`)
    requests: list[dict[str, Any]] = attrs.field(factory=list)
    closed: bool = False
    error: BaseException | None = None
    inflight: asyncio.Future | None = None
    responses: dict[str, list[dict[str, Any]]] = attrs.field(factory=dict)
    lock: asyncio.Lock = attrs.field(factory=asyncio.Lock)
    guard: threading.Lock = attrs.field(factory=threading.Lock)

    # -- planning a call ---------------------------------------------------------------------

    def _tail(self) -> list[int]:
        current = self.trajectories[-1]
        return [*current.prompt_ids, *current.response_ids]

    def plan_chat(self, template: ChatTemplate, messages: list[dict[str, Any]], tools: Any, strict: bool) -> Plan:
        """The prompt of a chat call (``strict``: a mismatch is a 400, else a new trajectory)."""
        last = self.last
        if last is not None:
            try:
                if last.kind != "chat" or last.tools != tools:
                    raise Mismatch("the previous call was a completion" if last.kind != "chat" else "tools changed")
                inserted = template.inserted(last.messages, last.reply, last.message, last.stop_text, messages, tools)
                media = concat_media([self.trajectories[-1].media or {}, inserted.media or {}]) or None
                return Plan([*self._tail(), *inserted.ids], inserted.ids, media)
            except Mismatch as exc:
                self._mismatch(str(exc), strict)
        first = template.first_prompt(messages, tools)
        return Plan(first.ids, None, first.media)

    def plan_completion(
        self,
        encode: Callable[[str], list[int]],
        first: Callable[[str], list[int]],
        prompt: str | list[int],
        strict: bool,
    ) -> Plan:
        """The prompt of a completion call: a text (or token ids) extending the previous
        completion's prompt and returned text (ids) continues the trajectory, its new part
        tokenised by ``encode``; a first prompt is tokenised by ``first``."""
        last = self.last
        if last is not None:
            tail = self._tail()
            if last.kind != "completion":
                self._mismatch("the previous call was a chat call", strict)
            elif isinstance(prompt, list) and prompt[: len(tail)] == tail:
                inserted = list(prompt[len(tail) :])
                return Plan([*tail, *inserted], inserted)
            elif isinstance(prompt, str) and prompt.startswith(last.text):
                inserted = encode(prompt[len(last.text) :]) if len(prompt) > len(last.text) else []
                return Plan([*tail, *inserted], inserted)
            else:
                self._mismatch("the prompt does not start with the previous prompt and completion", strict)
        return Plan(list(prompt) if isinstance(prompt, list) else first(prompt), None)

    def _mismatch(self, reason: str, strict: bool) -> None:
        if strict:
            raise RequestError(
                f"session {self.id}: the call does not extend the previous one: {reason}",
                code="history_mismatch",
                param="messages",
            )
        self.mismatches.append(reason)

    # -- recording a call --------------------------------------------------------------------

    def record(self, plan: Plan, turn: Sample, last: LastCall) -> None:
        """Add a generated ``turn`` (a sample of ``plan.prompt_ids``) to the session."""
        with self.guard:
            if self.closed:
                raise self.ended()
            if plan.inserted is None:
                self.trajectories.append(attrs.evolve(turn, token_mask=[1] * len(turn.response_ids)))
                self.requests.append(request_record(last))
            else:
                joined = append_observation(self.trajectories[-1], plan.inserted)
                # the turn was sampled with the pixel inputs of every image so far
                self.trajectories[-1] = attrs.evolve(extend_turn(joined, turn), media=turn.media)
            self.calls += 1
            self.last = last

    def ended(self) -> RequestError:
        """The 409 of a call to an ended session."""
        return RequestError(f"session {self.id} ended (episode over or timed out)", status=409, code="session_ended")

    def close(self) -> None:
        """End the session: later calls get a 409 and a call in flight is cancelled."""
        with self.guard:
            self.closed = True
            if self.inflight is not None:  # a future of the proxy's loop; this runs on another thread
                self.inflight.get_loop().call_soon_threadsafe(self.inflight.cancel)

    def samples(self, reward: float | None, **info: Any) -> list[Sample]:
        """The session's trajectories as samples, each with ``reward`` and ``info``."""
        count = len(self.trajectories)
        return [
            attrs.evolve(
                sample,
                reward=reward,
                info={
                    **info,
                    "session": self.id,
                    "calls": self.calls,
                    "trajectory": i,
                    "trajectories": count,
                    "history_mismatches": len(self.mismatches),
                    "request": self.requests[i] if i < len(self.requests) else None,
                },
            )
            for i, sample in enumerate(self.trajectories)
        ]
