"""Data sources: rows made in memory by a plugin (a procedural task generator, a Python callable, an
environment library's task set) instead of read from a file (a plugin kind registered through
:func:`core_rl.hookspecs.core_rl_register_data_sources`).

A source is selected by an entry ``source:<key>`` of ``data.train_files`` or ``eval.files``, beside
files and ``hf:`` datasets, weighted or not (:mod:`core_rl.data.files`). ``<key>`` is a key
of ``data.sources``, whose value is the source's section ``{name: <registered name>, ...options}``;
a key that ``data.sources`` does not hold is a registered name, built with its default options.

The contract (:class:`DataSource`): :meth:`DataSource.rows` returns the source's rows, each a
mapping of column to value, **the same rows in the same order every time it is called on a source
built from the same options** (randomness comes from a seed among the options). Everything after
reading (checks, tokenising, shuffling, weighted mixtures, a resumed run's position) is what files
get, so a resumed run, which builds the source again, draws exactly the rows the uninterrupted run
would have. The rows are kept as they are, Python values and all (no JSON round trip): a task's
metadata dict reaches the reward as the source made it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from core_rl.config.plugin_spec import PluginSpec

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig
    from core_rl.plugins.host import PluginHost

#: the prefix of a data-source entry of ``data.train_files`` / ``eval.files``: ``source:<key>``
SOURCE_PREFIX = "source:"


class DataSource(ABC):
    """See the module docstring: one source of rows, built by its factory from its validated section."""

    @abstractmethod
    def rows(self) -> Iterable[Mapping[str, Any]]:
        """Every row of the source, in order; the same rows in the same order on every call (and on
        every source built from the same options). Each row is a mapping of column name to value and
        holds the prompt column (``data.prompt_key``) and the columns the run's reward reads."""


def source_key(entry: str) -> str | None:
    """``<key>`` of an entry ``source:<key>``; ``None`` for any other entry."""
    return entry[len(SOURCE_PREFIX) :] if entry.startswith(SOURCE_PREFIX) else None


def resolve_source_entries(
    sources: dict[str, PluginSpec], entries: Sequence[tuple[str, str]], host: PluginHost, *, validate: bool = True
) -> list[str]:
    """Make every ``source:<key>`` entry of ``entries`` (``(key path, entry)`` pairs, e.g.
    ``("data.train_files[0]", "source:gen")``) name a validated section of ``sources``
    (``data.sources``): a key it does not hold is a registered data source's name, added to it with
    its default options. Returns one problem per entry that names neither, with a did-you-mean
    among the keys of ``sources`` and the installed sources' names, and per section whose options
    its plugin refuses (``validate``: the loader validates them with every other section)."""
    from core_rl.config.sections import validate_plugin_section
    from core_rl.errors import ConfigError, PluginError, did_you_mean
    from core_rl.plugins.kinds import DATA_SOURCE

    problems: list[str] = []
    for path, entry in entries:
        key = source_key(entry)
        if key is None or key in sources:
            continue
        if not key:
            problems.append(f"{path}: {entry!r} names no data source; write source:<key>, a key of data.sources")
            continue
        try:
            host.get(DATA_SOURCE, key)
        except PluginError as exc:
            keys = ", ".join(sources) or "none"
            close = did_you_mean(key, sources)
            if close is not None:
                problems.append(
                    f"{path}: {entry!r} is no key of data.sources ({keys}) nor an installed data source; "
                    f"did you mean 'source:{close}'?"
                )
            else:
                problems.append(f"{path}: {entry!r} is no key of data.sources ({keys}); {exc}")
            continue
        sources[key] = PluginSpec(name=key)
    for key, spec in sources.items():
        if validate and spec.entry is None:
            try:
                validate_plugin_section(host, DATA_SOURCE, spec, f"data.sources.{key}")
            except ConfigError as exc:
                problems.extend(exc.problems)
    return problems


def source_rows(entry: str, sources: Mapping[str, PluginSpec], key_path: str) -> tuple[list[Any], str | None]:
    """The rows of the entry ``source:<key>`` (a key of ``sources``, validated by
    :func:`resolve_source_entries`: a configuration's loader has done it; otherwise done here with
    the installed plugins), and a problem (``None``: none) where the entry names no source or the
    source made no rows. A source that raises is a :class:`~core_rl.errors.PluginFault` naming it
    and its distribution."""
    from core_rl.plugins.attribution import calling, who
    from core_rl.plugins.host import PluginHost

    key = source_key(entry)
    assert key is not None, entry
    resolved = dict(sources)
    if key not in resolved or resolved[key].entry is None:
        problems = resolve_source_entries(resolved, [(key_path, entry)], PluginHost())
        if problems:
            return [], "; ".join(problems)
    spec = resolved[key]
    assert spec.entry is not None
    source = spec.build()  # checked against DataSource (core_rl.plugins.components)
    words = who(spec.entry)
    rows = calling(words, "making its rows", lambda: list(source.rows()))
    if not rows:
        return [], f"{key_path}: {entry!r}: {words} made no rows"
    return rows, None


def source_entry_problems(cfg: RunConfig, host: PluginHost) -> list[str]:
    """:func:`resolve_source_entries` for the ``source:`` entries of ``data.train_files`` and
    ``eval.files`` (the sections left to the loader to validate)."""
    entries = [(f"data.train_files[{i}]", path) for i, path in enumerate(cfg.data.train_paths)]
    if cfg.eval is not None:
        entries += [(f"eval.files[{i}]", path) for i, path in enumerate(cfg.eval.files)]
    return resolve_source_entries(cfg.data.sources, entries, host, validate=False)
