"""float16's dynamic loss scale in a checkpoint.

With ``mixed_precision: float16`` DeepSpeed scales the loss by a factor it adapts as training goes
(halved after a step whose gradients overflow, doubled after ``loss_scale_window`` clean steps,
with a hysteresis of tolerated overflows). A resumed run that started again from the initial scale
would skip steps the uninterrupted run trained (each overflow at a scale the run had already left
behind), so the scaler's counters go into ``meta.json`` and come back on load. A static scaler
(bf16, fp32, a fixed ``loss_scale``) has nothing to save.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: the counters of DeepSpeed's ``DynamicLossScaler`` that change while training
FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _dynamic_scaler(optimizer: Any) -> Any:
    scaler = getattr(optimizer, "loss_scaler", None)
    return scaler if scaler is not None and getattr(scaler, "dynamic", False) else None


def loss_scale_state(optimizer: Any) -> dict[str, float] | None:
    """The dynamic loss scaler's counters of a DeepSpeed ZeRO ``optimizer`` (JSON numbers), or
    ``None`` when it scales statically or not at all."""
    scaler = _dynamic_scaler(optimizer)
    if scaler is None:
        return None
    return {field: getattr(scaler, field) for field in FIELDS}


def restore_loss_scale(optimizer: Any, state: Mapping[str, float] | None) -> None:
    """Set the counters :func:`loss_scale_state` saved (nothing when either side has no dynamic
    scaler: a checkpoint of another precision starts from the configured scale)."""
    scaler = _dynamic_scaler(optimizer)
    if scaler is None or state is None:
        return
    for field in FIELDS:
        setattr(scaler, field, type(getattr(scaler, field))(state[field]))
