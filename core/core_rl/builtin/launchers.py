"""The built-in ``local`` launcher: the trainer's ranks on this machine (torch's elastic agent for
``--nproc-per-node N``, else one rank in this process), or on several machines with
``--nnodes M --node-rank R --rdzv-endpoint HOST:PORT`` run on each (torchrun multi-node,
:mod:`core_rl.launch.local`). It registers through the same hooks as any launcher plugin."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

import attrs

from core_rl.config.checks import visible_gpus
from core_rl.config.validators import MAX_COUNT, in_range
from core_rl.errors import ConfigError
from core_rl.hookspecs import Register, hookimpl
from core_rl.launch.launchers import Launcher, LaunchRequest
from core_rl.launch.placement import ClusterResources, placement_problems
from core_rl.launch.rendezvous import train_in_process

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig


@attrs.define
class LocalLauncherConfig:
    """``nnodes``: machines the trainer's ranks span (``--nnodes`` overrides it for one launch; each
    machine runs ``core-rl train --node-rank R``); ``interface``: the network interface gloo and
    NCCL use between machines (e.g. ``eth0``; empty: their own choice); ``rdzv_timeout_s``: how
    long the machines wait for each other at the start."""

    nnodes: int = attrs.field(default=1, validator=in_range(1, MAX_COUNT))
    interface: str = ""
    rdzv_timeout_s: int = attrs.field(default=900, validator=in_range(1, 10**6))


def this_machine(nodes: int = 1) -> ClusterResources:
    """``nodes`` machines like this one: its CUDA devices and the CPU cores this process may use."""
    gpus = visible_gpus()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ClusterResources(nodes=nodes, gpus_per_node=gpus, cpus_per_node=cpus, source="this machine")


class LocalLauncher(Launcher):
    name = "local"

    def __init__(self, config: LocalLauncherConfig) -> None:
        self.config = config

    def check(self, cfg: RunConfig, resources: ClusterResources | None) -> list[str]:
        return placement_problems(cfg, resources or this_machine(self.config.nnodes))

    def offered(self, request: LaunchRequest) -> ClusterResources:
        """``--nnodes`` (else ``launcher.nnodes``) machines like this one."""
        return this_machine(request.options.get("nnodes") or self.config.nnodes)

    def launch(self, request: LaunchRequest) -> int:
        from core_rl.launch.local import Nodes, launch

        options = request.options
        nnodes = options.get("nnodes") or self.config.nnodes
        node_rank = options.get("node_rank") or 0
        endpoint = options.get("rdzv_endpoint") or ""
        nproc = request.nproc_per_node
        problems = self._launch_problems(request, nnodes, node_rank, endpoint)
        if problems:
            raise ConfigError(problems, source=request.config_path)
        if nnodes == 1 and not nproc:
            assert request.host is not None, "a rank in this process needs the plugin host that loaded its config"
            return train_in_process(request.cfg, request.host)
        nodes = Nodes(nnodes, node_rank, endpoint, self.config.interface, self.config.rdzv_timeout_s)
        return launch(request.config_path, request.overrides, nproc or 1, request.cfg, nodes)

    def _launch_problems(self, request: LaunchRequest, nnodes: int, node_rank: int, endpoint: str) -> list[str]:
        """The command line against itself and the placement: a node rank in range, an endpoint on
        several nodes, and one rank per GPU."""
        problems = []
        if not 0 <= node_rank < nnodes:
            problems.append(f"--node-rank {node_rank}: must be in [0, {nnodes}) for --nnodes {nnodes}")
        if nnodes > 1 and ":" not in endpoint:
            problems.append(
                f"--rdzv-endpoint: required with --nnodes {nnodes}: HOST:PORT where node 0 listens (an address of "
                "node 0 that every node reaches, and a free port)"
            )
        gpus = request.cfg.placement.actor.gpus
        if gpus and request.nproc_per_node and request.nproc_per_node != gpus:
            problems.append(
                f"placement.actor.gpus: {gpus} GPUs per node for the actor, but --nproc-per-node "
                f"{request.nproc_per_node} starts {request.nproc_per_node} ranks per node (one rank per GPU)"
            )
        return problems


@hookimpl
def core_rl_register_launchers(register: Register) -> None:
    register(
        "local",
        LocalLauncher,
        description="This machine (torch's elastic agent for --nproc-per-node), or torchrun over --nnodes machines",
        config_cls=LocalLauncherConfig,
    )


@hookimpl
def core_rl_add_train_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--nnodes", type=int, default=None, metavar="M", help="local launcher: machines the trainer spans (torchrun)"
    )
    group.add_argument(
        "--node-rank", type=int, default=None, metavar="R", help="local launcher: this machine's rank, 0 to M-1"
    )
    group.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="local launcher: where node 0 listens for the other machines (an address of node 0, a free port)",
    )
