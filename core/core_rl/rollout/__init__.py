"""The rollout side of a run: the controller, chat templates, stop strings, dumps and replays,
colocation."""

from core_rl.plugins.lazy_exports import lazy_exports

# what plugins import from this package: its public names (core_rl.testing.public_api)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.rollout.chat_template": (
            "prompt_messages",
            "render_conversation",
        ),
        "core_rl.rollout.chat_template_override": ("template_text",),
        "core_rl.rollout.environments": (
            "Action",
            "Environment",
            "StepResult",
        ),
        "core_rl.rollout.stop_strings": (
            "stop_change",
            "stop_cut",
            "text_before_stop",
        ),
        "core_rl.rollout.tool_parsers": (
            "ToolCall",
            "ToolParser",
        ),
        "core_rl.rollout.workflows": (
            "DROPPED_ERRORS",
            "ERROR",
            "ERROR_LIMIT",
            "FAILED",
            "ROW_MEDIA",
            "RolloutWorkflow",
            "WorkflowContext",
            "append_observation",
            "extend_turn",
            "gather_group",
        ),
    },
)
