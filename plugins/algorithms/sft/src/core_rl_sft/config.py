"""The ``trainer.loop`` section of the ``sft`` loop (no torch import)."""

from __future__ import annotations

from typing import ClassVar

import attrs
from core_rl.config.checks import SectionContext
from core_rl.config.validators import not_empty


@attrs.define
class SFTConfig:
    """``response_key``: the data column holding the target response (text or token ids; the
    prompt is ``data.prompt_key``, with the chat template when ``data.apply_chat_template``).
    ``train_on_prompt``: also train on the prompt's tokens (default: the loss reads only the
    response).

    ``conversations``: the prompt column instead holds whole conversations (lists of messages,
    rendered by the chat template: ``data.apply_chat_template: true``), and the loss reads every
    assistant turn, each with its end of turn, never the template's role headers or the other
    turns (:func:`core_rl.chat_template.render_conversation`); ``response_key`` and
    ``train_on_prompt`` do not apply, and ``data.max_prompt_tokens`` bounds the whole
    conversation."""

    rl_sections: ClassVar[bool] = False
    roles: ClassVar[tuple[str, ...]] = ()  # the role sections it reads

    response_key: str = attrs.field(default="response", validator=not_empty())
    train_on_prompt: bool = False
    conversations: bool = False

    def check_config(self, context: SectionContext) -> list[str]:
        if self.conversations and not context.run.data.apply_chat_template:
            return [
                f"{context.key('conversations')}: true renders each conversation with the chat template; "
                "set data.apply_chat_template: true"
            ]
        if self.conversations and self.train_on_prompt:
            return [
                f"{context.key('train_on_prompt')}: does not apply to conversations (the loss reads the assistant "
                "turns); remove it"
            ]
        return []
