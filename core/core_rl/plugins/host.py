"""The plugin host: discovers plugins through entry points, loads only what is asked for, and fills
the registries through the registration hooks.

Discovery: one entry-point group per kind (:mod:`core_rl.plugins.kinds`); the entry-point name is the name
used in YAML and its value is the module (or object) holding the hook implementations. Selecting
``rollout.engine.name: hf`` imports only the entry point ``hf`` of ``core_rl.rollout_engines``.

Environment:

- ``CORE_RL_PLUGINS_BLOCK``: comma-separated distribution names never loaded.
- ``CORE_RL_PLUGINS_ALLOW``: if set, comma-separated distribution names that alone are loaded
  (``core-rl``'s built-ins are always allowed unless blocked).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import pluggy

from core_rl import hookspecs
from core_rl.errors import PluginError, did_you_mean
from core_rl.plugins.components import build_component
from core_rl.plugins.kinds import ALL_KINDS, COMMANDS_GROUP, KNOWN_EXTRAS, PluginKind
from core_rl.plugins.registry import Registry, RegistryEntry

CORE_DISTRIBUTION = "core-rl"
ENV_BLOCK = "CORE_RL_PLUGINS_BLOCK"
ENV_ALLOW = "CORE_RL_PLUGINS_ALLOW"


@attrs.frozen
class EntryPointStatus:
    """How loading one entry point went: ``status`` is ``loaded``, ``failed``, ``blocked`` or ``not loaded``;
    ``error`` says why it failed (the whole exception text, or the name its plugin registered
    instead) or was blocked; ``hint`` what to do about a failure, where ``error`` does not say it."""

    kind: PluginKind
    name: str
    distribution: str
    version: str
    status: str
    error: str = ""
    hint: str = ""


def _normalise(dist_name: str) -> str:
    """A distribution name as packaging compares them: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def _split_env(value: str | None) -> set[str]:
    return {_normalise(part.strip()) for part in (value or "").split(",") if part.strip()}


@attrs.frozen
class StrayEntryPoint:
    """An installed entry point in a group that looks like core-rl's (``core_rl.<something>``) but is
    not one core-rl reads (a misspelling such as ``core_rl.environment``): nothing loads it."""

    group: str
    name: str
    value: str
    distribution: str

    def message(self) -> str:
        """One line saying what is ignored and which group was probably meant."""
        groups = sorted([COMMANDS_GROUP, *(kind.group for kind in ALL_KINDS)])
        close = did_you_mean(self.group, groups)
        hint = f"did you mean {close!r}?" if close else f"core-rl reads: {', '.join(groups)}"
        return (
            f"entry point {self.name!r} ({self.value}) of distribution {self.distribution} is in group "
            f"{self.group!r}, which core-rl does not read, so it is ignored; {hint}"
        )


def stray_entry_points(installed: md.EntryPoints) -> list[StrayEntryPoint]:
    """The entry points of ``installed`` in a ``core_rl.*`` group (``core-rl.*`` too) that is not a
    plugin kind's group (:class:`StrayEntryPoint`)."""
    known = {COMMANDS_GROUP, *(kind.group for kind in ALL_KINDS)}
    found = []
    for group in sorted(installed.groups):
        if group in known or not group.replace("-", "_").startswith("core_rl."):
            continue
        for ep in installed.select(group=group):
            dist = ep.dist.metadata["Name"] if ep.dist is not None else "<unknown>"
            found.append(StrayEntryPoint(group, ep.name, ep.value, dist))
    return found


