"""Building a plugin's component, and holding the plugin to its contract where the core receives
what it returns.

Every component a run uses is built by :func:`build_component` (``PluginHost.create``,
``PluginSpec.build``, the trainer and the role builders all go through it; the built-in components
too). It

1. calls the registered factory; an exception from it (other than a :class:`CoreRLError`, which is
   the plugin reporting a user's mistake) becomes a :class:`~core_rl.errors.PluginFault`:
   ``reward 'x' (distribution core-rl-foo 0.1.0) failed while building: ValueError: ...``, with the
   plugin's exception as its ``__cause__`` (the CLI prints its traceback below that line);
2. checks the component against its kind's interface (:attr:`core_rl.plugins.kinds.PluginKind.interface`):
   it must be an instance of the interface class or provide every public member of it; a
   component written against an older interface is refused here, naming what it lacks and which
   API version added it (:data:`core_rl.hookspecs.INTERFACE_ADDED`), instead of failing at the
   first call of the missing method (at teardown, for ``close``);
3. wraps the small tensor components (advantage estimators, sample filters, policy losses,
   rejection samplers) in a guard that checks what each call returns (:mod:`core_rl.plugins.guards`).

How a component is named in messages, and how a plugin's exception becomes a fault naming it:
:mod:`core_rl.plugins.attribution`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import attrs

from core_rl.errors import PluginFault
from core_rl.hookspecs import INTERFACE_KEYWORDS, interface_version
from core_rl.plugins.attribution import calling, remember, who
from core_rl.plugins.kinds import PluginKind
from core_rl.plugins.registry import RegistryEntry


def build_component(entry: RegistryEntry, *args: Any, **kwargs: Any) -> Any:
    """Build ``entry``'s component with ``entry.factory(*args, **kwargs)``, check it against its
    kind's interface and return it (guarded, for the kinds :mod:`core_rl.plugins.guards` checks); see the
    module docstring. Raises :class:`PluginFault` naming the component."""
    words = who(entry)
    component = calling(words, "building", entry.factory, *args, **kwargs)
    check_contract(entry, component)
    remember(component, words)
    from core_rl.plugins.guards import guard

    return guard(entry.kind, component, words)


def interface_class(kind: PluginKind) -> type:
    """The class named by ``kind.interface`` (imported on first use)."""
    module, _, name = kind.interface.rpartition(":")
    return getattr(importlib.import_module(module or "core_rl.interfaces"), name)


def interface_members(interface: type) -> list[str]:
    """The public members a component of ``interface`` provides: its methods, properties and
    class attributes, those of the interface's bases in the core, and its attrs fields; ``__call__``
    when the interface defines it."""
    members: dict[str, None] = {}
    for cls in reversed(interface.__mro__):
        if cls.__module__ in ("builtins", "abc", "typing"):
            continue
        for name in vars(cls):
            if not name.startswith("_") or name == "__call__":
                members.setdefault(name)
    if attrs.has(interface):
        for field in attrs.fields(interface):
            members.setdefault(field.name)
    return list(members)


def check_contract(entry: RegistryEntry, component: object) -> None:
    """Raise :class:`PluginFault` unless ``component`` is an instance of ``entry``'s interface or
    provides every member of it (and, for a workflow, an ``async`` ``run``)."""
    interface = interface_class(entry.kind)
    if isinstance(component, interface):
        missing: list[str] = []
    else:
        missing = [m for m in interface_members(interface) if not hasattr(component, m)]
    if missing:
        raise PluginFault(_missing_message(entry, interface, component, missing))
    _check_keywords(entry, interface, component)
    if entry.kind.key == "workflow" and not inspect.iscoroutinefunction(component.run):  # type: ignore[attr-defined]
        raise PluginFault(
            f"{who(entry)}: the run method of {type(component).__qualname__} is not a coroutine function; "
            "RolloutWorkflow.run is `async def run(self, prompt, ctx)`"
        )


def _check_keywords(entry: RegistryEntry, interface: type, component: object) -> None:
    """Raise :class:`PluginFault` when a member of ``component`` lacks a keyword argument the core
    passes (:data:`core_rl.hookspecs.INTERFACE_KEYWORDS`)."""
    for qualified, (keyword, version) in INTERFACE_KEYWORDS.items():
        cls, member = qualified.split(".")
        method = getattr(component, member, None) if cls == interface.__name__ else None
        if method is None:
            continue
        try:
            params = inspect.signature(method).parameters.values()
        except (TypeError, ValueError):  # a builtin or C method: nothing to read
            continue
        if not any(p.kind is p.VAR_KEYWORD or (p.name == keyword and p.kind is not p.POSITIONAL_ONLY) for p in params):
            path = f"{public_path(interface)}.{member}"
            raise PluginFault(
                f"{who(entry)}: {type(component).__qualname__}.{member} takes no keyword argument {keyword!r}, which "
                f"{path} takes since interface version {version} and the core passes; add it (see its docstring)"
            )


def public_path(interface: type) -> str:
    """``core_rl.interfaces.<Name>`` for a contract that module exports (where plugin authors import
    it from, wherever it is defined), else the class's own module path."""
    interfaces = importlib.import_module("core_rl.interfaces")
    module = (
        "core_rl.interfaces" if getattr(interfaces, interface.__name__, None) is interface else interface.__module__
    )
    return f"{module}.{interface.__name__}"


def _missing_message(entry: RegistryEntry, interface: type, component: object, missing: list[str]) -> str:
    """What the component lacks, grouped by the API version that added it, and what to do."""
    name = interface.__name__
    by_version: dict[int, list[str]] = {}
    for member in missing:
        shown = f"{member}()" if callable(getattr(interface, member, None)) else member
        by_version.setdefault(interface_version(name, member), []).append(shown)
    lacks = "; ".join(
        f"{', '.join(shown)} (added in interface version {version})" for version, shown in sorted(by_version.items())
    )
    path = public_path(interface)
    got = "nothing (None)" if component is None else type(component).__qualname__
    return (
        f"{who(entry)} does not implement {path}: its factory returned {got}, which lacks {lacks}; "
        f"make it a subclass of {path} (which provides the optional members) or add them"
    )
