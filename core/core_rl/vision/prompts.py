"""A prompt with images as token ids plus pixel inputs, the way the model's processor makes them.

The chat template renders the messages with one placeholder per image (Qwen2-VL:
``<|vision_start|><|image_pad|><|vision_end|>``, LLaVA: ``<image>``); the image processor turns the
images into ``pixel_values``, and each placeholder token is repeated to the number of vision
embeddings the model puts in its place (:func:`placeholder_counts`). Two layouts of pixel inputs,
told apart by what the processor returns:

- patch rows with a grid (Qwen2-VL family): ``pixel_values`` ``[patches, 3 * temporal_patch *
  patch**2]`` and ``image_grid_thw`` ``[images, 3]`` (frames, rows, columns of patches); an image
  takes ``t * h * w / merge_size**2`` tokens;
- whole images (LLaVA, Gemma 3): ``pixel_values`` ``[images, 3, H, W]``; each image takes the fixed
  number of tokens its config names (``image_seq_length``, ``mm_tokens_per_image``:
  :func:`~core_rl.vision.models.tokens_per_image`). core-rl gives each image the grid ``(1, 1, 1)``
  (one row of ``pixel_values``), so batches keep each row's images the same way
  (:mod:`core_rl.vision.media`); a model whose forward takes no ``image_grid_thw`` never sees it.

The ids and the pixel inputs travel together from here to the engines
(:attr:`core_rl.protocol.Sample.media`), so generation and training see the same inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core_rl.vision.images import ImageError, image_part_source, load_image, row_image_sources
from core_rl.vision.models import image_processor_of, image_token_id, tokens_per_image


def encode_images(images: Sequence[Any], processor: Any) -> dict[str, Any]:
    """The processor's pixel inputs of ``images`` (RGB ``PIL`` images): ``pixel_values`` float32
    (``[patches, D]``, or ``[images, 3, H, W]``) and ``image_grid_thw`` long ``[images, 3]`` (the
    processor's, or ``(1, 1, 1)`` per whole image: the module docstring)."""
    import torch

    out = processor(images=list(images), return_tensors="pt")
    pixel_values = torch.as_tensor(out["pixel_values"], dtype=torch.float32)
    if "image_grid_thw" in out:
        grid = torch.as_tensor(out["image_grid_thw"], dtype=torch.long)
    else:
        grid = torch.ones((pixel_values.shape[0], 3), dtype=torch.long)
    return {"pixel_values": pixel_values, "image_grid_thw": grid}


def placeholder_counts(grid_thw: Any, processor: Any, per_image: int | None = None) -> list[int]:
    """How many placeholder tokens each image of ``grid_thw`` ``[images, 3]`` takes: ``per_image``
    where the model fixes it (:func:`~core_rl.vision.models.tokens_per_image`), else
    ``t * h * w / merge_size**2``."""
    if per_image is not None:
        return [per_image] * len(grid_thw)
    merge = int(getattr(processor, "merge_size", 1))
    return [int(t * h * w) // (merge * merge) for t, h, w in grid_thw.tolist()]


def encode_vision_prompt(
    row: Mapping[str, Any],
    prompt: str | Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    image_key: str,
    max_images: int,
    system_prompt: str | None,
    template_kwargs: Mapping[str, Any],
    base_dir: Path | None = None,
) -> tuple[list[int], str, dict[str, Any]]:
    """Token ids, rendered text and pixel inputs (``pixel_values``, ``image_grid_thw``) of a row's
    prompt with its images (:mod:`core_rl.vision.images`; ``base_dir``: where relative image paths
    start). Raises :class:`~core_rl.vision.images.ImageError` for an image that cannot be read, more
    than ``max_images`` of them, or a model with no image processor."""
    from core_rl.rollout.chat_template import prompt_messages

    processor = image_processor_of(tokenizer)
    if processor is None:
        source = getattr(tokenizer, "name_or_path", "the model")
        raise ImageError(
            f"the row has images but {source} has no image processor ({'preprocessor_config.json'}): "
            "use a vision-language model, or drop the images"
        )
    messages, sources = row_image_sources(row, prompt, image_key)
    if len(sources) > max_images:
        raise ImageError(
            f"the row has {len(sources)} images, more than data.max_images_per_prompt={max_images}; "
            "drop some or raise data.max_images_per_prompt"
        )
    images = [load_image(source, base_dir) for source in sources]
    messages = prompt_messages(messages, system_prompt)
    text = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs))
    ids, media = expand_placeholders(text, images, tokenizer, processor)
    return ids, text, media


