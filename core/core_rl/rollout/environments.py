"""Environments: what a model acts in over several turns (a plugin kind registered through
:func:`core_rl.hookspecs.core_rl_register_environments`, selected in the ``environment`` rollout
workflow: :mod:`core_rl.builtin.environment_workflow`).

One :class:`Environment` object serves one trajectory. The workflow calls :meth:`Environment.reset`
with the data row, then, after each model turn, :meth:`Environment.step` with the turn as an
:class:`Action` (its text and its sampled token ids). ``step`` returns a :class:`StepResult`
(a named tuple ``(observation, reward, done, info)``): ``observation`` is what the workflow
tokenises and appends as masked tokens (never trained) before the next turn; ``reward`` is that
turn's reward; ``done`` ends the trajectory.

An observation (:data:`Observation`, also what ``reset`` returns) is text, or a list of content
parts in the OpenAI/HF form for a vision-language model: ``{"type": "text", "text": ...}`` and
image parts ``{"type": "image", "image": SOURCE}`` or ``{"type": "image_url", "image_url": {"url":
SOURCE}}`` (a SOURCE as in a data row: :mod:`core_rl.vision.images`). The parts are joined in
order, each image becoming the model's image placeholder as its chat template writes one, expanded
to the image's count, and the images' pixel inputs join the trajectory's
(:func:`core_rl.vision.prompts.encode_observation`): the next turns are generated, and the
trajectory trained, with them.

Both methods are coroutines: an environment that blocks (runs a program, calls a service) awaits
it off the event loop (``asyncio.to_thread``) so that its other awaits go on meanwhile. The
workflow bounds how many steps run at once and how long one may take, and runs each environment
object on an event loop of its own (:mod:`core_rl.reliability.own_loop`), so one that blocks by mistake cannot
freeze the other trajectories or escape the timeout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import attrs

from core_rl.errors import PluginFault


@attrs.frozen
class Action:
    """One model turn: ``text`` (its tokens decoded, special tokens skipped), ``token_ids`` (exactly
    as sampled), ``turn`` (0 for the first), and the row's prompt as the model saw it
    (``prompt_text``, ``prompt_ids``)."""

    text: str
    token_ids: tuple[int, ...]
    turn: int = 0
    prompt_text: str = ""
    prompt_ids: tuple[int, ...] = ()


#: an observation (the module docstring): text, or OpenAI/HF content parts mixing text and images
Observation: TypeAlias = str | Sequence[Mapping[str, Any]]
#: the content-part types an observation may hold
OBSERVATION_PART_TYPES = ("text", "image", "image_url")


class StepResult(NamedTuple):
    """What one step returns: the ``observation`` to append (``""``: none; text or content parts,
    :data:`Observation`), the turn's ``reward``, whether the trajectory is ``done``, and ``info``
    (JSON-like, recorded per turn)."""

    observation: Observation
    reward: float
    done: bool
    info: dict[str, Any] = {}  # noqa: RUF012 (a NamedTuple default, never mutated)


class Environment(ABC):
    """See the module docstring. One instance per trajectory; it may keep state between calls."""

    @abstractmethod
    async def reset(self, row: Mapping[str, Any]) -> Observation:
        """Start a trajectory for the data ``row``; return the first observation (text or content
        parts, :data:`Observation`), appended after the prompt as masked tokens (``""``: nothing to
        append)."""

    @abstractmethod
    async def step(self, action: Action) -> StepResult:
        """React to one model turn (see the module docstring)."""

    async def close(self) -> None:
        """Release what the trajectory held (processes, connections); called once at its end."""


def check_observation(value: Any, who: str, contract: str) -> Observation:
    """``value`` as an :data:`Observation`: a ``str``, or a list of content parts whose types are
    :data:`OBSERVATION_PART_TYPES` (a text part's ``text`` a ``str``); otherwise a
    :class:`~core_rl.errors.PluginFault` naming ``who``, what it returned and the ``contract``."""
    if isinstance(value, str):
        return value
    if not isinstance(value, Sequence) or isinstance(value, (bytes, bytearray)):
        raise PluginFault(f"{who} returned an observation of type {type(value).__name__}; {contract}")
    parts = list(value)
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in OBSERVATION_PART_TYPES:
            raise PluginFault(
                f"{who} returned an observation whose part {i} is {part!r:.80}; {contract} "
                f"(content parts of the types {', '.join(OBSERVATION_PART_TYPES)})"
            )
        if kind == "text" and not isinstance(part.get("text"), str):
            raise PluginFault(f"{who} returned an observation whose text part {i} has no str 'text'; {contract}")
    return parts


def as_step_result(value: Any, who: str) -> StepResult:
    """``value`` (a :class:`StepResult` or a 4-tuple) checked: an observation
    (:func:`check_observation`), a finite reward, a bool-like ``done`` and a mapping ``info``;
    otherwise a :class:`~core_rl.errors.PluginFault` naming ``who`` and what it returned."""
    import math

    contract = "Environment.step returns (observation: str or content parts, reward: float, done: bool, info: dict)"
    if not isinstance(value, tuple) or len(value) != 4:
        raise PluginFault(f"{who} returned {type(value).__name__} {value!r:.80}; {contract}")
    observation, reward, done, info = value
    observation = check_observation(observation, who, contract)
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise PluginFault(f"{who} returned the reward {reward!r}; {contract} (a finite number)")
    if not isinstance(info, Mapping):
        raise PluginFault(f"{who} returned info of type {type(info).__name__}; {contract}")
    return StepResult(observation, float(reward), bool(done), dict(info))
