"""A key whose value the loader derived (:mod:`core_rl.config.derived` says which keys and how):
the record :attr:`core_rl.config.schema.RunConfig.derived` holds."""

from __future__ import annotations

from typing import Any

import attrs

from core_rl.config.paths import Path, format_path

#: the ``source`` of a derived key that is a ``${...}`` interpolation
INTERPOLATION = "interpolation"


@attrs.frozen
class Derived:
    """A key the loader derived: ``path`` (names and list indices), the ``value`` it was filled
    with, what the YAML holds to keep it derived (``written``: ``0``, ``None`` or the
    interpolation text) and how it is derived, for people (``source``; :data:`INTERPOLATION` for
    an interpolation). ``at_start``: chosen when the run started, from the machine (see
    :mod:`core_rl.config.derived`), not by the loader."""

    path: Path
    value: Any
    written: Any
    source: str
    at_start: bool = False

    @property
    def key(self) -> str:
        """The dotted key path, e.g. ``algorithm.filters[0].norm_length``."""
        return format_path(self.path)
