"""Naming a plugin's component in messages, and running a plugin's code so that its exceptions name
the component: :func:`who` gives the words (``reward 'x' (distribution core-rl-foo 0.1.0)``),
:func:`remember` ties them to a built component and :func:`built_by` finds them again (for an
engine whose output the trainer checks), :func:`calling` turns a plugin's exception into a
:class:`~core_rl.errors.PluginFault`. Light: no torch, so the rollout controller, the reward runner
and the guards (:mod:`core_rl.plugins.guards`) all use it."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from core_rl.errors import CoreRLError, PluginFault
from core_rl.plugins.registry import RegistryEntry
from core_rl.reliability.progress import PROGRESS

T = TypeVar("T")

#: id(component) -> (a weak reference to it, the words naming it), for :func:`built_by`
_BUILT: dict[int, tuple[weakref.ref, str]] = {}


def who(entry: RegistryEntry) -> str:
    """``reward 'x' (distribution core-rl-foo 0.1.0)``: the component's kind, name and provider."""
    provider = f"{entry.distribution} {entry.version}".strip()
    return f"{entry.kind.label} {entry.name!r} (distribution {provider})"


def built_by(component: object, default: str = "") -> str:
    """The :func:`who` words of a component :func:`core_rl.plugins.components.build_component` built
    (``default``, or its class name, for any other object)."""
    found = _BUILT.get(id(component))
    if found is not None and found[0]() is component:
        return found[1]
    return default or type(component).__name__


def remember(component: object, words: str) -> None:
    """Tie ``words`` to ``component`` for :func:`built_by` (for as long as it lives)."""
    key = id(component)
    try:
        ref = weakref.ref(component, lambda _ref: _BUILT.pop(key, None))
    except TypeError:  # an object without weak references (e.g. a builtin): not remembered
        return
    _BUILT[key] = (ref, words)


def calling(words: str, doing: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, a plugin's code, registered as a call in flight ``<words>: <doing>``
    for the progress watchdog (:mod:`core_rl.reliability.progress`); an exception from it (but a
    :class:`CoreRLError`) becomes a :class:`PluginFault` ``<words> failed while <doing>: <exception>``,
    caused by it."""
    try:
        with PROGRESS.call(f"{words}: {doing}"):
            return fn(*args, **kwargs)
    except CoreRLError:
        raise
    except Exception as exc:
        raise PluginFault(f"{words} failed while {doing}: {type(exc).__name__}: {exc}") from exc
