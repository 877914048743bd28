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

Images (a vision-language model): a user or tool message may hold image content parts
(``image_url`` with a ``data:`` URI or a local path, as the data rows take them:
:mod:`core_rl.vision.images`). The template renders one placeholder per image; each is then
repeated to its image's count and the images become pixel inputs
(:func:`core_rl.vision.prompts.expand_placeholders`), in the first call's prompt or in the inserted
tokens of a later one. A trajectory's pixel inputs are those of all its images so far, in order
(:class:`Encoded`), and every call of it is sampled with them.
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
            content = _content_parts(content, f"messages[{i}]")
        if not isinstance(content, str | list):
            raise RequestError(
                f"messages[{i}].content must be a string or text and image parts", param=f"messages[{i}]"
            )
        item["content"] = content
        if "tool_calls" in item:
            item["tool_calls"] = message_tool_calls(item["tool_calls"], f"messages[{i}]")
        out.append(item)
    return out


#: the content-part types of an image: chat completions' ``image_url``, the Responses API's
#: ``input_image``, Hugging Face's ``image``
IMAGE_PARTS = ("image_url", "input_image", "image")


def _content_parts(content: list[Any], where: str) -> str | list[dict[str, Any]]:
    """A message's content parts as template input: text parts joined into one string when there
    are only those (what every chat template takes), else the parts in order, text as ``{"type":
    "text", "text"}`` and each image as ``{"type": "image_url", "image_url": {"url": SOURCE}}``."""
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind in IMAGE_PARTS:
            value = part.get("image_url") if kind != "image" else part.get("image")
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str) or not url:
                raise RequestError(f"{where}.content[{k}]: an image part needs its url (a data: URI)", param=where)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            shown = kind if kind is not None else type(part).__name__
            raise RequestError(f"{where}.content[{k}] is {shown!r}; text and image parts are supported", param=where)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def image_sources(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The sources of the image parts of ``messages``, in order."""
    return [
        p["image_url"]["url"]
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") == "image_url"
    ]


def _bare(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each image part as a bare ``{"type": "image"}`` (what a chat template
    renders as one placeholder, whatever it calls its image parts)."""
    return [
        {**m, "content": [p if p.get("type") != "image_url" else {"type": "image"} for p in m["content"]]}
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]


@attrs.define
class Encoded:
    """Token ids and the pixel inputs of the images whose placeholders they hold (``None``: no image)."""

    ids: list[int]
    media: dict[str, Any] | None = None


@attrs.define
class ChatTemplate:
    """The tokenizer's chat template (or ``template``, a Jinja string, in its place)."""

    tokenizer: Any
    template: str | None = None

    def render(self, messages: Sequence[dict[str, Any]], tools: Any, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                _bare(messages),
                tools=tools,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as exc:  # the template raised (jinja errors, raise_exception in templates)
            raise RequestError(f"the chat template cannot render these messages: {exc}", param="messages") from exc

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_with_images(self, text: str, sources: Sequence[str], param: str = "messages") -> Encoded:
        """``text``'s ids, and with ``sources`` (the images whose placeholders it holds, in order) its
        placeholders expanded and the images' pixel inputs. An image that cannot be read, or a
        model without an image processor, is a 400."""
        if not sources:
            return Encoded(self.encode(text))
        from core_rl.vision.images import ImageError, load_image
        from core_rl.vision.prompts import expand_placeholders

        try:
            ids, media = expand_placeholders(text, [load_image(s) for s in sources], self.tokenizer)
        except ImageError as exc:
            raise RequestError(f"an image of the request: {exc}", param=param, code="invalid_image") from None
        return Encoded(ids, media)

    def first_prompt(self, messages: Sequence[dict[str, Any]], tools: Any) -> Encoded:
        """The token ids (and pixel inputs) of a session's first call: the rendered messages with
        the generation prompt. ``tools`` the template does not render are a 400 (the model would
        not see them)."""
        text = self.render(messages, tools, True)
        if tools and text == self.render(messages, None, True):
            raise RequestError(
                "the request has 'tools' but the chat template does not render them, so the model would never "
                "see them: set rollout.workflow.chat_template to a template that renders tools, or describe the "
                "tools in a message instead",
                param="tools",
                code="tools_not_rendered",
            )
        return self.encode_with_images(text, image_sources(messages))

    def inserted(
        self,
        old: Sequence[dict[str, Any]],
        text: str,
        reply: dict[str, Any],
        stop_text: str,
        new: Sequence[dict[str, Any]],
        tools: Any,
    ) -> Encoded:
        """The tokens to append after the previous call's prompt and sampled ids (module docstring),
        with the pixel inputs of the images the new messages bring;
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
        return self.encode_with_images(close + rendered[len(before) :], image_sources(new[len(old) + 1 :]))


def _shown(message: dict[str, Any]) -> str:
    return f"{message.get('role')}: {str(message.get('content'))[:40]!r}"
