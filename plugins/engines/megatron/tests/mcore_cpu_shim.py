"""TEST-ONLY: lets megatron-core's forward and backward run on a CPU-only torch.

megatron-core calls a handful of CUDA functions even when every tensor is on the CPU: the rotary
embedding moves its frequencies to ``torch.cuda.current_device()``, and the tensor-parallel RNG
tracker (entered by every attention forward, and by activation recomputation) saves, seeds and
restores the CUDA generator. This module points exactly those at CPU equivalents: the current
device becomes ``"cpu"`` and the "CUDA generator" becomes a separate CPU ``torch.Generator`` (so
the tracker's forks still switch between distinct, reproducible streams without touching the
global CPU generator).

It is imported by the tests and their worker scripts only; the engine never imports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_DEVICE_GENERATOR = torch.Generator()


def _patches() -> list[tuple[Any, str, Any]]:
    from megatron.core.tensor_parallel import random as mcore_random

    gen = _DEVICE_GENERATOR
    return [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "get_rng_state", lambda device="cuda": gen.get_state()),
        (torch.cuda, "manual_seed", lambda seed: gen.manual_seed(seed)),
        (mcore_random, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: gen.get_state()),
        (mcore_random, "_set_cuda_rng_state", lambda state, device=-1, graph_safe=False: gen.set_state(state)),
    ]


def install() -> None:
    """Apply the patches for the rest of the process (worker scripts)."""
    for owner, name, value in _patches():
        setattr(owner, name, value)


@contextmanager
def installed() -> Iterator[None]:
    """Apply the patches, and undo them on exit (tests in a shared pytest process)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in _patches()]
    install()
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
