"""The server environment's contract (a plugin kind registered through
core_rl.hookspecs.core_rl_register_server_envs): how to build the virtual environment an inference
server runs from."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

from core_rl.errors import CoreRLError


class ServerEnvError(CoreRLError):
    """A server environment cannot be built, found or used."""


@attrs.frozen
class ServerEnvSpec:
    """How to build one server environment.

    - ``name``: what ``core-rl server-env create NAME`` and engine configs call it.
    - ``steps``: per variant (``cpu``, ``cuda``), the commands that build it, each the arguments
      of the environment's own interpreter (``["-m", "pip", "install", "torch==2.13.0"]``).
      Pin every version: the hash of these steps names the environment.
    - ``post_install``: called with the environment's directory after the steps, for fix-ups
      pip cannot express (patching a file, writing a ``.pth``); ``revision`` names its version
      (bump it when the fix-up changes, so environments are rebuilt).
    - ``check``: Python code run by the environment's interpreter at the end; it must exit 0.
    - ``description``: one line for ``core-rl server-env list``.
    """

    name: str
    steps: Mapping[str, Sequence[Sequence[str]]]
    post_install: Callable[[Path], None] | None = None
    revision: str = "1"
    check: str = ""
    description: str = ""

    def steps_for(self, variant: str) -> list[list[str]]:
        if variant not in self.steps:
            raise ServerEnvError(
                f"server environment {self.name!r} has no {variant!r} variant (it has: {', '.join(self.steps)})"
            )
        return [list(step) for step in self.steps[variant]]
