"""A chat reply's reasoning apart from its answer (``rollout.workflow.reasoning_tags``), as
reasoning-model servers return it: the sampled text up to the closing tag, without the opening tag,
is ``message.reasoning_content``; the rest, with the whitespace after the closing tag removed, is
the answer (``content``, and what tool calls are parsed from). A reply whose text has no closing
tag is all answer, unless it starts with the opening tag (the model was cut off while reasoning:
all reasoning, an empty answer). Templates that write the opening tag into the generation prompt
(DeepSeek-R1's) give replies without it, which this covers too. Only the reply is split: the
trajectory keeps the sampled token ids, and a client sending the assistant message back without
its ``reasoning_content`` continues it."""

from __future__ import annotations

from collections.abc import Sequence


def split_reasoning(text: str, tags: Sequence[str] | None) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of ``text`` with ``tags = (opening, closing)`` (module docstring);
    ``(None, text)`` without tags or reasoning."""
    if not tags:
        return None, text
    opening, closing = tags
    head, found, tail = text.partition(closing)
    if not found:
        if text.lstrip().startswith(opening):
            return text.lstrip()[len(opening) :].strip(), ""
        return None, text
    head = head.lstrip()
    if head.startswith(opening):
        head = head[len(opening) :]
    return head.strip(), tail.lstrip()
