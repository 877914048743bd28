"""Built-in reward ``function``: a plain Python function, from a file or a module, is the reward.

.. code-block:: yaml

    reward:
      name: function
      path: rewards/my.py:score        # file:function (relative to the working directory) or module:function
      kwargs: {tolerance: 0.01}        # passed to every call by name
      columns: [answer]                # data columns every row must hold (checked before the run)
      batched: false                   # true: one call per batch of items, lists in, list of scores out

The function names the inputs it wants as parameters; each call passes those, plus ``kwargs``:

- ``response`` (str), ``prompt`` (str), ``row`` (dict: the data row), ``finish_reason`` (``"stop"``
  or ``"length"``), ``prompt_ids`` and ``response_ids`` (lists of ints), ``workflow_reward`` (float
  or ``None``), ``info`` (dict), ``item`` (the :class:`~core_rl.protocol.RewardInput` itself).

``def score(response: str, row: dict, **kwargs) -> float`` is called once per sample; with
``batched: true`` each input is a list over the call's items (``response: list[str]``, ...) and the
function returns one score per item, in order. An ``async def`` function is awaited (per-item: the
call's items concurrently). Calls come from the reward runner's threads
(``reward_runner.num_workers``) and from ``combine``'s, so the function must be thread-safe; the
runner's other rules hold as for any reward: a call that raises fails its items (set
``reward_runner.items_per_call: 1`` to fail one item alone), a score that is not a finite number
fails that item, each under ``reward_runner.on_error``.

At every configuration load (``core-rl config validate`` included) the function is loaded and its
signature checked against the inputs and ``kwargs``; each problem is one line at ``reward.path``
or ``reward.kwargs.<key>`` (:mod:`core_rl.plugins.callables` says how files load and what a failed load
says).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from core_rl.config.checks import SectionContext
from core_rl.config.validators import FieldValueError
from core_rl.errors import ConfigError
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Reward, RewardScores
from core_rl.plugins.callables import CALLABLE, CALLABLE_FORMS, LoadFailed, is_async, load_callable
from core_rl.protocol import RewardInput

#: what each input a function may name is, for one item
INPUTS: dict[str, Callable[[RewardInput], Any]] = {
    "response": lambda item: item.response_text,
    "prompt": lambda item: item.prompt_text,
    "row": lambda item: dict(item.row),
    "finish_reason": lambda item: item.finish_reason,
    "prompt_ids": lambda item: list(item.prompt_ids),
    "response_ids": lambda item: list(item.response_ids),
    "workflow_reward": lambda item: item.workflow_reward,
    "info": lambda item: dict(item.info),
    "item": lambda item: item,
}


def _reference(_inst: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if not CALLABLE.match(value):
        raise FieldValueError(attribute.name, value, f"must be {CALLABLE_FORMS}")


def signature_problems(function: Callable[..., Any], kwargs: dict[str, Any], kwargs_key: str) -> list[tuple[str, str]]:
    """What stops ``function`` from taking the inputs it names plus ``kwargs`` (the section's
    ``kwargs_key``) by keyword: ``(key, problem)`` pairs, ``key`` being ``"path"`` (at most one) or
    ``"kwargs.<name>"``."""
    name = getattr(function, "__name__", "the function")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as exc:
        return [("path", f"cannot read the signature of {name}: {exc}")]
    params = signature.parameters.values()
    kinds = inspect.Parameter
    signature = signature.replace(  # shown without annotations (strings under postponed evaluation)
        parameters=[p.replace(annotation=kinds.empty) for p in params], return_annotation=inspect.Signature.empty
    )
    takes_any = any(p.kind is kinds.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    problems = []
    for key in kwargs:
        if key in INPUTS:
            problems.append((f"kwargs.{key}", f"{key!r} is an input the reward passes itself; rename the argument"))
        elif key not in named and not takes_any:
            problems.append((f"kwargs.{key}", f"{name}{signature} takes no argument {key!r}; remove it or add it"))
    unfilled = [
        p
        for p in params
        if p.default is kinds.empty
        and (p.kind is kinds.POSITIONAL_ONLY or (p.name not in INPUTS and p.name not in kwargs))
        and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
    ]
    inputs = ", ".join(INPUTS)
    if unfilled:
        p = unfilled[0]
        why = (
            "is positional-only, but arguments come by name"
            if p.kind is kinds.POSITIONAL_ONLY
            else f"is neither an input ({inputs}) nor a key of {kwargs_key}"
        )
        fix = f"rename it, give it a default or set it in {kwargs_key}"
        problems.append(("path", f"{name}{signature}: parameter {p.name!r} {why}; {fix}"))
    elif not named & INPUTS.keys():
        problems.append(("path", f"{name}{signature} takes none of the inputs ({inputs}); name at least one"))
    return problems


@attrs.define
class FunctionRewardConfig:
    """``path``: the function (``file.py:function`` relative to the working directory, or
    ``module:function``); ``kwargs``: passed by name to every call; ``columns``: data columns every
    row must hold (not null); ``batched``: one call per batch of items, lists in, a list out."""

    path: str = attrs.field(validator=_reference)
    kwargs: dict[str, Any] = attrs.field(factory=dict)
    columns: list[str] = attrs.field(factory=list)
    batched: bool = False

    def check_config(self, context: SectionContext) -> list[str]:
        """Load the function and check that it can take its inputs and ``kwargs``."""
        try:
            function = load_callable(self.path)
        except LoadFailed as exc:
            return [f"{context.key('path')}: {exc}"]
        problems = signature_problems(function, self.kwargs, context.key("kwargs"))
        return [f"{context.key(key)}: {problem}" for key, problem in problems]

    def required_columns(self) -> list[str]:
        return list(self.columns)


class FunctionReward(Reward):
    """Calls the configured function as the module docstring says."""

    def __init__(self, config: FunctionRewardConfig) -> None:
        self.config = config
        try:
            self.function = load_callable(config.path)
        except LoadFailed as exc:
            raise ConfigError([f"reward 'function': path: {exc}"]) from exc
        names = set(inspect.signature(self.function).parameters)
        self.inputs = {name: get for name, get in INPUTS.items() if name in names}
        self.run_async = is_async(self.function)

    def _arguments(self, item: RewardInput) -> dict[str, Any]:
        return {**self.config.kwargs, **{name: get(item) for name, get in self.inputs.items()}}

    def score(self, items: Sequence[RewardInput]) -> Any:
        """The function's values as they are (the reward runner judges each one, and the count)."""
        if self.config.batched:
            arguments = {**self.config.kwargs, **{n: [get(i) for i in items] for n, get in self.inputs.items()}}
            result = self.function(**arguments)
            return asyncio.run(result) if self.run_async else result
        if self.run_async:
            return list(asyncio.run(self._gather(items)))
        return [self.function(**self._arguments(item)) for item in items]

    def score_with_parts(self, items: Sequence[RewardInput]) -> RewardScores:
        return RewardScores(scores=self.score(items))

    async def _gather(self, items: Sequence[RewardInput]) -> list[Any]:
        return list(await asyncio.gather(*(self.function(**self._arguments(item)) for item in items)))


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    register(
        "function",
        FunctionReward,
        description="A plain Python function as the reward (file.py:function or module:function)",
        config_cls=FunctionRewardConfig,
    )