class PluginHost:
    """Holds the pluggy manager and one :class:`Registry` per kind.

    :param entry_points: the entry points to consider (default: every installed one in the
        core-rl groups); tests pass a list.
    :param environ: where to read the allow and block lists (default: ``os.environ``).
    """

    def __init__(
        self,
        *,
        entry_points: Iterable[md.EntryPoint] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.registries: dict[str, Registry] = {kind.key: Registry(kind) for kind in ALL_KINDS}
        env = os.environ if environ is None else environ
        self._blocked = _split_env(env.get(ENV_BLOCK))
        self._allowed = _split_env(env.get(ENV_ALLOW))
        groups = {kind.group: kind for kind in ALL_KINDS}
        #: id(distribution) -> (that distribution, its name and version): one metadata parse each
        self._distributions: dict[int, tuple[md.Distribution, tuple[str, str]]] = {}
        #: installed entry points in a group core-rl does not read (only when scanning what is installed)
        self.stray: list[StrayEntryPoint] = []
        if entry_points is None:
            installed = md.entry_points()  # one scan of the installed distributions for every group
            entry_points = [ep for group in groups for ep in installed.select(group=group)]
            self.stray = stray_entry_points(installed)
        # kind -> name -> entry points declaring it (several when a distribution overrides a name),
        # core-rl's first so that an override registered by another distribution loads after it
        self._entry_points: dict[str, dict[str, list[md.EntryPoint]]] = {kind.key: {} for kind in ALL_KINDS}
        for ep in entry_points:
            kind = groups.get(ep.group)
            if kind is None:
                continue
            declared = self._entry_points[kind.key].setdefault(ep.name, [])
            if all((e.value, self._distribution_of(e)) != (ep.value, self._distribution_of(ep)) for e in declared):
                declared.append(ep)
        for by_name in self._entry_points.values():
            for declared in by_name.values():
                declared.sort(key=lambda e: _normalise(self._distribution_of(e)[0]) != CORE_DISTRIBUTION)
        self._status: dict[tuple[str, str, str], EntryPointStatus] = {}
        #: (distribution, entry-point value) -> the (kind key, name) pairs loading it registered
        self._registered_by: dict[tuple[str, str], set[tuple[str, str]]] = {}

    # -- registration -------------------------------------------------------------------------

    def register_plugin(
        self,
        plugin: object,
        *,
        distribution: str = "<local>",
        version: str = "",
        name: str | None = None,
    ) -> None:
        """Register ``plugin`` (a module or object with hook implementations) and run its
        registration hooks, recording ``distribution`` as the provider of what it registers."""
        if self.pm.is_registered(plugin):
            return
        self.pm.register(plugin, name=name)
        self.pm.check_pending()
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        for kind in ALL_KINDS:
            caller = self.pm.subset_hook_caller(kind.hook, remove_plugins=others)
            caller(register=self._register_callback(kind, distribution, version))

    def _register_callback(self, kind: PluginKind, distribution: str, version: str) -> hookspecs.Register:
        registry = self.registries[kind.key]

        def register(
            name: str,
            factory: Callable[..., Any],
            *,
            description: str,
            config_cls: type | None = None,
            override: bool = False,
        ) -> None:
            if not isinstance(name, str) or not name:
                raise PluginError(f"{distribution} registered a {kind.label} with an invalid name {name!r}")
            if config_cls is not None and not attrs.has(config_cls):
                raise PluginError(
                    f"{distribution} registered {kind.label} {name!r} with config_cls={config_cls!r}, "
                    "which is not an attrs class"
                )
            entry = RegistryEntry(
                kind=kind,
                name=name,
                factory=factory,
                description=description.strip().splitlines()[0] if description.strip() else "",
                distribution=distribution,
                version=version,
                config_cls=config_cls,
                override=override,
            )
            registry.add(entry)

        return register

    # -- entry points -------------------------------------------------------------------------

    def _distribution_of(self, ep: md.EntryPoint) -> tuple[str, str]:
        """``(name, version)`` of the distribution declaring ``ep``. Each ``metadata`` access
        parses the whole metadata file again (core-rl's holds its README), so it is read
        once per distribution (the entry points of one scan share their distribution's object)."""
        dist = getattr(ep, "dist", None)
        if dist is None:
            return "<unknown>", ""
        known = self._distributions.get(id(dist))
        if known is None or known[0] is not dist:
            meta = dist.metadata
            known = (dist, (meta["Name"] or "<unknown>", meta["Version"] or ""))
            self._distributions[id(dist)] = known  # the object is kept, so its id is not given again
        return known[1]

    def _is_blocked(self, distribution: str) -> bool:
        dist = _normalise(distribution)
        if dist in self._blocked:
            return True
        if self._allowed and dist not in self._allowed and dist != CORE_DISTRIBUTION:
            return True
        return False

    def _load_entry_point(self, kind: PluginKind, ep: md.EntryPoint) -> EntryPointStatus:
        key = (kind.key, ep.name, ep.value)
        if key in self._status:
            return self._status[key]
        distribution, version = self._distribution_of(ep)
        if self._is_blocked(distribution):
            status = EntryPointStatus(
                kind, ep.name, distribution, version, "blocked", f"blocked by {ENV_BLOCK}/{ENV_ALLOW}"
            )
        else:
            before = self._registered_pairs()
            try:
                plugin = ep.load()
                self.register_plugin(
                    plugin, distribution=distribution, version=version, name=f"{distribution}:{ep.value}"
                )
            except Exception as exc:  # a broken plugin must not break others
                error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                hint = "fix or reinstall that distribution"
                status = EntryPointStatus(kind, ep.name, distribution, version, "failed", error, hint)
            else:
                registered = self._registered_by.setdefault((distribution, ep.value), set())
                registered |= self._registered_pairs() - before
                status = self._registration_status(kind, ep, distribution, version)
        self._status[key] = status
        return status

    def _registered_pairs(self) -> set[tuple[str, str]]:
        return {(key, name) for key, registry in self.registries.items() for name in registry.names()}

    def _registration_status(
        self, kind: PluginKind, ep: md.EntryPoint, distribution: str, version: str
    ) -> EntryPointStatus:
        """``loaded`` when the entry point's plugin registered its name, else ``failed`` saying what
        it registered instead (an entry-point name must be the name the plugin registers)."""
        if ep.name in self.registries[kind.key]:
            return EntryPointStatus(kind, ep.name, distribution, version, "loaded")
        others = sorted(n for k, n in self._registered_by.get((distribution, ep.value), ()) if k == kind.key)
        what = ", ".join(repr(n) for n in others) if others else "nothing"
        error = (
            f"its plugin {ep.value} registered {what} through {kind.hook}, not {ep.name!r} (its entry-point name "
            f"in group {kind.group}); rename one so that they match"
        )
        return EntryPointStatus(kind, ep.name, distribution, version, "failed", error)

    def _stray_status(self, entry: RegistryEntry) -> EntryPointStatus:
        """The status of a registered name no entry point declares: ``loaded`` when it was registered
        directly (:meth:`register_plugin`), ``failed`` when loading another entry point registered it
        as a side effect (a run cannot select it: nothing would load it)."""
        kind = entry.kind
        for (distribution, value), pairs in self._registered_by.items():
            if (kind.key, entry.name) in pairs:
                error = (
                    f"registered by {value} (distribution {distribution}), but no entry point in group {kind.group} "
                    f"is named {entry.name!r}, so a run cannot select it; rename one so that they match"
                )
                return EntryPointStatus(kind, entry.name, entry.distribution, entry.version, "failed", error)
        return EntryPointStatus(kind, entry.name, entry.distribution, entry.version, "loaded")

    def _load_name(self, kind: PluginKind, name: str) -> list[EntryPointStatus]:
        """Load every entry point declaring ``name`` of ``kind`` (core-rl's first)."""
        return [self._load_entry_point(kind, ep) for ep in self._entry_points[kind.key].get(name, [])]

    def load_all(self) -> list[EntryPointStatus]:
        """Load every discovered entry point, recording failures instead of raising."""
        for kind in ALL_KINDS:
            for name in self._entry_points[kind.key]:
                self._load_name(kind, name)
        return self.statuses()

    def load_commands(self) -> list[str]:
        """Register the modules of the ``core_rl.commands`` group (:data:`core_rl.plugins.kinds.COMMANDS_GROUP`),
        whose :func:`core_rl.hookspecs.core_rl_add_commands` adds ``core-rl`` subcommands; a module that
        fails to load is left out with a warning line naming it and its distribution (the other
        commands still work). Returns those lines."""
        warnings = []
        for ep in md.entry_points(group=COMMANDS_GROUP):
            distribution = ep.dist.metadata["Name"] if ep.dist is not None else "<unknown>"
            if self._is_blocked(distribution):
                continue
            try:
                module = ep.load()
            except Exception as exc:  # a broken command plugin must not take the whole CLI down
                warnings.append(
                    f"command {ep.name!r} ({ep.value}) of distribution {distribution} failed to load and is left "
                    f"out: {type(exc).__name__}: {exc}"
                )
                continue
            if not self.pm.is_registered(module):
                self.pm.register(module, name=f"{COMMANDS_GROUP}:{ep.name}")
        return warnings

    def load_kind(self, kind: PluginKind) -> list[EntryPointStatus]:
        """Load every discovered entry point of ``kind``, recording failures instead of raising."""
        return [status for name in list(self._entry_points[kind.key]) for status in self._load_name(kind, name)]

    def statuses(self) -> list[EntryPointStatus]:
        """One status per discovered entry point and one per name registered without one."""
        out: list[EntryPointStatus] = []
        for kind in ALL_KINDS:
            declared = self._entry_points[kind.key]
            for name in sorted(declared):
                for ep in declared[name]:
                    distribution, version = self._distribution_of(ep)
                    out.append(
                        self._status.get(
                            (kind.key, name, ep.value),
                            EntryPointStatus(kind, name, distribution, version, "not loaded"),
                        )
                    )
            for entry in self.registries[kind.key]:
                if entry.name not in declared:
                    out.append(self._stray_status(entry))
        return out

    def available_names(self, kind: PluginKind) -> list[str]:
        """Names of this kind that are registered or discoverable (and not blocked)."""
        names = set(self.registries[kind.key].names())
        for name, eps in self._entry_points[kind.key].items():
            if any(not self._is_blocked(self._distribution_of(ep)[0]) for ep in eps):
                names.add(name)
        return sorted(names)

    # -- lookup -------------------------------------------------------------------------------

    def get(self, kind: PluginKind, name: str) -> RegistryEntry:
        """The entry ``name`` of ``kind``, loading its entry point if needed.

        Raises :class:`PluginError` naming what is installed and the extra that provides
        ``name`` when it is unknown, blocked, or failed to load (its module raised, or registered
        another name than its entry point's).
        """
        statuses = self._load_name(kind, name)
        entry = self.registries[kind.key].get(name)
        if entry is not None:
            return entry
        for status in statuses:
            if status.status == "failed":
                hint = f"; {status.hint}" if status.hint else ""
                raise PluginError(
                    f"{kind.label} {name!r} from {status.distribution} {status.version} failed to load: "
                    f"{status.error}{hint}"
                )
        for status in statuses:
            if status.status == "blocked":
                raise PluginError(
                    f"{kind.label} {name!r} is provided by {status.distribution}, which is blocked by "
                    f"{ENV_BLOCK} or not in {ENV_ALLOW}; unset or change that variable to use it"
                )
        working, failed = self._names_that_load(kind)
        raise PluginError(unknown_name_message(kind, name, working, failed))

    def _names_that_load(self, kind: PluginKind) -> tuple[list[str], dict[str, str]]:
        """The names of ``kind`` a run can select (loading every entry point of the kind, for an
        unknown name's message) and, apart, those whose entry point fails to load, with why."""
        for declared in list(self._entry_points[kind.key]):
            self._load_name(kind, declared)
        failed = {s.name: s.error for s in self.statuses() if s.kind == kind and s.status == "failed"}
        working = [s.name for s in self.statuses() if s.kind == kind and s.status == "loaded"]
        return sorted(set(working) - set(failed)), failed

    def create(self, kind: PluginKind, name: str, *args: Any, **kwargs: Any) -> Any:
        """Build the component ``name`` of ``kind`` by calling its factory with the given arguments,
        checked as :func:`core_rl.plugins.components.build_component` says."""
        return build_component(self.get(kind, name), *args, **kwargs)


def install_hint(kind: PluginKind, name: str) -> str:
    """The sentence telling how to install the distribution that provides ``name``."""
    extra = KNOWN_EXTRAS.get((kind.key, name))
    if extra is not None:
        return f'install it with: pip install "core-rl[{extra}]"'
    return (
        f"no core-rl extra provides it; install the distribution that registers {name!r} in "
        f"entry-point group {kind.group}"
    )


def unknown_name_message(
    kind: PluginKind, name: str, installed: list[str], failed: Mapping[str, str] | None = None
) -> str:
    """Say that ``name`` is not installed. A name close to an installed one of the same kind (a
    typo) gets ``did you mean ...?``; one close to a name whose plugin fails to load (``failed``:
    name -> why) is told that plugin's failure; one close to a name an uninstalled core-rl extra
    provides gets that suggestion and its install hint; otherwise the hint for ``name`` itself."""
    shown = ", ".join(installed) if installed else "none"
    close = did_you_mean(name, installed)
    if close is not None:
        return f"{kind.label} {name!r} is not installed; did you mean {close!r}? (installed: {shown})"
    broken = did_you_mean(name, failed or {})
    if broken is not None:
        return (
            f"{kind.label} {name!r} is not installed (installed: {shown}); {broken!r} fails to load: "
            f"{(failed or {})[broken]}"
        )
    if (kind.key, name) not in KNOWN_EXTRAS:
        extras = [n for (k, n) in KNOWN_EXTRAS if k == kind.key and n not in installed]
        close = did_you_mean(name, extras)
        if close is not None:
            return (
                f"{kind.label} {name!r} is not installed (installed: {shown}); did you mean {close!r}? "
                f"{install_hint(kind, close)}"
            )
    return f"{kind.label} {name!r} is not installed (installed: {shown}); {install_hint(kind, name)}"
