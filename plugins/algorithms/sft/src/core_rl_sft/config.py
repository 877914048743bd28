"""The ``trainer.loop`` section of the ``sft`` loop (no torch import)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from core_rl.config.checks import SectionContext
from core_rl.config.validators import not_empty

if TYPE_CHECKING:
    from core_rl.config.data_config import DataConfig
    from core_rl.data import PromptItem
    from core_rl.loops.supervised import TrainSequence


@attrs.define
class SFTConfig:
    """``response_key``: the data column holding the target response (text or token ids; the
    prompt is ``data.prompt_key``, with the chat template when ``data.apply_chat_template``).
    ``train_on_prompt``: also train on the prompt's tokens (default: the loss reads only the
    response).

    ``conversations``: the prompt column instead holds whole conversations (lists of messages,
    rendered by the chat template: ``data.apply_chat_template: true``), and the loss reads every
    assistant turn, each with its end of turn, never the template's role headers or the other
    turns (:func:`core_rl.rollout.chat_template.render_conversation`); ``response_key`` and
    ``train_on_prompt`` do not apply, and ``data.max_prompt_tokens`` bounds the whole
    conversation.

    ``data.max_length`` bounds ``prompt + response + EOS`` (a conversation: its whole rendering);
    with ``data.truncation: truncate`` the response is cut at the end (a conversation too: the
    tokens before its first assistant token are its prompt, never cut; the assistant tokens kept
    stay trained, a turn cut short loses its end of turn)."""

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

    def row_sequences(self, item: PromptItem, tokenizer: Any, data: DataConfig) -> list[TrainSequence]:
        """The row's one sequence: its prompt and response (with EOS), or with ``conversations`` its
        rendered conversation split before the first assistant token, ``trained`` on the assistant
        turns (:func:`core_rl.rollout.chat_template.render_conversation`)."""
        from core_rl.errors import DataError
        from core_rl.loops.supervised import TrainSequence, response_tokens
        from core_rl.rollout import prompt_messages, render_conversation

        if not self.conversations:
            response = response_tokens(item, self.response_key, tokenizer)
            return [TrainSequence(item.prompt_ids, response, media=item.media)]
        messages = prompt_messages(item.row[data.prompt_key], data.system_prompt)
        try:
            ids, mask = render_conversation(tokenizer, messages, data.chat_template_kwargs)
        except ValueError as exc:
            where = item.where or f"data row {item.text[:60]!r}"
            raise DataError([f"{where}: column {data.prompt_key!r}: {exc}"]) from None
        first = mask.index(True)
        return [TrainSequence(ids[:first], ids[first:], trained=mask)]
