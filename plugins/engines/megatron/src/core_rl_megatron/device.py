"""Whether megatron-core can run in this process.

megatron-core's forward and backward call ``torch.cuda`` even for CPU tensors (the rotary
embedding's device, the tensor-parallel RNG tracker that every attention forward enters), and its
schedules and optimizer hard-code CUDA. So the engine needs a GPU. The test suite runs it on a CPU
by pointing exactly those calls at CPU equivalents (``tests/mcore_cpu_shim.py``); the probe below
asks whether those calls work, so it accepts a GPU and that shim, and nothing else.
"""

from __future__ import annotations

import torch

NEEDS_CUDA = (
    "megatron needs a CUDA GPU and this machine has none (megatron-core calls CUDA in every forward: "
    "rotary embeddings, the tensor-parallel RNG); on a CPU use the fsdp or deepspeed engine"
)


def megatron_can_run() -> bool:
    """True on a CUDA machine, or where ``torch.cuda``'s device and RNG calls answer on a CPU."""
    if torch.cuda.is_available():
        return True
    try:
        torch.cuda.current_device()
        torch.cuda.get_rng_state()
    except (AssertionError, RuntimeError):  # "Torch not compiled with CUDA enabled" / no driver
        return False
    return True
