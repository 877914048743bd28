"""A fix-up for server environments that install the registry's ``torchvision`` on a CPU torch
(``sglang`` and ``vllm``, whose vision-language models import transformers' image processors).

The registry's torchvision is a CUDA build whose C++ ops cannot load there, and its fake-kernel
registrations for those ops (``torchvision/_meta_registrations.py``) fail at import with
``operator torchvision::nms does not exist``. :func:`guard_torchvision_meta_registrations` (a
:class:`~core_rl.interfaces.servers.ServerEnvSpec` ``post_install``) makes them register only when
the ops loaded."""

from __future__ import annotations

from pathlib import Path

GUARDED_META_REGISTRATIONS = """# core-rl fix-up: register torchvision's fake kernels only when its C++ ops loaded
import torchvision.extension

if torchvision.extension._has_ops():
    from torchvision._meta_registrations_full import *  # noqa: F403
"""


def guard_torchvision_meta_registrations(env_dir: Path) -> None:
    """Move ``torchvision/_meta_registrations.py`` of the environment at ``env_dir`` aside (to
    ``_meta_registrations_full.py``) and import it only when the ops exist; idempotent."""
    found = list(env_dir.glob("lib/python*/site-packages/torchvision/_meta_registrations.py"))
    if not found:
        raise FileNotFoundError(f"no torchvision/_meta_registrations.py under {env_dir}")
    original = found[0]
    full = original.with_name("_meta_registrations_full.py")
    if not full.exists():
        original.replace(full)
    original.write_text(GUARDED_META_REGISTRATIONS, encoding="utf-8")
