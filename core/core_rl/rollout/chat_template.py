"""Conversations as token ids through a tokenizer's chat template (torch-free).

A *conversation* is a list of messages ``{"role": str, "content": str}`` in the OpenAI chat
format (a content may also be a list of content parts, e.g. text and images:
:mod:`core_rl.vision.images`). A prompt is rendered ending with the template's generation prompt (what the model
continues). A whole conversation (supervised fine-tuning) is rendered with a mask of the tokens
each assistant turn adds: assistant turn ``k`` covers the tokens from the rendering of the
messages before it, with the generation prompt, to the rendering that ends with it, so the
template's own glue (role headers, the generation prompt) is never trained while the turn's end
of message is. This needs each rendering to be a prefix of the next, which chat templates that
do not rewrite earlier turns satisfy; one that does is refused with a message saying so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: ``apply_chat_template`` arguments core-rl sets itself (not template variables)
CHAT_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def ends_turns_with_eos(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is a chat model's: it has a chat template, and that template ends a
    turn with the tokenizer's end-of-sequence token (written out, as ChatML's ``<|im_end|>``, or as
    the ``eos_token`` variable). An instruct model stops where its turn ends, so its EOS is the
    end of turn; a base model that ships a template (Qwen2.5's base models, for one) ends with a
    document token its template never writes."""
    template = getattr(tokenizer, "chat_template", None)
    eos = getattr(tokenizer, "eos_token", None)
    if not isinstance(template, str) or not isinstance(eos, str) or not eos:
        return False
    return eos in template or "eos_token" in template


def conversation_problem(value: Any) -> str | None:
    """Why ``value`` is not a conversation (a sentence), or ``None`` when it is one: a non-empty
    list of mappings, each with a non-empty string ``role`` and a string ``content``."""
    if not isinstance(value, (list, tuple)) or not value:
        return "a conversation must be a non-empty list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            return f"message {i} is not an object with 'role' and 'content'"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            return f"message {i} has no 'role' (a string such as 'system', 'user' or 'assistant')"
        if not isinstance(content, str) and not _content_parts(content):
            return f"message {i} ({role}) has no text 'content'"  # a string, or a list of content parts
    return None


def _content_parts(content: Any) -> bool:
    """Whether ``content`` is a list of OpenAI/HF content parts (``{"type": "text", "text": ...}``,
    ``{"type": "image", ...}``)."""
    return isinstance(content, (list, tuple)) and all(isinstance(p, Mapping) and "type" in p for p in content)


def prompt_messages(prompt: str | Sequence[Mapping[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """The messages of a prompt: text as one user turn, a conversation as it is; ``system_prompt``
    (when not ``None``) first unless the conversation starts with a system message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _ids(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool, kwargs: Mapping[str, Any]):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True, **kwargs)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], kwargs: Mapping[str, Any]) -> tuple[list[int], str]:
    """Token ids and text of ``messages`` rendered by ``tokenizer``'s chat template, ending with the
    generation prompt; ``kwargs``: template variables."""
    ids = _ids(tokenizer, messages, generation_prompt=True, kwargs=kwargs)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return ids, str(text)


def render_conversation(
    tokenizer: Any, messages: list[dict[str, Any]], kwargs: Mapping[str, Any]
) -> tuple[list[int], list[bool]]:
    """Token ids of a whole conversation and, per token, whether an assistant turn added it (the
    module docstring). Raises ``ValueError`` when the conversation has no assistant turn or the
    template renders a turn's prefix differently from the whole."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise ValueError("the conversation has no assistant message to train on")
    if turns[0] == 0:
        raise ValueError("the conversation starts with an assistant message; start it with a system or user one")
    ids = _ids(tokenizer, messages, generation_prompt=False, kwargs=kwargs)
    mask = [False] * len(ids)
    for turn in turns:
        start = _ids(tokenizer, messages[:turn], generation_prompt=True, kwargs=kwargs)
        end = _ids(tokenizer, messages[: turn + 1], generation_prompt=False, kwargs=kwargs)
        if ids[: len(start)] != start or ids[: len(end)] != end or len(end) < len(start):
            raise ValueError(
                f"the chat template renders the conversation up to message {turn} (assistant) differently from "
                "the whole conversation (it rewrites earlier turns, e.g. drops earlier reasoning), so the "
                "assistant tokens cannot be told apart; train on one assistant turn per row instead"
            )
        mask[len(start) : len(end)] = [True] * (len(end) - len(start))
    return ids, mask
