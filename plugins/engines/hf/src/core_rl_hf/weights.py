"""Loading full weights (Hugging Face parameter names) into a live model, from memory or disk."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from core_rl.sync.buckets import state_items

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def load_full_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy every tensor of ``state_dict`` into ``model`` (casting to its dtype and device).

    The keys must be exactly the model's ``state_dict()`` keys, except that a key may be left out
    when it names storage shared with a key that is given (tied weights, e.g. ``lm_head.weight``
    tied to the input embeddings). Raises :class:`KeyError` naming missing or unexpected keys and
    :class:`ValueError` naming tensors whose shape differs; then nothing is copied.
    """
    _check_names(model.state_dict(), state_dict, complete=True)
    copy_buckets(model, [state_dict])


def copy_buckets(model: torch.nn.Module, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
    """Copy the tensors of each bucket in turn into ``model``'s own, in place: one fused copy per
    bucket (``torch._foreach_copy_``), cast to the model's dtype and moved to its device on the way
    (so tensors already on that device never pass through host memory), no state dict built.

    Together the buckets must hold what :func:`load_full_state_dict` requires. A bucket holding an
    unexpected or misshapen tensor is refused before any of it is copied; a missing key is only
    known at the end, when the model holds the new weights but that one (the caller must then not
    treat the update as done). On CUDA the device is synchronised before returning, so the copies
    have finished and the time this takes is what they cost.
    """
    own = dict(state_items(model))  # the model's own tensors, by state-dict name
    given: set[str] = set()
    with torch.no_grad():
        for bucket in buckets:
            if not bucket:
                continue
            _check_names(own, bucket, complete=False)
            torch._foreach_copy_([own[k] for k in bucket], list(bucket.values()))
            given.update(bucket)
            del bucket  # not held while the next one is gathered
    _check_names(own, dict.fromkeys(given), complete=True)
    devices = {t.device for t in own.values() if t.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)


def _check_names(own: Mapping[str, torch.Tensor], given: Mapping[str, object], *, complete: bool) -> None:
    """Raise unless every key of ``given`` is one of ``own``'s with its shape (where ``given``
    holds tensors) and, with ``complete``, no key of ``own`` is missing but those tied to a given one."""
    unexpected = sorted(set(given) - set(own))
    missing: list[str] = []
    if complete:
        given_storage = {own[k].data_ptr() for k in given if k in own}
        missing = sorted(k for k in set(own) - set(given) if own[k].data_ptr() not in given_storage)
    if unexpected or missing:
        raise KeyError(
            f"weights do not match the rollout model: missing {_preview(missing)}, unexpected {_preview(unexpected)}"
        )
    wrong = [
        f"{k}: {tuple(v.shape)} vs {tuple(own[k].shape)}"
        for k, v in given.items()
        if isinstance(v, torch.Tensor) and v.shape != own[k].shape
    ]
    if wrong:
        raise ValueError(f"weights have the wrong shape (given vs model): {_preview(wrong)}")


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
