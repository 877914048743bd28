"""Which models are vision-language models, and their image processor.

A model directory is a vision-language model (VLM) when its ``config.json`` has a ``vision_config``
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3, LLaVA and most Hugging Face VLMs do). Such a model loads
with ``AutoModelForImageTextToText``, and its ``preprocessor_config.json`` with
``AutoImageProcessor``; the image processor is found from the tokenizer's directory
(:func:`image_processor_of`), so every place that holds the tokenizer can encode images.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: the file an image processor is saved in
PROCESSOR_FILE = "preprocessor_config.json"
#: where :func:`image_processor_of` keeps the loaded processor on the tokenizer object
_CACHE_ATTRIBUTE = "_core_rl_image_processor"


def is_vision_language(model_path: str | Path | None) -> bool:
    """Whether the model directory ``model_path`` holds a vision-language model (its
    ``config.json`` has a ``vision_config``); ``False`` for a missing or unreadable one."""
    if not model_path:
        return False
    config = Path(model_path) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def image_processor_of(tokenizer: Any) -> Any | None:
    """The image processor saved beside ``tokenizer`` (in its ``name_or_path`` directory), loaded
    once and kept on the tokenizer; ``None`` when there is none (a text-only model)."""
    if hasattr(tokenizer, _CACHE_ATTRIBUTE):
        return getattr(tokenizer, _CACHE_ATTRIBUTE)
    source = getattr(tokenizer, "name_or_path", None)
    processor = None
    if source and (Path(source) / PROCESSOR_FILE).is_file():
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(source, local_files_only=True)
    setattr(tokenizer, _CACHE_ATTRIBUTE, processor)
    return processor


#: the config keys that name a model's image placeholder token id (Qwen2-VL's, LLaVA's and Gemma 3's
#: ``image_token_id``; older LLaVA configs' ``image_token_index``)
IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")
#: the config keys that give a fixed number of placeholder tokens per image (LLaVA's
#: ``image_seq_length``, Gemma 3's ``mm_tokens_per_image``)
TOKENS_PER_IMAGE_KEYS = ("image_seq_length", "mm_tokens_per_image")


#: the config keys naming a vision-language model's image and video placeholder tokens
PLACEHOLDER_KEYS = ("image_token_id", "video_token_id", "image_token_index")


def placeholder_ids(model_path: str | Path) -> list[int]:
    """The image and video placeholder token ids of the model at ``model_path`` (its ``config.json``,
    :data:`PLACEHOLDER_KEYS`), sorted; ``[]`` for a model that names none."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    return sorted({int(config[k]) for k in PLACEHOLDER_KEYS if isinstance(config.get(k), int)})


def configured_image_token(config: Mapping[str, Any]) -> int | None:
    """The image placeholder token id a model's ``config.json`` (as a dict) names
    (:data:`IMAGE_TOKEN_KEYS`), ``None`` where it names none."""
    return next((int(config[key]) for key in IMAGE_TOKEN_KEYS if isinstance(config.get(key), int)), None)


def image_token_of(model_path: str | Path) -> int | None:
    """:func:`configured_image_token` of the model at ``model_path``."""
    return configured_image_token(json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8")))


def model_config_of(tokenizer: Any) -> dict[str, Any]:
    """The ``config.json`` beside ``tokenizer`` (in its ``name_or_path`` directory) as a dict, ``{}``
    where there is none."""
    source = getattr(tokenizer, "name_or_path", None)
    try:
        return json.loads((Path(source) / "config.json").read_text(encoding="utf-8")) if source else {}
    except (OSError, ValueError):
        return {}


def image_token_id(tokenizer: Any, processor: Any) -> tuple[str, int]:
    """The placeholder token an image's features take the place of (``<|image_pad|>`` for
    Qwen2-VL, ``<image>`` for LLaVA) and its id: the model config's (:data:`IMAGE_TOKEN_KEYS`),
    else the processor's or tokenizer's ``image_token``."""
    configured = configured_image_token(model_config_of(tokenizer))
    if configured is not None:
        return str(tokenizer.convert_ids_to_tokens(configured)), configured
    token = getattr(processor, "image_token", None) or getattr(tokenizer, "image_token", None) or "<|image_pad|>"
    return token, int(tokenizer.convert_tokens_to_ids(token))


def tokens_per_image(tokenizer: Any) -> int | None:
    """The fixed number of placeholder tokens each image takes in the model beside ``tokenizer``
    (:data:`TOKENS_PER_IMAGE_KEYS`), ``None`` where it depends on the image (Qwen2-VL's grid)."""
    config = model_config_of(tokenizer)
    for key in TOKENS_PER_IMAGE_KEYS:
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def auto_model_class(model_path: str | Path | None) -> Any:
    """The transformers auto class that loads ``model_path``'s language-model head:
    ``AutoModelForImageTextToText`` for a vision-language model (:func:`is_vision_language`), else
    ``AutoModelForCausalLM``."""
    import transformers

    if is_vision_language(model_path):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def keep_image_processor(sources: list[str | Path], target: Path) -> bool:
    """Copy the image processor (:data:`PROCESSOR_FILE`) of the first of ``sources`` that has one
    into the exported model directory ``target``, so the export loads as a vision-language model
    again; ``False`` when none has one (a text-only model)."""
    import shutil

    for source in sources:
        found = Path(source) / PROCESSOR_FILE
        if found.is_file():
            shutil.copyfile(found, Path(target) / PROCESSOR_FILE)
            return True
    return False
