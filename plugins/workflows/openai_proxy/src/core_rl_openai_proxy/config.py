"""The ``rollout.workflow`` section of ``openai_agent`` (imports no torch, no HTTP stack)."""

from __future__ import annotations

from typing import Any

import attrs
from core_rl.config.checks import EnvironmentContext
from core_rl.config.schema import PluginSpec, plugin_section
from core_rl.config.validators import FieldValueError, in_range, one_of, positive
from core_rl.plugins import CALLABLE, TOOL_PARSER


def _program(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not (CALLABLE.match(value) or value.endswith(".py")):
        raise FieldValueError(
            attribute.name,
            value,
            "must be 'package.module:function' or 'path/to/file.py:function' (in-process) or 'path/to/script.py'",
        )


def _reasoning_tags(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (len(value) == 2 and all(isinstance(t, str) and t for t in value)):
        raise FieldValueError(attribute.name, value, 'must be [opening, closing], e.g. ["<think>", "</think>"]')


def _python(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str):
        raise FieldValueError(
            attribute.name, value, "must be a path to a Python interpreter, e.g. /opt/agent-venv/bin/python"
        )


def _requirements(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, list) or not all(isinstance(r, str) and r.strip() for r in value):
        raise FieldValueError(
            attribute.name, value, 'must be a list of pip requirements, e.g. ["openai-agents==0.24.*"]'
        )


@attrs.define
class OpenAIAgentConfig:
    """How an agent program becomes a rollout workflow.

    - ``program``: ``package.module:function`` or ``path/to/file.py:function`` (called in-process
      with ``base_url``, ``api_key`` and ``row`` keyword arguments; an ``async`` function runs on
      the rollout loop, a plain one in a thread; a number it returns is the trajectory's reward) or
      a path to a ``.py`` script (a subprocess of core-rl's interpreter, or of ``python`` /
      the environment of ``requirements``, with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and
      ``CORE_RL_ROW``, the data row as JSON, in its environment; it sets its reward with
      ``POST {base_url}/sessions/{api_key}/reward``).
    - ``args``: extra command-line arguments of a script.
    - ``timeout_s``: wall-clock limit of one episode; past it the program is stopped (a script's
      process group is killed) and the trajectory keeps the calls made so far, scored
      ``timeout_reward``.
    - ``model``: the model name the proxy answers to (``/v1/models``); another name is a 404.
    - ``max_context_tokens``: prompt plus completion limit of one call; a longer prompt is a 400
      (``context_length_exceeded``), and ``max_tokens`` is capped to what fits (and to the run's
      ``rollout.sampling.max_new_tokens``).
    - ``on_history_mismatch``: a chat call whose messages do not extend the session's previous call
      (the client rewrote or dropped history): ``new_trajectory`` closes the current trajectory and
      starts another in the same session (both train, with the session's reward); ``error``
      answers 400 (``history_mismatch``).
    - ``chat_template``: a Jinja chat template (or a path to a file holding one) used instead of the
      tokenizer's own; empty: the tokenizer's. A request's ``tools`` must be rendered by it.
    - ``tool_parser``: the tool-call parser (core's registry: ``hermes``, ``llama3_json``,
      ``tags``, or a plugin's) that turns the sampled text of a chat call carrying ``tools`` into
      ``message.tool_calls``; ``null``: replies stay text.
    - ``reasoning_tags``: ``[opening, closing]`` (e.g. ``["<think>", "</think>"]``): a chat reply's
      text up to the closing tag becomes ``message.reasoning_content`` and the rest its
      ``content`` (:mod:`core_rl_openai_proxy.reasoning`); ``null``: replies are not split.
    - ``host``/``port``: where the proxy listens (port 0: a free port).
    - ``error_reward``: the reward of an episode the agent ended in an error (an exception such
      as the openai-agents SDK's ``MaxTurnsExceeded`` or ``ModelBehaviorError``, a script's
      non-zero exit); its trajectories keep the calls made so far.
    - ``on_error``: ``score`` trains on such an episode at ``error_reward``; ``drop`` leaves it out
      of its group (unless every episode of the row errored: then they are scored).
    - ``max_error_fraction``: the most of a step's episodes that may end in an error; past it the
      run stops, naming the most common error (1: never).
    - ``python``: the interpreter that runs ``program`` (e.g. another venv's ``bin/python``): a
      script's processes, or, for a function, one worker process that imports it once and runs
      every episode (:mod:`core_rl_openai_proxy.agent_worker`); empty: core-rl's own (a function
      then runs in-process), or the environment of ``requirements``.
    - ``requirements``: pip requirements of ``program`` (e.g. ``["openai-agents==0.24.*"]``):
      core-rl builds a venv with them once (cached by their hash, under ``$CORE_RL_HOME``, as
      ``core-rl server-env`` builds server environments) and runs the script, or the function's
      worker, there; core-rl's own environment is never changed.
    """

    program: str = attrs.field(validator=_program)
    args: list[str] = attrs.field(factory=list)
    timeout_s: float = attrs.field(default=300.0, validator=positive(10**6))
    timeout_reward: float = attrs.field(default=0.0, validator=in_range(-(10**6), 10**6))
    model: str = "policy"
    max_context_tokens: int = attrs.field(default=4096, validator=positive(2**24))
    on_history_mismatch: str = attrs.field(default="new_trajectory", validator=one_of(("new_trajectory", "error")))
    chat_template: str = ""
    tool_parser: PluginSpec | None = plugin_section(TOOL_PARSER, factory=lambda: PluginSpec(name="hermes"))  # noqa: RUF009 (an attrs field, like attrs.field)
    reasoning_tags: list[str] | None = attrs.field(default=None, validator=_reasoning_tags)
    host: str = "127.0.0.1"
    port: int = attrs.field(default=0, validator=in_range(0, 65535))
    error_reward: float = attrs.field(default=0.0, validator=in_range(-(10**6), 10**6))
    on_error: str = attrs.field(default="score", validator=one_of(("score", "drop")))
    max_error_fraction: float = attrs.field(default=0.5, validator=in_range(0, 1))
    python: str = attrs.field(default="", validator=_python)
    requirements: list[str] = attrs.field(factory=list, validator=_requirements)

    def check_environment(self, context: EnvironmentContext) -> list[str]:
        """The chat template has one, renders ``tools``, and ``tool_parser`` reads its tool calls
        (:mod:`core_rl_openai_proxy.template_check`)."""
        from core_rl_openai_proxy.template_check import template_problems

        return template_problems(self, context)

    def __attrs_post_init__(self) -> None:
        if self.python and self.requirements:
            raise FieldValueError(
                "requirements",
                self.requirements,
                "cannot be set with python: give one (an interpreter, or what to build)",
            )
