"""The launcher conformance kit (core_rl.testing.LauncherContract) on the ``ray`` launcher; its
``check`` without resources judges this machine (no ``launcher.address``: a local cluster)."""

from __future__ import annotations

from typing import ClassVar

import core_rl_ray.plugin
from core_rl.testing import LauncherContract


class TestRayContract(LauncherContract):
    plugin = core_rl_ray.plugin
    name = "ray"
    distribution = "core-rl-ray"
    options: ClassVar[dict] = {"local_cpus": 2}
