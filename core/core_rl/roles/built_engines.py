"""What the core notes about each train engine a run builds (:func:`core_rl.roles.build.build_engine`):
its role, section, device and the device memory its build took. The ``auto`` micro-batch budgets
(:mod:`core_rl.loops.auto_budget`) and the memory metrics (:mod:`core_rl.loops.memory`) read it.

An engine says where it computes through a ``device`` attribute (a :class:`torch.device`, as the
``fsdp``, ``deepspeed`` and ``megatron`` engines have); an engine without one counts as on the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from core_rl.config.schema import ActorConfig


@attrs.define
class BuiltEngine:
    """One built train engine: ``role`` (``actor``, ``ref``, ``critic``, ``teacher``,
    ``reward_model``), the ``section`` it was built from (a ``ref`` without its own section has the
    actor's), whether it trains, its ``head``, and ``weight_bytes``: the CUDA memory this rank
    allocated while building it (its weights and whatever it keeps from the start; 0 on a CPU)."""

    role: str
    section: ActorConfig
    engine: Any
    trainable: bool
    head: str = "lm"
    weight_bytes: int = 0

    @property
    def device(self) -> torch.device:
        return device_of(self.engine)


def device_of(engine: Any) -> torch.device:
    """The device an engine computes on: its ``device`` attribute, else the CPU."""
    import torch

    device = getattr(engine, "device", None)
    try:
        return torch.device(device) if device is not None else torch.device("cpu")
    except (TypeError, RuntimeError, ValueError):  # an attribute of another meaning
        return torch.device("cpu")


def cuda_allocated() -> dict[int, int]:
    """Bytes torch has allocated on each CUDA device, by index; empty while CUDA is not in use
    (asking would start it, on a machine where the run may not use the GPU at all)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {i: torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())}


def weight_bytes_since(before: dict[int, int], engine: Any) -> int:
    """The CUDA memory allocated on ``engine``'s device since ``before`` (:func:`cuda_allocated`)."""
    device = device_of(engine)
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else 0
    return max(cuda_allocated().get(index, 0) - before.get(index, 0), 0)
