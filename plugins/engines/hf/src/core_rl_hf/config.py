"""The ``rollout.engine`` section of the ``hf`` engine (validated by the core config loader)."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from core_rl.config.schema import DTYPES
from core_rl.config.validators import FieldValueError, one_of, positive


def _valid_device(_inst: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    """``auto`` or anything :class:`torch.device` parses (``cpu``, ``cuda``, ``cuda:1``, ...)."""
    if value == "auto":
        return
    try:
        torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise FieldValueError(
            attribute.name, value, "must be 'auto' or a torch device such as 'cpu' or 'cuda:0'"
        ) from None


@attrs.define
class HFRolloutConfig:
    """Options of the ``hf`` rollout engine.

    - ``dtype``: the weights' dtype for generation (sampling itself runs in float32).
    - ``device``: ``auto`` (``cuda`` when available, else ``cpu``) or a torch device string.
    - ``max_batch_size``: at most this many sequences (prompts x ``n``) are generated together;
      larger requests are split into chunks of sequences of similar prompt length.
    - ``seed``: seeds the engine's own ``torch.Generator`` so a sequence of ``generate`` calls is
      reproducible; ``None`` samples from torch's global RNG (seeded by the trainer).
    """

    dtype: str = attrs.field(default="float32", validator=one_of(DTYPES))
    device: str = attrs.field(default="auto", validator=_valid_device)
    max_batch_size: int = attrs.field(default=256, validator=positive())
    seed: int | None = None


def resolve_device(device: str) -> torch.device:
    """``auto`` -> ``cuda`` if a GPU is visible else ``cpu``; otherwise ``torch.device(device)``.

    Raises :class:`RuntimeError` when a CUDA device is asked for and none is available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"rollout.engine.device is {device!r} but no CUDA device is available")
    return resolved
