"""Test hook: faults injected into a weight sync, for the tests that show the sync check
(:mod:`core_rl.sync.check`) catching each one at the step it happens. No real part
produces these on demand; the check that catches them is the real one.

``CORE_RL_TEST_SYNC_FAULT=KIND:VERSION`` alters the sync of weight version ``VERSION`` (a step
number) after the trainer's side has taken its fingerprints, on the way to the rollout engine:

- ``skip``: the first tensor sent is left out;
- ``swap``: the two halves (along the first dimension) of the first tensor with an even, distinct
  pair of halves change places, as two ranks' shards joined in the wrong order would;
- ``bf16``: the first float32 tensor that bfloat16 cannot hold exactly is rounded to bfloat16 and
  back (a float32 receiver then gets float32 with bfloat16's values);
- ``stale_adapter``: with ``rollout.lora_sync: adapter`` the rollout engine is handed the previous
  version's adapter directory instead of this one's.

With ``weight_sync: disk`` the first three rewrite the exported directory before the engine reads it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import attrs
import torch

#: the hook's variable (module docstring)
VARIABLE = "CORE_RL_TEST_SYNC_FAULT"
KINDS = ("skip", "swap", "bf16", "stale_adapter")


def injected(version: int) -> SyncFault | None:
    """The fault the hook asks for in the sync of ``version``, or ``None``."""
    value = os.environ.get(VARIABLE, "")
    if not value:
        return None
    kind, at = value.split(":", 1)
    if kind not in KINDS:
        raise ValueError(f"{VARIABLE}: unknown fault {kind!r} (one of {', '.join(KINDS)})")
    return SyncFault(kind) if int(at) == version else None


@attrs.define
class SyncFault:
    """One injected fault; it alters the first tensor it applies to and nothing after."""

    kind: str
    done: bool = False

    def _alter(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``tensor`` altered, the same object (``skip``), or ``None``: not one this fault applies to."""
        if self.kind == "skip":
            return tensor
        if self.kind == "swap" and tensor.dim() >= 1 and tensor.shape[0] % 2 == 0 and tensor.shape[0] >= 2:
            first, second = tensor.detach().chunk(2)
            if not torch.equal(first, second):
                return torch.cat([second, first]).contiguous()
        if self.kind == "bf16" and tensor.dtype == torch.float32:
            rounded = tensor.detach().to(torch.bfloat16).to(torch.float32)
            if not torch.equal(rounded, tensor.detach()):
                return rounded
        return None

    def items(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``items`` with the fault applied to the first tensor it applies to."""
        for name, tensor in items:
            altered = None if self.done else self._alter(tensor)
            if altered is None:
                yield name, tensor
                continue
            self.done = True
            if self.kind != "skip":
                yield name, altered

    def buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """Weight buckets with the fault applied (see :meth:`items`)."""
        for bucket in buckets:
            yield dict(self.items(bucket.items()))
            del bucket  # not held while the next one is gathered

    def state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict with the fault applied (the given one is left as it is)."""
        return dict(self.items(state.items()))

    def rewrite_dir(self, path: Path) -> None:
        """Apply the fault to the ``*.safetensors`` files of an exported directory, in place."""
        from safetensors.torch import load_file, save_file

        for file in sorted(Path(path).glob("*.safetensors")):
            tensors = load_file(file)
            save_file(self.state(tensors), file, metadata={"format": "pt"})
