"""Images of a data row, read into RGB ``PIL`` images.

Where a row's images come from (:func:`row_image_sources`): its ``data.image_key`` column (a list,
or one image), and image content parts inside the prompt's messages in the OpenAI/HF form:
``{"type": "image", "image": SOURCE}``, ``{"type": "image_url", "image_url": {"url": SOURCE}}``
or a bare ``{"type": "image"}``, which takes the column's next image. Text prompts with images get
one user turn whose parts are the images, then the text.

A SOURCE (:func:`load_image`) is a file path (a relative one is taken from the data file's folder),
a ``data:image/...;base64,...`` URI, raw bytes, a ``datasets`` Image cell ``{"bytes": ..., "path":
...}`` or a ``PIL.Image``. ``http(s)://`` URLs are refused: a run reads no network; download them
first. Any failure raises :class:`ImageError` with a sentence the data checks put after the row's
file:line.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: content-part types that stand for an image
IMAGE_PART_TYPES = ("image", "image_url")
#: what installs Pillow, through which images are read (core-rl's ``vision`` extra)
PILLOW_INSTALL = 'pip install "core-rl[vision]"'


class ImageError(ValueError):
    """An image of a row cannot be read: what and why, in one sentence."""


def missing_pillow_problems(model_path: str | Path | None, key: str) -> list[str]:
    """One problem, naming ``key``, where ``model_path`` holds a vision-language model
    (:func:`~core_rl.vision.models.is_vision_language`) and Pillow, which reads its images and which
    its image processor needs, is not installed (it is no dependency of core-rl's own: the
    ``vision`` extra installs it); none otherwise."""
    from core_rl.vision.models import is_vision_language

    if not is_vision_language(model_path):
        return []
    try:
        import PIL  # noqa: F401  (light: the package's __init__ only)
    except ImportError:
        return [
            f"{key}: {model_path} is a vision-language model, and reading its images needs Pillow, which is not "
            f"installed; {PILLOW_INSTALL} (or pip install pillow)"
        ]
    return []


def _describe(source: Any) -> str:
    if isinstance(source, (bytes, bytearray)):
        return f"{len(source)} bytes"
    text = repr(source)
    return text if len(text) <= 60 else text[:57] + "..."


def image_part_source(part: Mapping[str, Any]) -> Any:
    """The source a content part names itself (``None``: it takes the column's next image)."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, Mapping) else url
    for key in ("image", "path", "url"):
        if part.get(key) is not None:
            return part[key]
    return None


def _is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES


def has_images(row: Mapping[str, Any], prompt: Any, image_key: str) -> bool:
    """Whether ``row`` carries images: a non-empty ``image_key`` column, or image parts in ``prompt``'s messages."""
    column = row.get(image_key)
    if column is not None and column != []:
        return True
    if isinstance(prompt, (list, tuple)):
        return any(
            _is_image_part(part)
            for message in prompt
            if isinstance(message, Mapping) and isinstance(message.get("content"), (list, tuple))
            for part in message["content"]
        )
    return False


def row_image_sources(
    row: Mapping[str, Any], prompt: str | Sequence[Mapping[str, Any]], image_key: str
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The prompt as messages whose image parts are bare ``{"type": "image"}`` (what a chat
    template renders as a placeholder), and the image sources in placeholder order (module
    docstring). Raises :class:`ImageError` when the column's images and the bare parts disagree in number."""
    column = row.get(image_key)
    pool = [] if column is None else list(column) if isinstance(column, (list, tuple)) else [column]
    if isinstance(prompt, str):
        parts = [{"type": "image"} for _ in pool] + [{"type": "text", "text": prompt}]
        return [{"role": "user", "content": parts}], pool
    messages, sources, taken = [], [], 0
    for message in prompt:
        content = message.get("content")
        if not isinstance(content, (list, tuple)):
            messages.append(dict(message))
            continue
        parts = []
        for part in content:
            if not _is_image_part(part):
                parts.append(dict(part) if isinstance(part, Mapping) else {"type": "text", "text": str(part)})
                continue
            source = image_part_source(part)
            if source is None:
                if taken >= len(pool):
                    raise ImageError(
                        f"the messages have more image parts without a source than column {image_key!r} has images "
                        f"({len(pool)})"
                    )
                source, taken = pool[taken], taken + 1
            sources.append(source)
            parts.append({"type": "image"})
        messages.append({**message, "content": parts})
    if taken < len(pool):
        if taken:
            raise ImageError(
                f"column {image_key!r} has {len(pool)} images but the messages place only {taken} of them; "
                "give every image a {'type': 'image'} part"
            )
        first_user = next((m for m in messages if m.get("role") == "user"), None)
        if first_user is None:
            raise ImageError(f"column {image_key!r} has images but the conversation has no user message to hold them")
        content = first_user["content"]
        text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        first_user["content"] = [{"type": "image"} for _ in pool] + text
        sources = list(pool) + sources
    return messages, sources


def load_image(source: Any, base_dir: Path | None = None) -> Any:
    """``source`` (module docstring) as an RGB ``PIL.Image``; raises :class:`ImageError`."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, Mapping):  # a datasets Image cell
        if source.get("bytes") is not None:
            return load_image(bytes(source["bytes"]), base_dir)
        if source.get("path") is not None:
            return load_image(str(source["path"]), base_dir)
        raise ImageError(f"image {_describe(source)} has neither 'bytes' nor 'path'")
    if isinstance(source, (bytes, bytearray)):
        data, what = bytes(source), f"image ({_describe(source)})"
    elif isinstance(source, str) and source.startswith("data:"):
        try:
            data = base64.b64decode(source.split(",", 1)[1], validate=True)
        except (IndexError, binascii.Error) as exc:
            raise ImageError(f"image {_describe(source)} is not valid base64 data: {exc}") from None
        what = f"image {_describe(source)}"
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        raise ImageError(f"image {source!r} is a URL; a run reads no network: download it and give the file's path")
    elif isinstance(source, str) and source:
        path = Path(source)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise ImageError(f"image file {source!r} does not exist (looked for {path})")
        data, what = path.read_bytes(), f"image file {source!r}"
    else:
        raise ImageError(f"image {_describe(source)} is not a path, data: URI, bytes or datasets Image")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageError(f"{what} cannot be decoded as an image ({type(exc).__name__}: {exc})") from None
    return image.convert("RGB")