def expand_placeholders(
    text: str, images: Sequence[Any], tokenizer: Any, processor: Any | None = None
) -> tuple[list[int], dict[str, Any]]:
    """The token ids of ``text`` (a rendered chat, one image placeholder token per image) with each
    placeholder repeated to its image's count (:func:`placeholder_counts`), and the pixel inputs of
    ``images`` (RGB ``PIL`` images, in placeholder order). ``processor``: the model's image
    processor (default: the one beside ``tokenizer``). Raises :class:`ImageError` when the text
    holds another number of placeholders than there are images."""
    processor = processor if processor is not None else image_processor_of(tokenizer)
    if processor is None:
        raise ImageError(f"{getattr(tokenizer, 'name_or_path', 'the model')} has no image processor")
    token, _ = image_token_id(tokenizer, processor)
    pieces = text.split(token)
    if len(pieces) - 1 != len(images):
        raise ImageError(
            f"the chat template placed {len(pieces) - 1} image placeholders ({token}) for {len(images)} images; "
            "the template does not render image content parts"
        )
    media = encode_images(images, processor)
    expanded = pieces[0]
    counts = placeholder_counts(media["image_grid_thw"], processor, tokens_per_image(tokenizer))
    for count, piece in zip(counts, pieces[1:]):
        expanded += token * count + piece
    return list(tokenizer(expanded, add_special_tokens=False)["input_ids"]), media


#: text no chat template writes, around which :func:`image_markup` finds an image part's rendering
_MARK = "\u2063core-rl-observation\u2063"


def image_markup(tokenizer: Any) -> str:
    """The text the model's chat template writes for one image content part (Qwen2-VL:
    ``<|vision_start|><|image_pad|><|vision_end|>``, LLaVA: ``<image>`` and what follows it): what a
    user message of a text part and an image part renders to, less what the text part alone
    renders to (where the text part's rendering is unchanged around it). Raises :class:`ImageError`
    when that is not one image placeholder token and what surrounds it."""
    processor = image_processor_of(tokenizer)
    if processor is None:
        raise ImageError(f"{getattr(tokenizer, 'name_or_path', 'the model')} has no image processor")
    token, _ = image_token_id(tokenizer, processor)

    def rendered(parts: list[dict[str, Any]]) -> str:
        return str(tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False))

    text = {"type": "text", "text": _MARK}
    without, with_image = rendered([text]), rendered([text, {"type": "image"}])
    head, _, tail = without.partition(_MARK)
    head_with, _, tail_with = with_image.partition(_MARK)
    if head_with == head and tail_with.endswith(tail):  # the image rendered after the text, in place
        markup = tail_with[: len(tail_with) - len(tail)]
    elif tail_with == tail and head_with.startswith(head):  # templates that put a turn's images first
        markup = head_with[len(head) :]
    else:
        markup = ""
    if markup.count(token) != 1:
        raise ImageError(f"the chat template does not render an image content part as one {token} placeholder")
    return markup


def encode_observation(parts: Sequence[Mapping[str, Any]], tokenizer: Any) -> tuple[list[int], dict[str, Any] | None]:
    """The token ids of an environment's observation given as content parts (text parts, and image
    parts as in a data row: :mod:`core_rl.vision.images`), joined in order with each image as
    :func:`image_markup` and its placeholder expanded (:func:`expand_placeholders`), and the pixel
    inputs of its images (``None``: no image). Raises :class:`ImageError` for an image that
    cannot be read or a model with no image processor."""
    pieces: list[str] = []
    images = []
    markup = ""  # the template's rendering of an image part, found at the first image
    for part in parts:
        if part.get("type") == "text":
            pieces.append(str(part["text"]))
            continue
        source = image_part_source(part)
        if source is None:
            raise ImageError(f"the image part {dict(part)!r:.80} names no image ('image' or 'image_url')")
        images.append(load_image(source))
        markup = markup or image_markup(tokenizer)
        pieces.append(markup)
    text = "".join(pieces)
    if not images:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else [], None
    return expand_placeholders(text, images, tokenizer)
