"""Checks of how weights travel from a train engine to a rollout engine
(:func:`core_rl.sync.weight_sync.sync_in_memory`), for engine tests:

- :func:`check_weight_buckets`: an engine's buckets hold what its full state dict holds;
- :func:`assert_same_adapter`: two LoRA adapter directories hold the same config and tensors (an
  engine's ``export_adapter`` against the adapter its ``export_hf`` writes);
- :class:`HostTrips` records every ``Tensor.cpu()`` / ``Tensor.to(<cpu>)`` call: on a GPU each is
  a trip through host memory; on a CPU machine they cost nothing, yet show the same path;
- :class:`DataOps` records every aten operation that runs (through a ``TorchDispatchMode``), with
  the bytes written by copies, so a test can say which operations touched the weights and how often.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from core_rl.interfaces import TrainEngine

#: operations that only make a new view of, or reference to, existing storage
VIEW_OPS = frozenset({"aten.detach", "aten.alias", "aten.view", "aten._unsafe_view", "aten.as_strided"})


def assert_same_adapter(got: Path, want: Path) -> None:
    """Assert that the LoRA adapter directories ``got`` and ``want`` (peft's ``save_pretrained``
    format) hold the same ``adapter_config.json`` and the same tensors (names, dtypes, values)."""
    import json

    from safetensors.torch import load_file

    config = [json.loads((d / "adapter_config.json").read_text()) for d in (got, want)]
    assert config[0] == config[1], f"{got}: adapter config differs from {want}'s"
    tensors = [load_file(str(d / "adapter_model.safetensors")) for d in (got, want)]
    assert tensors[0].keys() == tensors[1].keys() and tensors[0], f"{got}: {sorted(tensors[0])} != {sorted(tensors[1])}"
    for name, value in tensors[0].items():
        assert value.dtype == tensors[1][name].dtype and torch.equal(value, tensors[1][name]), name


def check_weight_buckets(engine: TrainEngine, bucket_bytes: int = 4096) -> int:
    """Assert that ``engine.hf_weight_buckets(bucket_bytes)`` holds, together and each name once,
    what ``engine.full_state_dict()`` holds (same dtypes, equal values), but that a tied weight
    repeated there under a second name may be left out; return how many buckets there were. One
    process (the main rank)."""
    full = engine.full_state_dict()
    seen: dict[str, torch.Tensor] = {}
    count = 0
    for bucket in engine.hf_weight_buckets(bucket_bytes):
        count += 1
        assert not set(bucket) & set(seen), f"names in two buckets: {sorted(set(bucket) & set(seen))}"
        seen.update({k: v.detach().cpu().clone() for k, v in bucket.items()})
    tied = {k for k in set(full) - set(seen) if any(torch.equal(full[k], full[g]) for g in seen)}
    assert set(seen) | tied == set(full), f"missing {sorted(set(full) - set(seen) - tied)}"
    for key, value in seen.items():
        assert value.dtype == full[key].dtype and torch.equal(value, full[key]), key
    return count


class HostTrips:
    """Context manager: ``calls`` lists ``(method, shape)`` of each ``cpu()`` or ``to()`` call that
    asks for the CPU device while it is active (on any thread)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __enter__(self) -> HostTrips:
        self._cpu, self._to = torch.Tensor.cpu, torch.Tensor.to
        trips, cpu, to = self, self._cpu, self._to

        def watched_cpu(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            trips.calls.append(("cpu", tuple(tensor.shape)))
            return cpu(tensor, *args, **kwargs)

        def watched_to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            device = torch._C._nn._parse_to(*args, **{k: v for k, v in kwargs.items() if k != "copy"})[0]
            if device is not None and device.type == "cpu":
                trips.calls.append(("to", tuple(tensor.shape)))
            return to(tensor, *args, **kwargs)

        torch.Tensor.cpu, torch.Tensor.to = watched_cpu, watched_to  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.cpu, torch.Tensor.to = self._cpu, self._to  # type: ignore[method-assign]


class DataOps(TorchDispatchMode):
    """Context manager: ``counts`` (operation name -> calls) of every aten operation run in this
    thread while it is active; ``written`` (name -> bytes) of the in-place copies among them."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.written: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func.overloadpacket)
        self.counts[name] += 1
        if name in ("aten.copy_", "aten._foreach_copy_"):
            targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.written[name] += sum(t.numel() * t.element_size() for t in targets)
        return func(*args, **(kwargs or {}))

    def data_ops(self) -> dict[str, int]:
        """The operations that are more than views (see :data:`VIEW_OPS`)."""
        return {k: v for k, v in self.counts.items() if k not in VIEW_OPS}
