"""The ``ray`` launcher: a run's trainer ranks and rollout servers as actors of one Ray placement
group (:mod:`core_rl_ray.placement`), on a cluster it attaches to or starts here.

One attempt:

1. the placement group, then one actor per bundle slot (:mod:`core_rl_ray.group`);
2. ``split`` / ``colocate``: each server actor starts its server (the engine plugin's command from
   the plugin's server environment, on its node's address); the ranks are then told their URLs
   (``rollout.engine.server.urls``, ``placement.mode: external``: to the trainer they are servers
   someone else started), and for ``weight_sync: collective`` the address the servers reach the
   trainer at: rank 0's node address (not loopback, unless every actor is on one loopback node);
   for ``weight_sync: disk`` a server on another node must see the run directory (checked);
3. every rank starts ``python -m core_rl_ray.rank`` with an explicit rendezvous: rank 0's node
   address and a port free there, ``LOCAL_RANK`` among the ranks of its node;
4. :func:`core_rl_ray.watch.watch` polls the actors until the ranks finish or something fails.

GPUs: Ray sets ``CUDA_VISIBLE_DEVICES`` of each actor to the GPUs it was given. A rank's process
instead sees every GPU Ray gave the run's ranks on its node (in Ray's id order), and its
``LOCAL_RANK`` is the position of its own GPU in that list, so ``cuda:LOCAL_RANK`` is its own
device and NCCL sees its node's peers (as under ``torchrun``). CPU ranks see no GPU at all.

A failure stops the other ranks with ``SIGTERM`` (they save a checkpoint where their peers still
answer) and kills every actor; with ``recover.mode: auto`` a new attempt (new actors, a new
placement group) resumes from the newest valid checkpoint, at most ``recover.retries`` times.
"""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from core_rl.errors import CoreRLError, stderr_line
from core_rl.launch import ClusterResources, Launcher, LaunchRequest, placement_mode, placement_problems, server_options

from core_rl_ray.config import RayLauncherConfig

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig

    from core_rl_ray.group import ActorGroup, Member
    from core_rl_ray.watch import Outcome


