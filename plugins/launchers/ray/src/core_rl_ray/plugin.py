"""Registration of the ``ray`` launcher (entry point group ``core_rl.launchers``) and its
``core-rl train --ray-address`` option. Imports neither Ray nor torch: every ``core-rl`` command
loads the launcher plugins to build its command line."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from core_rl.hookspecs import Register, hookimpl

from core_rl_ray.config import RayLauncherConfig

if TYPE_CHECKING:
    from core_rl_ray.launcher import RayLauncher


def make_launcher(config: RayLauncherConfig) -> RayLauncher:
    from core_rl_ray.launcher import RayLauncher

    return RayLauncher(config)


@hookimpl
def core_rl_register_launchers(register: Register) -> None:
    register(
        "ray",
        make_launcher,
        description="Ray: trainer ranks and rollout servers as actors of a placement group (attach or start a cluster)",
        config_cls=RayLauncherConfig,
    )


@hookimpl
def core_rl_add_train_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="ray launcher: attach to the Ray cluster whose head is here (or 'auto'); default launcher.address, "
        "else a cluster started on this machine for the run",
    )
