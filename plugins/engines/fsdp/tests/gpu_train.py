"""GPU worker for ``test_gpu.py``, launched by ``torchrun`` (NCCL): bf16 mixed-precision log-probs
and training, save/load resume and export on CUDA (:mod:`core_rl.testing.engine_check`)."""

from __future__ import annotations

from core_rl.config.schema import ActorConfig
from core_rl.testing.engine_check import worker_main
from core_rl_fsdp.config import FSDPConfig
from core_rl_fsdp.engine import FSDPEngine


def make_engine(actor: ActorConfig) -> FSDPEngine:
    engine = FSDPEngine(actor, FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32"), trainable=True)
    assert engine.device.type == "cuda"
    return engine


if __name__ == "__main__":
    worker_main(make_engine, "fsdp")
