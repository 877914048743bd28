"""The ``trainer.loop`` section of the ``sft`` loop (no torch import)."""

from __future__ import annotations

from typing import ClassVar

import attrs
from core_rl.config.validators import not_empty


@attrs.define
class SFTConfig:
    """``response_key``: the data column holding the target response (text or token ids; the
    prompt is ``data.prompt_key``, with the chat template when ``data.apply_chat_template``).
    ``train_on_prompt``: also train on the prompt's tokens (default: the loss reads only the
    response)."""

    rl_sections: ClassVar[bool] = False
    roles: ClassVar[tuple[str, ...]] = ()  # the role sections it reads

    response_key: str = attrs.field(default="response", validator=not_empty())
    train_on_prompt: bool = False
