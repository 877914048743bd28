"""Fingerprints of synced weights: what the verified weight sync compares on both sides.

A tensor's fingerprint is a float64 number drawn from :data:`SAMPLES` of its elements at strided
positions over the flattened tensor, the first one at an offset derived from the tensor's name and
the weight version (so every version samples other elements, and two tensors of one shape other
positions): ``sum((i + 1) * x[p_i])`` in float64, each sampled element first cast to the dtype the
tensor travels in. Weighting each sample by its rank makes the fingerprint change when the samples
trade places, as they do when two shards of a tensor are joined in the wrong order.

Both sides compute it with this one function on the tensors *as sent and as received*, before a
rollout engine's loader casts them to its own dtype or fuses them (vLLM's ``qkv_proj`` and
``gate_up_proj``): names are then the Hugging Face names on both sides and no side needs to know
the other's layout. The sum runs on the CPU over at most :data:`SAMPLES` values, so the same
values give the same number on any device.

This module imports only torch (and the standard library), so a server-side worker extension may
load it by file path (``importlib``), as it loads :mod:`core_rl_server_kit.weight_group`.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

#: elements sampled per tensor
SAMPLES = 16


def positions(name: str, version: int, numel: int, samples: int = SAMPLES) -> range:
    """The flat positions sampled from a tensor of ``numel`` elements named ``name`` at weight
    ``version``: every one for a tensor of at most ``samples`` elements, else ``samples`` positions
    ``stride`` apart (``stride = numel // samples``) from an offset below ``stride`` derived from
    the name and the version. Deterministic across processes and machines (a hash of the name, not
    Python's salted :func:`hash`)."""
    if numel <= samples:
        return range(numel)
    stride = numel // samples
    digest = hashlib.blake2b(f"{name}@{version}".encode(), digest_size=8).digest()
    offset = int.from_bytes(digest, "little") % stride
    return range(offset, offset + samples * stride, stride)


def prefix_numel(shape: Sequence[int], prefix: int | None) -> int:
    """How many elements, from the start of the flattened tensor of ``shape``, the samples are
    drawn from: all of them when ``prefix`` is ``None``, else those of the fewest leading rows
    (along the first dimension) that hold at least ``prefix`` elements (a 1-D tensor's rows are its
    elements). For a rollout engine that can read back only a tensor's first rows
    (:attr:`core_rl.interfaces.RolloutEngine.fingerprint_prefix`)."""
    numel = math.prod(shape)
    if prefix is None or not shape or numel <= prefix or shape[0] == 0:
        return numel
    row = numel // shape[0]
    return min(numel, -(-prefix // row) * row) if row else numel


def _sampled(name: str, tensor: torch.Tensor, version: int, prefix: int | None) -> torch.Tensor:
    """The elements of ``tensor`` at :func:`positions` (drawn over its first :func:`prefix_numel`
    elements) as a strided view, where ``tensor`` is (no copy unless it is not contiguous)."""
    flat = tensor.detach().reshape(-1)
    index = positions(name, version, prefix_numel(tuple(tensor.shape), prefix))
    # the positions are evenly spaced: a strided slice reads them without an index tensor
    return flat[index.start : index.stop : index.step]


def sample(name: str, tensor: torch.Tensor, version: int, prefix: int | None = None) -> torch.Tensor:
    """The elements of ``tensor`` at :func:`positions` (drawn over its first
    :func:`prefix_numel` elements), in its own dtype, on the CPU (a copy)."""
    return _sampled(name, tensor, version, prefix).to("cpu", copy=True)


def sample_all(
    items: Iterable[tuple[str, torch.Tensor]], version: int, prefix: int | None = None
) -> dict[str, torch.Tensor]:
    """:func:`sample` of each ``(name, tensor)`` of ``items``, by name in their order, with one copy
    per dtype and device rather than one per tensor (a weight sync samples every tensor of the
    model; the copies, not the elements, are its cost). A name seen twice keeps its last samples."""
    views = {name: _sampled(name, tensor, version, prefix) for name, tensor in items}
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name, view in views.items():
        groups.setdefault((view.dtype, view.device), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for names in groups.values():
        joined = torch.cat([views[n] for n in names]).to("cpu")  # cat copies already
        out.update(zip(names, joined.split([views[n].numel() for n in names])))
    return {name: out[name] for name in views}


def _weighted_sum(values: list[float]) -> float:
    """``sum((i + 1) * x_i)`` over ``values`` (float64 numbers), summed in order."""
    return float(sum(map(operator.mul, range(1, len(values) + 1), values)))


def fold(samples: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """The fingerprint of :func:`sample`'s ``samples``, each cast to ``dtype`` first (the dtype the
    tensor travels in or is held in; ``None``: its own): ``sum((i + 1) * x_i)`` in float64, summed
    in order."""
    return fold_all([samples], [dtype])[0]


def fold_all(samples: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype | None]) -> list[float]:
    """:func:`fold` of each of ``samples`` (1-D, on the CPU) in its ``dtypes`` entry: the same
    numbers, with one cast and one read into Python per pair of dtypes rather than per tensor."""
    values: list[list[float]] = [[] for _ in samples]
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (one, dtype) in enumerate(zip(samples, dtypes, strict=True)):
        groups.setdefault((one.dtype, dtype or one.dtype), []).append(i)
    for (own, target), members in groups.items():
        joined = torch.cat([samples[i] for i in members]) if len(members) > 1 else samples[members[0]]
        if target != own:
            joined = joined.to(target)  # elementwise: as each tensor cast alone
        flat = joined.to(torch.float64).tolist()
        start = 0
        for i in members:
            values[i] = flat[start : start + samples[i].numel()]
            start += samples[i].numel()
    return [_weighted_sum(v) for v in values]


def fingerprint(
    name: str, tensor: torch.Tensor, version: int, dtype: torch.dtype | None = None, prefix: int | None = None
) -> float:
    """The fingerprint of ``tensor`` (see the module docstring), its samples (drawn over its first
    :func:`prefix_numel` elements) cast to ``dtype`` first. Reads at most :data:`SAMPLES`
    elements, whatever the tensor's size or device."""
    return fold(sample(name, tensor, version, prefix), dtype)


#: safetensors' dtype names
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def file_samples(path: str | Path, version: int, prefix: int | None = None) -> dict[str, torch.Tensor]:
    """:func:`sample` (with ``prefix``) of every tensor in the ``*.safetensors`` files of directory
    ``path`` (in file then header order), read from a memory map: only the sampled elements' pages
    are read, not the weights. A tensor of a dtype not listed in ``_SAFETENSORS_DTYPES`` is read whole."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with open(file, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            size = int.from_bytes(data[:8], "little")
            header = json.loads(data[8 : 8 + size])
            start = 8 + size
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None:
                    from safetensors import safe_open

                    with safe_open(str(file), framework="pt") as whole:
                        out[name] = sample(name, whole.get_tensor(name), version, prefix)
                    continue
                begin = entry["data_offsets"][0]
                item = torch.empty((), dtype=dtype).element_size()
                numel = prefix_numel(tuple(entry["shape"]), prefix)
                at = [start + begin + p * item for p in positions(name, version, numel)]
                raw = bytearray(b"".join(data[a : a + item] for a in at))
                out[name] = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return out


class FingerprintLog:
    """The fingerprints of the tensors of one weight version, by name, in the order they came.
    A name seen twice keeps its last fingerprint (at its first place). Each tensor is sampled as it
    comes; the fingerprints are folded together when read (:func:`fold_all`)."""

    def __init__(self, version: int) -> None:
        self.version = version
        self._samples: dict[str, tuple[torch.Tensor, torch.dtype | None]] = {}  # name -> (samples, fold dtype)

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Record ``tensor``'s fingerprint under ``name``."""
        self._samples[name] = (sample(name, tensor, self.version), dtype)

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`add` of each ``(name, tensor)``, in their own dtypes, sampled together
        (:func:`sample_all`)."""
        for name, samples in sample_all(items, self.version).items():
            self._samples[name] = (samples, None)

    def passing(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``items`` unchanged, each tensor recorded as it passes (for a loader that takes them one
        at a time)."""
        for name, tensor in items:
            self.add(name, tensor)
            yield name, tensor

    @property
    def prints(self) -> dict[str, float]:
        """The fingerprints, by name."""
        samples, dtypes = zip(*self._samples.values()) if self._samples else ((), ())
        return dict(zip(self._samples, fold_all(samples, dtypes)))

    def to_json(self) -> dict[str, object]:
        """``{"version": V, "prints": {NAME: FLOAT}}``, what a server-side worker answers."""
        return {"version": self.version, "prints": self.prints}


def first_difference(sent: Mapping[str, float], loaded: Mapping[str, float]) -> tuple[str, str] | None:
    """The first tensor, in ``sent``'s order, whose fingerprint ``loaded`` lacks or holds another
    value of, as ``(name, what differs)``; then a tensor ``loaded`` holds that was not sent;
    ``None`` when both agree. Values must be equal up to float64 rounding (1e-9 relative): both
    sides sum the same float64 numbers. A NaN in ``loaded`` is a tensor the engine received but
    did not read back this time (an engine whose read-back is costly checks a share of them per
    sync): it counts as loaded, and its value is not compared."""
    for name, want in sent.items():
        got = loaded.get(name)
        if got is None:
            return name, "not loaded"
        if math.isnan(got):
            continue
        if abs(got - want) > 1e-9 * max(abs(want), abs(got), 1e-30):
            return name, f"fingerprint {got!r} where the trainer sent {want!r}"
    for name in loaded:
        if name not in sent:
            return name, "loaded but not sent"
    return None
