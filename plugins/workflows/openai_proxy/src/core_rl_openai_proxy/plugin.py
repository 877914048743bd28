"""Registration of the ``openai_agent`` rollout workflow (entry point group ``core_rl.workflows``).
The HTTP stack is imported when a run builds the workflow, not when core-rl lists plugins."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core_rl.hookspecs import Register, hookimpl

from core_rl_openai_proxy.config import OpenAIAgentConfig

if TYPE_CHECKING:
    from core_rl.rollout import RolloutWorkflow


def make_openai_agent(config: OpenAIAgentConfig) -> RolloutWorkflow:
    """factory(config): loads the agent program (a bad ``program`` is a config error)."""
    from core_rl_openai_proxy.workflow import OpenAIAgentWorkflow

    return OpenAIAgentWorkflow(config)


@hookimpl
def core_rl_register_workflows(register: Register) -> None:
    register(
        "openai_agent",
        make_openai_agent,
        description="An agent program (OpenAI client code) per sample, through an OpenAI-compatible proxy "
        "that records token-exact trajectories",
        config_cls=OpenAIAgentConfig,
    )
