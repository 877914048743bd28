"""The ``sglang`` server environment (``core-rl server-env create sglang``).

- ``cpu``: SGLang's published wheel requires CUDA-only packages (``sglang-kernel``, flash-attn,
  flashinfer, ...). The CPU variant installs the rest of its requirements with the CPU torch
  (``requirements-cpu.txt``, the exact package set of a working build, installed without
  dependency resolution), then ``sglang`` and ``torchvision``
  without their dependencies, then a fix-up: the registry's torchvision is a CUDA build whose C++
  ops cannot load, and its fake-kernel registrations for those ops fail at import; the fix-up makes
  them register only when the ops loaded. At launch the engine also puts on ``PYTHONPATH`` a small
  pure-torch ``vllm._custom_ops.rotary_embedding`` that SGLang's generic CPU path imports
  (:mod:`core_rl_sglang.server_side`).
- ``cuda``: ``sglang`` 0.5.23 as published.
"""

from __future__ import annotations

from pathlib import Path

from core_rl.interfaces.servers import ServerEnvSpec

REQUIREMENTS_CPU = Path(__file__).with_name("requirements-cpu.txt")
GUARDED_META_REGISTRATIONS = """# core-rl fix-up: register torchvision's fake kernels only when its C++ ops loaded
import torchvision.extension

if torchvision.extension._has_ops():
    from torchvision._meta_registrations_full import *  # noqa: F403
"""


def guard_torchvision_meta_registrations(env_dir: Path) -> None:
    """Move ``torchvision/_meta_registrations.py`` aside and import it only when the ops exist."""
    found = list(env_dir.glob("lib/python*/site-packages/torchvision/_meta_registrations.py"))
    if not found:
        raise FileNotFoundError(f"no torchvision/_meta_registrations.py under {env_dir}")
    original = found[0]
    full = original.with_name("_meta_registrations_full.py")
    if not full.exists():
        original.replace(full)
    original.write_text(GUARDED_META_REGISTRATIONS, encoding="utf-8")


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
