"""GPU worker for ``test_gpu.py``, launched by ``torchrun`` (NCCL): ZeRO-3 with bf16 mixed precision
and optimizer offload, log-probs, training, save/load resume and export on CUDA
(:mod:`core_rl.testing.engine_check`)."""

from __future__ import annotations

from core_rl.config.schema import ActorConfig
from core_rl.testing.engine_check import worker_main
from core_rl_deepspeed.config import DeepSpeedConfig
from core_rl_deepspeed.engine import DeepSpeedEngine


def make_engine(actor: ActorConfig) -> DeepSpeedEngine:
    options = DeepSpeedConfig(zero_stage=3, mixed_precision="bfloat16", offload_optimizer=True)
    engine = DeepSpeedEngine(actor, options, trainable=True)
    assert engine.device.type == "cuda"
    return engine


if __name__ == "__main__":
    worker_main(make_engine, "deepspeed")
