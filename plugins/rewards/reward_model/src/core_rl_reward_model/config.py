"""The ``reward`` section of ``reward_model`` (no torch import)."""

from __future__ import annotations

from typing import Any

import attrs
from core_rl.config.validators import FieldValueError, non_negative, one_of, positive


def _required(_inst: Any, attribute: attrs.Attribute, value: str) -> None:
    if not value:
        raise FieldValueError(attribute.name, value, "required: a Hugging Face sequence-classification model directory")


def _template(_inst: Any, attribute: attrs.Attribute, value: str) -> None:
    if "{response}" not in value:
        raise FieldValueError(attribute.name, value, "must contain {response} (and usually {prompt})")


@attrs.define
class RewardModelConfig:
    """See the package README."""

    model_path: str = attrs.field(default="", validator=_required)
    tokenizer_path: str | None = None
    template: str = attrs.field(default="{prompt}{response}", validator=_template)
    label_index: int = attrs.field(default=0, validator=non_negative())
    transform: str = attrs.field(default="none", validator=one_of(("none", "sigmoid")))
    batch_size: int = attrs.field(default=16, validator=positive())
    max_length: int = attrs.field(default=1024, validator=positive())
    dtype: str = attrs.field(default="float32", validator=one_of(("float32", "bfloat16", "float16")))
    device: str = "cpu"
