"""Errors raised by core-rl that the CLI reports as a short message (exit status 2, no traceback).

Every problem a user can cause (configuration, overrides, data files, model and tokenizer
directories, devices, the output directory) is raised as a :class:`CoreRLError` whose message
names the thing (key path, ``file:line`` with 1-based lines, plugin and distribution), says what is
wrong and what to do. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar


class CoreRLError(Exception):
    """Base class of user-facing errors: the message alone says what is wrong and what to do.
    ``exit_code`` is the ``core-rl`` command's exit status for it (see :mod:`core_rl.cli`)."""

    exit_code: int = 2


class ProblemsError(CoreRLError):
    """Several problems reported at once, one line each (``problems``), under a heading."""

    heading: ClassVar[str] = "problems"

    def __init__(self, problems: list[str] | str, *, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{self.heading}{where}:\n{lines}")


class ConfigError(ProblemsError):
    """A configuration is invalid. ``problems`` lists one line per problem, each naming its key path."""

    heading = "invalid configuration"


class PreflightError(ProblemsError):
    """The run cannot start: its data files, model or tokenizer directories, devices or output
    directory have problems (found before any model is loaded). Each line names the key path or
    the file and line."""

    heading = "the run cannot start"


class PluginError(CoreRLError):
    """A plugin is missing, blocked, failed to import, or registered a conflicting name."""


class PluginFault(CoreRLError):
    """A plugin broke its contract: its factory or one of its methods raised, it returned what its
    interface does not allow (a wrong shape, dtype or length), or it lacks a member of its
    interface. The message's first line names the component (kind, name, distribution and version)
    and what went wrong; the plugin's own exception, if any, is the ``__cause__``, whose traceback
    the CLI prints below that line. Exit status 1: a bug in the plugin, not in the user's
    configuration (a plugin reporting a configuration problem raises a :class:`ConfigError`)."""

    exit_code = 1


class DataError(ProblemsError):
    """Data is malformed; each problem names the file and the line or row (``train.jsonl:7``)."""

    heading = "invalid data"


def row_column(
    row: Mapping[str, Any], key: str, *, reader: str, key_path: str, holds: str, nullable: bool = False
) -> Any:
    """``row[key]``, the column ``key`` of a data row that ``reader`` reads (``"reward 'math'"``);
    a :class:`DataError` when the row lacks it (naming the row's columns and the setting
    ``key_path`` that points at the column holding ``holds``) or, unless ``nullable``, holds null there."""
    if key not in row:
        keys = ", ".join(repr(k) for k in row) or "none"
        raise DataError(
            f"{reader}: the data row has no {key!r} column (its keys: {keys}); set {key_path} to the column "
            f"holding {holds}"
        )
    if row[key] is None and not nullable:
        raise DataError(f"{reader}: the data row's {key!r} is null")
    return row[key]


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``word`` by edit similarity (difflib's ratio >= 0.6), or ``None``."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return close[0] if close else None


def stderr_line(line: str) -> None:
    """Write ``line`` and its newline to stderr in one write, then flush. The ranks of a run share one
    stderr; ``print`` writes the text and the newline apart, so with unbuffered streams
    (``PYTHONUNBUFFERED``, ``python -u``) another rank's line could land between the two (one write
    of at most 4 KiB to a pipe is atomic)."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def warn(message: str) -> None:
    """``core-rl: warning: <message>`` on stderr (:func:`stderr_line`)."""
    stderr_line(f"core-rl: warning: {message}")
