"""The ``python`` tool: runs a program in the code reward's sandbox (core-rl-reward-code: fresh
namespaces, resource limits, capped output) off the event loop; its result is the program's
stdout, then its stderr when it failed."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping
from typing import Any

from core_rl_reward_code.sandbox import SandboxLimits, run_sandboxed

from core_rl_env_tools.tool_env import single_argument


def make_python_tool(timeout_s: float, memory_mb: int):
    """An async tool running ``{"code": ...}`` under these limits."""
    limits = SandboxLimits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)), memory_mb=memory_mb)

    async def python(arguments: Mapping[str, Any]) -> str:
        code = single_argument(arguments, "code")
        result = await asyncio.to_thread(run_sandboxed, [sys.executable, "-I", "main.py"], {"main.py": code}, limits)
        if result.timed_out:
            raise ValueError(f"the program ran past {timeout_s} s")
        if result.exit_code != 0:
            return f"{result.stdout}{result.stderr}".strip()
        return result.stdout.strip()

    return python
