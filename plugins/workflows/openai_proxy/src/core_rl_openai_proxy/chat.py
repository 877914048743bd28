"""Token-exact chat: the prompt of a session's next chat call is the previous call's exact prompt
and sampled token ids, followed by the tokens of what is new (the end of the assistant turn the
model did not sample, the new messages, the template's generation prompt). Earlier turns are never
re-tokenised.

With ``render(m, gen)`` the chat template applied to messages ``m`` (``gen``: with the generation
prompt) and ``reply`` the previous call's answer (its text), a call with messages ``new`` extends
the previous call (messages ``old``) when ``new[:len(old) + 1] == old + [assistant: reply]`` and
both ``render(old + [reply], False)`` starts with ``render(old, True) + reply`` and
``render(new, True)`` starts with ``render(old + [reply], False)``. Then

    closed   = render(old + [reply], False)
    close    = closed[len(render(old, True) + reply):]        (the turn's end, e.g. "</s>")
    inserted = encode(close less the sampled stop token's text + render(new, True)[len(closed):])

and the new prompt is ``old prompt ids + sampled ids + inserted``. Anything else is a history
mismatch (:class:`Mismatch`), reported with its reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from core_rl_openai_proxy.errors import RequestError

#: message keys that reach the chat template; others (``refusal``, ``audio``...) are dropped
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class Mismatch(Exception):
    """A call does not extend the session's previous one; the message says where."""


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's ``messages`` as template input: known keys, ``None`` values dropped, a list of
    content parts joined into its text. A malformed list is a :class:`RequestError`."""
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
        """The token ids of a session's first call: the rendered messages with the generation prompt."""
        return self.encode(self.render(messages, tools, True))

    def inserted(
        self,
        old: Sequence[dict[str, Any]],
        reply: str,
        stop_text: str,
        new: Sequence[dict[str, Any]],
        tools: Any,
    ) -> list[int]:
        """The tokens to append after the previous call's prompt and sampled ids (module docstring);
        ``stop_text``: the text of the stop token the model sampled last ("" if it did not stop on one).
        Raises :class:`Mismatch` when ``new`` does not extend ``old`` and ``reply``."""
        expected = [*old, {"role": "assistant", "content": reply}]
        if len(new) <= len(expected):
            raise Mismatch(f"the call has {len(new)} messages; extending the previous one needs > {len(expected)}")
        for i, (got, want) in enumerate(zip(new, expected)):
            keys = ("role", "content") if i == len(old) else MESSAGE_KEYS
            if any(got.get(k) != want.get(k) for k in keys):
                what = "the previous reply" if i == len(old) else "the previous call's"
                shown = f"{got.get('role')}: {str(got.get('content'))[:40]!r}"
                raise Mismatch(f"messages[{i}] differs from {what} ({shown})")
        head = self.render(old, tools, True) + reply
        closed = self.render(expected, tools, False)
        if not closed.startswith(head):
            raise Mismatch("the chat template renders the earlier turns differently once the reply is added")
        rendered = self.render(new, tools, True)
        if not rendered.startswith(closed):
            raise Mismatch("the chat template renders the earlier turns differently once new messages are added")
        close = closed[len(head) :]
        if stop_text and close.startswith(stop_text):
            close = close[len(stop_text) :]
        return self.encode(close + rendered[len(closed) :])
