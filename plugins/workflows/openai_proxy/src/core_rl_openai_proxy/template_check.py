"""What ``core-rl train`` and ``core-rl config validate --preflight`` check of the chat template an
agent's calls go through, before any model loads: that there is one (``rollout.workflow.chat_template``
or the tokenizer's own; without one the run stops), that it renders a request's ``tools``, and that
``rollout.workflow.tool_parser`` reads back the tool calls the template writes. The last two are a
warning line each (an agent that calls no tool needs neither); unchecked, they would surface only at
the agent's first request with tools (a 400) or as replies whose tool calls stay text.

The probe: a one-message conversation rendered with and without a one-argument function tool; then
the same conversation with an assistant turn calling that tool, whose text (what the template adds
after the generation prompt) must parse to that call.
"""

from __future__ import annotations

from typing import Any

from core_rl.config.checks import EnvironmentContext

PROBE_TOOL_NAME = "core_rl_probe_tool"
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": PROBE_TOOL_NAME,
        "description": "A tool core-rl renders to check the chat template.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    },
}
PROBE_ARGUMENTS = {"x": 1}


def template_problems(config: Any, context: EnvironmentContext) -> list[str]:
    """The problem (no chat template) that stops the run, naming the key to change; the tools and
    parser findings are printed as warnings (:func:`template_findings`)."""
    problems, warnings = template_findings(config, context)
    from core_rl.errors import warn

    for line in warnings:
        warn(line)
    return problems


def template_findings(config: Any, context: EnvironmentContext) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` (see the module docstring), each line naming the key to change; both
    empty when the template and parser fit, or when the tokenizer cannot be read (the model-directory
    checks say why)."""
    from core_rl.rollout import template_text

    from core_rl_openai_proxy.chat import ChatTemplate
    from core_rl_openai_proxy.errors import RequestError
    from core_rl_openai_proxy.tools import build_tool_parser

    run = context.run
    template_key = context.key("chat_template")
    template = None
    if config.chat_template:
        template, problem = template_text(config.chat_template, template_key)
        if problem is not None:
            return [problem], []
    directory = run.actor.tokenizer_path or run.actor.model_path
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=run.actor.trust_remote_code)
    except Exception:  # an unreadable tokenizer is the model-directory checks' to report
        return [], []
    if template is None and not getattr(tokenizer, "chat_template", None):
        return [
            f"{template_key}: the tokenizer of {directory} has no chat template, and every chat call an agent makes "
            f"is rendered through one: set {template_key} to a Jinja chat template (or a file holding one)"
        ], []
    chat = ChatTemplate(tokenizer, template)
    user = [{"role": "user", "content": "What is 2 + 2?"}]
    try:
        with_tools = chat.render(user, [PROBE_TOOL], True)
        without_tools = chat.render(user, None, True)
    except RequestError as exc:
        return [f"{template_key}: {exc.message}"], []
    if PROBE_TOOL_NAME not in with_tools or with_tools == without_tools:
        return [], [
            f"{template_key}: the chat template does not render a request's 'tools', so an agent's tools would never "
            f"reach the model (such a request is a 400): set {template_key} to a template that renders them"
        ]
    if config.tool_parser is None:
        return [], []
    parser = build_tool_parser(config.tool_parser)
    call = {"id": "call_0", "type": "function", "function": {"name": PROBE_TOOL_NAME, "arguments": PROBE_ARGUMENTS}}
    try:
        full = chat.render([*user, {"role": "assistant", "content": "", "tool_calls": [call]}], [PROBE_TOOL], False)
    except RequestError as exc:
        return [], [
            f"{template_key}: the chat template cannot render an assistant turn that calls a tool: {exc.message}"
        ]
    written = full[len(with_tools) :] if full.startswith(with_tools) else full
    parsed = parser.parse(written) if parser is not None else None
    if parsed is None or not any(c.name == PROBE_TOOL_NAME and c.arguments == PROBE_ARGUMENTS for c in parsed.calls):
        shown = written.strip()[:160]
        return [], [
            f"{context.key('tool_parser')}: {config.tool_parser.name!r} does not read the tool calls this chat "
            f"template writes (for a call of {PROBE_TOOL_NAME}({PROBE_ARGUMENTS}) it writes {shown!r}), so the "
            f"agent would get its tool calls as text: choose the tool parser that matches the template "
            f"(hermes: <tool_call> JSON; llama3_json; tags), or set it to null"
        ]
    return [], []
