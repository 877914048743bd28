"""The adapter a library worker (:mod:`core_rl_server_kit.worker`) runs for an agent function in
another interpreter (``rollout.workflow.program: path/to/agent.py:solve`` with ``python`` or
``requirements``): it imports the function once, and each ``episode`` request runs it for one
episode, many at once (an ``async`` function on the worker's event loop, a plain one in a thread),
answering the number it returned (the episode's reward) or ``None``; an exception it raises is the
request's error, of its class.

It runs in the agent's interpreter, where core-rl is not installed: standard library only."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any


def load_function(target: str) -> Any:
    """``package.module:function`` or ``path/to/file.py:function``."""
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).resolve()
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    function = getattr(module, name)
    if not callable(function):
        raise TypeError(f"{target} is a {type(function).__name__}, not a function")
    return function


class AgentAdapter:
    """One agent function; :meth:`episode` runs it once."""

    def __init__(self, function: Any) -> None:
        self.function = function

    async def episode(self, base_url: str, api_key: str, row: dict[str, Any]) -> float | None:
        kwargs = {"base_url": base_url, "api_key": api_key, "row": row}
        if inspect.iscoroutinefunction(self.function):
            returned = await self.function(**kwargs)
        else:
            returned = await asyncio.to_thread(lambda: self.function(**kwargs))
        number = isinstance(returned, int | float) and not isinstance(returned, bool)
        return float(returned) if number else None


async def open_adapter(options: dict[str, Any]) -> AgentAdapter:
    return AgentAdapter(load_function(options["program"]))
