"""Registration of the environments ``calculator``, ``python`` and ``reward`` (entry-point group
``core_rl.environments``). A factory runs once per trajectory; the reward and parser it uses are
built once per configuration section and shared."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core_rl.hookspecs import Register, hookimpl

from core_rl_env_tools.config import PythonEnvConfig, RewardEnvConfig, ToolEnvConfig
from core_rl_env_tools.tool_env import RewardEnvironment, ToolEnvironment, single_argument

_BUILT: dict[int, tuple[Any, Any]] = {}


def built(spec: Any) -> Any:
    """``spec.build()``, once per section object (kept for the process's life, like the run's config)."""
    hit = _BUILT.get(id(spec))
    if hit is None or hit[0] is not spec:
        hit = _BUILT[id(spec)] = (spec, spec.build())
    return hit[1]


async def calculator(arguments: Mapping[str, Any]) -> str:
    from core_rl_env_tools.calculator import calculate

    return calculate(single_argument(arguments, "expression"))


def make_calculator(config: ToolEnvConfig) -> ToolEnvironment:
    return ToolEnvironment({"calculator": calculator}, built(config.parser), built(config.reward), config)


def make_python(config: PythonEnvConfig) -> ToolEnvironment:
    from core_rl_env_tools.python_tool import make_python_tool

    tool = make_python_tool(config.timeout_s, config.memory_mb)
    return ToolEnvironment({"python": tool}, built(config.parser), built(config.reward), config)


def make_reward_env(config: RewardEnvConfig) -> RewardEnvironment:
    return RewardEnvironment(built(config.reward))


@hookimpl
def core_rl_register_environments(register: Register) -> None:
    register(
        "calculator",
        make_calculator,
        config_cls=ToolEnvConfig,
        description="tool 'calculator' (arithmetic); the answer (a turn without a call) is scored by a reward",
    )
    register(
        "python",
        make_python,
        config_cls=PythonEnvConfig,
        description="tool 'python' (runs code in the code reward's sandbox); the answer is scored by a reward",
    )
    register("reward", make_reward_env, config_cls=RewardEnvConfig, description="any reward as a one-turn environment")
