"""Token-exact chat: the prompt of a session's next chat call is the previous call's exact prompt
and sampled token ids, followed by the tokens of what is new (the end of the assistant turn the
model did not sample, the new messages, the template's generation prompt). Earlier turns are never
re-tokenised.

With ``render(m, gen)`` the chat template applied to messages ``m`` (``gen``: with the generation
prompt), ``text`` the previous call's sampled text and ``reply`` the assistant message the proxy
returned for it (its content, and its ``tool_calls`` when the text held calls:
:mod:`core_rl_openai_proxy.tools`), a call with messages ``new`` extends the previous call
(messages ``old``) when ``new[:len(old)] == old``, ``new[len(old)]`` is ``reply`` (as the client
sends it back) and more messages follow. The assistant turn is the sampled text itself, never the
template's rendering of ``reply`` (which may write a tool call's JSON differently):

    closed   = render(old + [assistant: text], False)
    close    = closed[len(render(old, True) + text):]         (the turn's end, e.g. "</s>")
    after    = render(new, True)[len(render(new[:len(old) + 1], False)):]   (the new messages)
    inserted = encode(close less the sampled stop token's text + after)

each ``[len(...):]`` requiring the longer rendering to start with the shorter one. The new prompt
is ``old prompt ids + sampled ids + inserted``. Anything else is a history mismatch
(:class:`Mismatch`), reported with its reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from core_rl_openai_proxy.errors import RequestError
from core_rl_openai_proxy.tools import message_tool_calls, same_reply

#: message keys that reach the chat template; others (``refusal``, ``audio``...) are dropped
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class Mismatch(Exception):
    """A call does not extend the session's previous one; the message says where."""


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's ``messages`` as template input: known keys, ``None`` values dropped, a list of
    content parts joined into its text, an assistant's ``tool_calls`` with decoded arguments
    (:func:`~core_rl_openai_proxy.tools.message_tool_calls`). A malformed list is a :class:`RequestError`."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(
                f"messages[{i}] must be an object with a 'role' among {', '.join(ROLES)}", param=f"messages[{i}]"
            )
        item = {k: message[k] for k in MESSAGE_KEYS if message.get(k) is not None}
        content = item.get("content", "")
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", param=f"messages[{i}]")
            content = "".join(parts)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or text parts", param=f"messages[{i}]")
        item["content"] = content
        if "tool_calls" in item:
            item["tool_calls"] = message_tool_calls(item["tool_calls"], f"messages[{i}]")
        out.append(item)
    return out


@attrs.define
class ChatTemplate:
    """The tokenizer's chat template (or ``template``, a Jinja string, in its place)."""

    tokenizer: Any
    template: str | None = None

    def render(self, messages: Sequence[dict[str, Any]], tools: Any, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tools=tools,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as exc:  # the template raised (jinja errors, raise_exception in templates)
            raise RequestError(f"the chat template cannot render these messages: {exc}", param="messages") from exc

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_prompt(self, messages: Sequence[dict[str, Any]], tools: Any) -> list[int]:
        """The token ids of a session's first call: the rendered messages with the generation
        prompt. ``tools`` the template does not render are a 400 (the model would not see them)."""
        text = self.render(messages, tools, True)
        if tools and text == self.render(messages, None, True):
            raise RequestError(
                "the request has 'tools' but the chat template does not render them, so the model would never "
                "see them: set rollout.workflow.chat_template to a template that renders tools, or describe the "
                "tools in a message instead",
                param="tools",
                code="tools_not_rendered",
            )
        return self.encode(text)

    def inserted(
        self,
        old: Sequence[dict[str, Any]],
        text: str,
        reply: dict[str, Any],
        stop_text: str,
        new: Sequence[dict[str, Any]],
        tools: Any,
    ) -> list[int]:
        """The tokens to append after the previous call's prompt and sampled ids (module docstring);
        ``text``: the sampled text, ``reply``: the message returned for it
        (:meth:`~core_rl_openai_proxy.tools.Reply.message`), ``stop_text``: the text of the stop
        token the model sampled last ("" if it did not stop on one). Raises :class:`Mismatch` when
        ``new`` does not extend ``old`` and ``reply``."""
        if len(new) <= len(old) + 1:
            raise Mismatch(f"the call has {len(new)} messages; extending the previous one needs > {len(old) + 1}")
        for i, (got, want) in enumerate(zip(new, old)):
            if any(got.get(k) != want.get(k) for k in MESSAGE_KEYS):
                raise Mismatch(f"messages[{i}] differs from the previous call's ({_shown(got)})")
        if not same_reply(new[len(old)], reply):
            raise Mismatch(f"messages[{len(old)}] differs from the previous reply ({_shown(new[len(old)])})")
        head = self.render(old, tools, True) + text
        closed = self.render([*old, {"role": "assistant", "content": text}], tools, False)
        if not closed.startswith(head):
            raise Mismatch("the chat template renders the earlier turns differently once the reply is added")
        before = self.render(new[: len(old) + 1], tools, False)
        rendered = self.render(new, tools, True)
        if not rendered.startswith(before):
            raise Mismatch("the chat template renders the earlier turns differently once new messages are added")
        close = closed[len(head) :]
        if stop_text and close.startswith(stop_text):
            close = close[len(stop_text) :]
        return self.encode(close + rendered[len(before) :])


def _shown(message: dict[str, Any]) -> str:
    return f"{message.get('role')}: {str(message.get('content'))[:40]!r}"
