"""Registration of the ``slurm`` launcher (entry point group ``core_rl.launchers``) and of the
``core-rl slurm`` command; imports nothing heavy (it is loaded whenever ``core-rl`` starts)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from core_rl.config.validators import MAX_COUNT
from core_rl.hookspecs import Register, hookimpl
from core_rl.launch import ClusterResources, Launcher, LaunchRequest, placement_problems

from core_rl_slurm.config import SlurmLauncherConfig

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig


class SlurmLauncher(Launcher):
    """Places a run on the allocation its section asks for; ``launch`` (``core-rl train`` with
    ``launcher: slurm``) writes the script and submits it, like ``core-rl slurm submit``."""

    name = "slurm"

    def __init__(self, config: SlurmLauncherConfig) -> None:
        self.config = config

    def resources(self) -> ClusterResources:
        """The allocation: ``nodes`` x ``gpus_per_node`` GPUs and ``cpus_per_node`` cores (not
        checked when 0: Slurm's default)."""
        cfg = self.config
        return ClusterResources(
            nodes=cfg.nodes,
            gpus_per_node=cfg.gpus_per_node,
            cpus_per_node=cfg.cpus_per_node or MAX_COUNT,
            source="launcher.nodes, launcher.gpus_per_node, launcher.cpus_per_node",
        )

    def check(self, cfg: RunConfig, resources: ClusterResources | None) -> list[str]:
        problems = placement_problems(cfg, resources or self.resources())
        if cfg.placement.actor.gpus and self.config.ranks_per_node != 1:
            problems.append(
                "launcher.ranks_per_node: for CPU ranks only; with placement.actor.gpus the trainer runs one rank "
                "per GPU"
            )
        return problems

    def launch(self, request: LaunchRequest) -> int:
        from core_rl_slurm.submit import submit

        return submit(request.cfg, request.config_path, request.overrides, None)


@hookimpl
def core_rl_register_launchers(register: Register) -> None:
    register(
        "slurm",
        SlurmLauncher,
        description="An sbatch script (srun + torchrun over the allocation's nodes), submitted with sbatch",
        config_cls=SlurmLauncherConfig,
    )


@hookimpl
def core_rl_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from core_rl_slurm.submit import add_command

    add_command(subparsers)
