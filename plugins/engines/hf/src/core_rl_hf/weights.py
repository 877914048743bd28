"""Loading full weights (Hugging Face parameter names) into a live model, from memory or disk."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def load_full_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy every tensor of ``state_dict`` into ``model`` (casting to its dtype and device).

    The keys must be exactly the model's ``state_dict()`` keys, except that a key may be left out
    when it names storage shared with a key that is given (tied weights, e.g. ``lm_head.weight``
    tied to the input embeddings). Raises :class:`KeyError` naming missing or unexpected keys and
    :class:`ValueError` naming tensors whose shape differs.
    """
    own = model.state_dict()
    unexpected = sorted(set(state_dict) - set(own))
    given_storage = {own[k].data_ptr() for k in state_dict if k in own}
    missing = sorted(k for k in set(own) - set(state_dict) if own[k].data_ptr() not in given_storage)
    if unexpected or missing:
        raise KeyError(
            f"weights do not match the rollout model: missing {_preview(missing)}, unexpected {_preview(unexpected)}"
        )
    wrong = [
        f"{k}: {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state_dict.items() if v.shape != own[k].shape
    ]
    if wrong:
        raise ValueError(f"weights have the wrong shape (given vs model): {_preview(wrong)}")
    with torch.no_grad():
        for key, value in state_dict.items():
            own[key].copy_(value)


def _preview(items: list[str], limit: int = 5) -> str:
    if not items:
        return "none"
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a Hugging Face directory: the shards listed by
    ``model.safetensors.index.json`` if present, else ``model.safetensors``."""
    root = Path(path)
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    single = root / SAFETENSORS_SINGLE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{root} holds no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}")


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory's safetensors weights, on CPU, keyed by name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        tensors.update(load_file(file, device="cpu"))
    return tensors