def node_layout(places: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Per rank (given where each rank's actor is: ``node_id`` and ``gpu_ids``), the local rank,
    the local world size and the ``CUDA_VISIBLE_DEVICES`` of its process (see the module doc)."""
    by_node: dict[str, list[int]] = {}
    for i, place in enumerate(places):
        by_node.setdefault(place["node_id"], []).append(i)
    out = []
    for i, place in enumerate(places):
        peers = by_node[place["node_id"]]
        gpus = sorted({g for p in peers for g in places[p]["gpu_ids"]}, key=lambda g: (len(g), g))
        if place["gpu_ids"]:
            local_rank = gpus.index(place["gpu_ids"][0])
        else:
            local_rank = peers.index(i)
        out.append(
            {"local_rank": str(local_rank), "local_world_size": str(len(peers)), "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        )
    return out


class RayLauncher(Launcher):
    name = "ray"

    def __init__(self, config: RayLauncherConfig) -> None:
        self.config = config
        self._stop: str | None = None

    # -- check ----------------------------------------------------------------------------------

    def check(self, cfg: RunConfig, resources: ClusterResources | None) -> list[str]:
        """The placement on ``resources``; without them, on the cluster at ``launcher.address``
        (connected to for this), or on this machine, where a cluster for the run would start."""
        if resources is None:
            from core_rl_ray.cluster import RayClusterError

            try:
                resources = self._offered(self.config.address)
            except RayClusterError as exc:
                return [f"launcher.address: {exc}"]
        problems = placement_problems(cfg, resources)
        server = server_options(cfg)
        if server is not None and server.gpus:
            problems.append(
                f"rollout.engine.server.gpus: {server.gpus}, but under the ray launcher each server runs on the GPUs "
                "Ray gives its actor (placement.rollout.gpus); leave it empty"
            )
        return problems

    def offered(self, request: LaunchRequest) -> ClusterResources | None:
        return self._offered(request.options.get("ray_address") or self.config.address)

    def _offered(self, address: str) -> ClusterResources:
        if address:
            from core_rl_ray.cluster import offered_by

            return offered_by(address)
        from core_rl.builtin import this_machine

        resources = this_machine()
        if self.config.local_cpus:
            resources = attrs.evolve(resources, cpus_per_node=self.config.local_cpus, source="launcher.local_cpus")
        return resources

    # -- launch ---------------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> int:
        from core_rl.checkpoint import effective_recover_mode

        from core_rl_ray.cluster import connect

        cfg = request.cfg
        address = request.options.get("ray_address") or self.config.address
        restarts = cfg.recover.retries if effective_recover_mode(cfg) == "auto" else 0
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            with connect(address, local_cpus=self.config.local_cpus):
                attempt = 0
                while True:
                    outcome = self._attempt(request, resumed=attempt > 0)
                    if outcome.code == 0:
                        return 0
                    if not outcome.retriable or attempt >= restarts or self._stop:
                        _say(f"error: {outcome.message}" if outcome.code != 3 else outcome.message)
                        return outcome.code
                    attempt += 1
                    _say(
                        f"{outcome.message}; restarting every actor from the newest valid checkpoint "
                        f"(recover.retries: {restarts - attempt} restarts left)"
                    )
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stop = signal.Signals(signum).name

    def _attempt(self, request: LaunchRequest, *, resumed: bool) -> Outcome:
        from core_rl_ray.group import ActorGroup, ActorLost
        from core_rl_ray.placement import plan
        from core_rl_ray.watch import Outcome, stop_ranks, watch

        cfg = request.cfg
        server = server_options(cfg)
        mode = placement_mode(cfg)
        num_servers = server.num_servers if server is not None and mode != "external" else 0
        layout = plan(
            mode,
            cfg.placement.actor,
            cfg.placement.rollout,
            cpu_ranks_per_node=request.nproc_per_node or 1,
            num_servers=num_servers,
            strategy=self.config.strategy,
        )
        group = ActorGroup(
            f"{cfg.experiment.name}-{uuid.uuid4().hex[:6]}",
            layout,
            placement_timeout=self.config.placement_timeout_s,
            actor_timeout=self.config.actor_timeout_s,
        )
        try:
            try:
                group.start_actors()
                overrides = [*request.overrides, *self._server_overrides(request, group, server)]
                if resumed:
                    overrides.append("recover.mode=auto")
                self._start_ranks(request.config_path, overrides, group)
            except ActorLost as exc:
                return Outcome(1, str(exc), retriable=True)
            _say(f"running {len(group.ranks)} trainer ranks and {len(group.servers)} rollout servers on Ray")
            outcome = watch(group, poll_s=self.config.poll_s, stop_requested=lambda: self._stop)
            if outcome.code != 0:
                stop_ranks(group, self.config.stop_grace_s)
            return outcome
        finally:
            group.close()

    def _server_overrides(self, request: LaunchRequest, group: ActorGroup, server: Any) -> list[str]:
        """What the ranks are told about the servers the group started (see the module doc)."""
        if not group.servers:
            return []
        cfg = request.cfg
        run_dir = cfg.experiment.run_dir
        timeout = server.startup_timeout + self.config.actor_timeout_s
        urls = group.start_servers(request.config_path, request.overrides, str(run_dir / "ray"), timeout)
        rank0 = group.ranks[0].where
        out = [
            f"rollout.engine.server.urls=[{','.join(urls)}]",
            "placement.mode=external",
            "placement.rollout={gpus: 0, cpus: 0, nodes: 1}",
        ]
        if cfg.rollout.weight_sync == "collective" and not server.weight_sync_address:
            out.append(f"rollout.engine.server.weight_sync_address={rank0['node_ip']}")
        if placement_mode(cfg) == "colocate" and server.weight_sync_backend == "auto":
            # the servers share the ranks' GPUs, and NCCL refuses two ranks of one group on one GPU
            out.append("rollout.engine.server.weight_sync_backend=gloo")
        if cfg.rollout.weight_sync == "disk":
            elsewhere = [m for m in group.servers if m.where["node_id"] != rank0["node_id"]]
            self._check_shared(run_dir, group.ranks[0], elsewhere)
        return out

    def _check_shared(self, run_dir: Path, rank0: Member, others: list[Member]) -> None:
        """``weight_sync: disk``: rank 0 writes the weights under the run directory; a server on
        another node must see that directory (a shared file system), or the run stops here."""
        from core_rl_ray.group import call

        if not others:
            return
        marker = str(run_dir / "ray" / f"shared-check-{uuid.uuid4().hex[:8]}")
        call(rank0, "touch", marker, timeout=self.config.actor_timeout_s)
        try:
            for member in others:
                if not call(member, "sees", marker, timeout=self.config.actor_timeout_s):
                    raise CoreRLError(
                        f"rollout.weight_sync: disk needs the run directory {run_dir} on a file system every node "
                        f"shares, but {member.describe()} does not see what trainer rank 0 (node "
                        f"{rank0.where['node_ip']}) wrote there. Put experiment.output_dir on a shared file system, "
                        "or use rollout.weight_sync: collective"
                    )
        finally:
            call(rank0, "remove", marker, timeout=self.config.actor_timeout_s)

    def _start_ranks(self, config_path: str, overrides: list[str], group: ActorGroup) -> None:
        from core_rl_ray.group import call

        master = group.ranks[0].where["node_ip"]
        port = call(group.ranks[0], "free_port", timeout=self.config.actor_timeout_s)
        local = node_layout([m.where for m in group.ranks])
        world = len(group.ranks)
        for i, (member, loc) in enumerate(zip(group.ranks, local)):
            rendezvous = {
                "rank": i,
                "world_size": world,
                "local_rank": int(loc["local_rank"]),
                "local_world_size": int(loc["local_world_size"]),
                "master_addr": master,
                "master_port": port,
            }
            env = {"CUDA_VISIBLE_DEVICES": loc["CUDA_VISIBLE_DEVICES"], **self.config.env}
            argv = ["-m", "core_rl_ray.rank", json.dumps(rendezvous), config_path, *overrides]
            call(member, "start", argv, env, timeout=self.config.actor_timeout_s)


def _say(message: str) -> None:
    stderr_line(f"core-rl: {message}")
