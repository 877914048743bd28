"""Whether megatron-core can run in this process.

megatron-core's forward and backward call ``torch.cuda`` even for CPU tensors (the rotary
embedding's device, the tensor-parallel RNG tracker that every attention forward enters), and its
schedules and optimizer hard-code CUDA. So the engine needs a GPU. The test suite runs it on a CPU
by pointing exactly those calls at CPU equivalents (``tests/mcore_cpu_shim.py``); the probe below
asks whether those calls work, so it accepts a GPU and that shim, and nothing else.
"""

from __future__ import annotations

import torch

from core_rl_megatron.config import MegatronConfig
from core_rl_megatron.errors import MegatronSetupError

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


def check_cpu_settings(cfg: MegatronConfig) -> None:
    """Settings whose Megatron code paths hard-code CUDA."""
    gpu_only = {
        "pipeline_model_parallel_size": cfg.pipeline_model_parallel_size > 1,
        "virtual_pipeline_model_parallel_size": cfg.virtual_pipeline_size > 1,
        "context_parallel_size": cfg.context_parallel_size > 1,
        "sequence_parallel": cfg.sequence_parallel,
        "bf16": cfg.bf16,
        "ddp.use_distributed_optimizer": cfg.ddp.use_distributed_optimizer,
        "transformer_impl": cfg.transformer_impl != "local",
    }
    bad = [key for key, on in gpu_only.items() if on]
    if bad:
        raise MegatronSetupError(
            f"actor.engine.{bad[0]}: needs CUDA (Megatron's pipeline schedules, optimizer and fused layers do); "
            f"this machine has no GPU. Settings that need one: {', '.join(bad)}"
        )
