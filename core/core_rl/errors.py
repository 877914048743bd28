"""Errors raised by core-rl that the CLI reports as a short message (exit status 2)."""

from __future__ import annotations


class CoreRLError(Exception):
    """Base class of user-facing errors: the message alone says what is wrong and what to do.
    ``exit_code`` is the ``core-rl`` command's exit status for it (see :mod:`core_rl.cli`)."""

    exit_code: int = 2


class ConfigError(CoreRLError):
    """A configuration is invalid. ``problems`` lists one line per problem, each naming its key path."""

    def __init__(self, problems: list[str] | str, *, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration{where}:\n{lines}")


class PluginError(CoreRLError):
    """A plugin is missing, blocked, failed to import, or registered a conflicting name."""


class DataError(CoreRLError):
    """A data row is malformed; the message names the file and the row."""
