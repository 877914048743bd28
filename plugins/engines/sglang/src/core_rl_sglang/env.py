"""The ``sglang`` server environment (``core-rl server-env create sglang``).

- ``cpu``: SGLang's published wheel requires CUDA-only packages (``sglang-kernel``, flash-attn,
  flashinfer, ...). The CPU variant installs the rest of its requirements with the CPU torch
  (``requirements-cpu.txt``, the exact package set of a working build, installed without
  dependency resolution), then ``sglang`` and ``torchvision`` without their dependencies, then
  the torchvision fix-up of :mod:`core_rl_server_kit.torchvision_fixup`. At launch the engine
  also puts on ``PYTHONPATH`` a small pure-torch ``vllm._custom_ops.rotary_embedding`` that
  SGLang's generic CPU path imports (:mod:`core_rl_sglang.server_side`).
- ``cuda``: ``sglang`` 0.5.23 as published.
"""

from __future__ import annotations

from pathlib import Path

from core_rl.interfaces.servers import ServerEnvSpec
from core_rl_server_kit.torchvision_fixup import guard_torchvision_meta_registrations

REQUIREMENTS_CPU = Path(__file__).with_name("requirements-cpu.txt")


def sglang_env_spec() -> ServerEnvSpec:
    pip = ["-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    return ServerEnvSpec(
        name="sglang",
        description="SGLang inference server 0.5.23 (cpu: non-CUDA requirements, torch 2.13.0+cpu)",
        steps={
            "cpu": [
                [*pip, "--no-deps", "-r", str(REQUIREMENTS_CPU)],
                [*pip, "--no-deps", "sglang==0.5.23", "torchvision==0.28.0"],
            ],
            "cuda": [[*pip, "sglang==0.5.23"]],
        },
        post_install=guard_torchvision_meta_registrations,
        revision="1",
        check="import sglang.launch_server",
    )
