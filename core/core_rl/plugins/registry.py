"""Registries: for one plugin kind, YAML name -> factory, description and providing distribution."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs

from core_rl.errors import PluginError
from core_rl.plugins.kinds import PluginKind


@attrs.frozen
class RegistryEntry:
    """What a plugin registered under one name."""

    kind: PluginKind
    name: str
    factory: Callable[..., Any]
    description: str
    distribution: str
    version: str
    config_cls: type | None = None
    override: bool = False


class Registry:
    """The entries of one kind, by name.

    A duplicate name is an error, unless exactly one of the two registrations asked to ``override``: an
    overriding entry replaces a plain one and is kept when a plain one arrives later, whatever the
    order plugins load in.
    """

    def __init__(self, kind: PluginKind) -> None:
        self.kind = kind
        self._entries: dict[str, RegistryEntry] = {}

    def add(self, entry: RegistryEntry) -> None:
        """Add ``entry``; raise :class:`PluginError` if its name is taken and neither overrides."""
        if entry.kind != self.kind:
            raise ValueError(f"entry of kind {entry.kind.key!r} added to the {self.kind.key!r} registry")
        existing = self._entries.get(entry.name)
        if existing is not None and existing.override and not entry.override:
            return
        if existing is not None and (not entry.override or existing.override):
            raise PluginError(
                f"{self.kind.label} {entry.name!r} is registered twice: by {existing.distribution} "
                f"and by {entry.distribution}; uninstall one, block one with CORE_RL_PLUGINS_BLOCK, "
                "or register with override=True to replace it on purpose"
            )
        self._entries[entry.name] = entry

    def get(self, name: str) -> RegistryEntry | None:
        return self._entries.get(name)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[RegistryEntry]:
        return iter(self._entries[name] for name in self.names())

    def __len__(self) -> int:
        return len(self._entries)
