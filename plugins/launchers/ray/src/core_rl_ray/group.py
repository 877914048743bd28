"""One attempt of a run on Ray: its placement group and actors (:class:`ActorGroup`).

Every wait is bounded: the placement group by ``launcher.placement_timeout_s`` (its error names the
bundles Ray could not place and what the cluster has), each call to an actor by
``launcher.actor_timeout_s`` (a node that stopped answering counts as lost), a server's start by
its own ``startup_timeout`` plus that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs

from core_rl_ray.actors import RolloutServer, TrainerRank
from core_rl_ray.cluster import NAMESPACE, RayClusterError, cluster_resources
from core_rl_ray.placement import Plan, Slot


@attrs.define
class Member:
    """One actor of the group: its handle, its name (``<run>/rank-0``), where it runs."""

    name: str
    handle: Any
    where: dict[str, Any] = attrs.field(factory=dict)

    def describe(self) -> str:
        w = self.where
        if not w:
            return f"actor {self.name}"
        return f"actor {self.name} (pid {w['pid']} on node {w['node_ip']}, {w['hostname']}, id {w['node_id'][:12]})"


def call(member: Member, method: str, *args: Any, timeout: float, query: bool = False) -> Any:
    """``member.method(*args)`` through Ray, waited for at most ``timeout`` s. Raises
    :class:`ActorLost` naming the actor if it died or did not answer in time.

    ``query=True`` marks a call without side effects: while Ray reports the actor *temporarily*
    unavailable (its node stopped answering, not yet declared dead), it is asked again until the
    node is declared dead (the error says the node was lost) or ``timeout`` runs out."""
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout
    while True:
        ref = getattr(member.handle, method).remote(*args)
        try:
            return ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except RayActorError as exc:
            if _node_lost(member):
                raise ActorLost(f"{member.describe()} is gone: its node was lost (Ray declared it dead)") from None
            if not isinstance(exc, ActorUnavailableError):
                raise ActorLost(f"{member.describe()} died: {_reason(exc)}") from None
            if not query or time.monotonic() >= deadline:
                raise ActorLost(
                    f"{member.describe()} stopped answering {method}() (Ray: {_reason(exc)}); its node is probably lost"
                ) from None
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        except GetTimeoutError:
            raise ActorLost(
                f"{member.describe()} did not answer {method}() within {timeout:g} s (launcher.actor_timeout_s); "
                "its node is probably lost"
            ) from None


def _node_lost(member: Member) -> bool:
    """Whether Ray's control store lists the node ``member`` ran on as dead (an actor on a lost node
    fails with an RPC error that does not say so)."""
    import ray

    node_id = member.where.get("node_id")
    if not node_id:
        return False
    try:
        nodes = ray.nodes()
    except Exception:  # the control store itself is unreachable: nothing to tell
        return False
    return any(n.get("NodeID") == node_id and not n.get("Alive") for n in nodes)


def _reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if "ray.kill" in line or "node" in line.lower() or "exit" in line.lower()]
    return (useful or lines or [type(exc).__name__])[0][:300]


class ActorLost(Exception):
    """An actor died, or it (or its node) stopped answering."""


class ActorGroup:
    """The placement group of :class:`Plan` ``plan`` and its actors, named ``<run>/rank-<i>`` and
    ``<run>/server-<j>`` in the ``core-rl`` namespace."""

    def __init__(self, run: str, plan: Plan, *, placement_timeout: float, actor_timeout: float) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.run = run
        self.plan = plan
        self.actor_timeout = actor_timeout
        self.ranks: list[Member] = []
        self.servers: list[Member] = []
        self.pg = placement_group(plan.bundles, strategy=plan.strategy, name=f"{run}/placement")
        ready, _ = ray.wait([self.pg.ready()], timeout=placement_timeout)
        if not ready:
            self.close()
            raise RayClusterError(
                f"ray launcher: the cluster could not place the run's {len(plan.bundles)} bundles "
                f"({_bundles_text(plan.bundles)}, strategy {plan.strategy}) within {placement_timeout:g} s "
                f"(launcher.placement_timeout_s); the cluster has {_resources_text(cluster_resources())}. "
                "Lower placement.actor / placement.rollout, or add nodes"
            )

    def _actor(self, cls: type, name: str, slot: Slot) -> Member:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(cls).options(
            name=name,
            namespace=NAMESPACE,
            num_cpus=slot.cpus,
            num_gpus=slot.gpus,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=slot.bundle),
        )
        member = Member(name=name, handle=remote.remote())
        member.where = call(member, "where", timeout=self.actor_timeout)
        return member

    def start_actors(self) -> None:
        """Create every rank's and server's actor (the processes start later)."""
        self.ranks = [self._actor(TrainerRank, f"{self.run}/rank-{i}", s) for i, s in enumerate(self.plan.ranks)]
        self.servers = [
            self._actor(RolloutServer, f"{self.run}/server-{j}", s) for j, s in enumerate(self.plan.servers)
        ]

    def start_servers(self, config_path: str, overrides: Sequence[str], log_dir: str, timeout: float) -> list[str]:
        """Start every server at once; their URLs, once each answers its health check."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        refs = [m.handle.start.remote(config_path, list(overrides), j, log_dir) for j, m in enumerate(self.servers)]
        urls = []
        for member, ref in zip(self.servers, refs):
            try:
                urls.append(ray.get(ref, timeout=timeout))
            except RayTaskError as exc:  # the engine's own error (a ServerError naming the log)
                raise ActorLost(f"{member.describe()} could not start its server: {exc.cause}") from None
            except RayActorError as exc:
                raise ActorLost(f"{member.describe()} died while starting its server: {_reason(exc)}") from None
            except GetTimeoutError:
                raise ActorLost(f"{member.describe()} did not start its server within {timeout:g} s") from None
        return urls

    def close(self) -> None:
        """Stop the servers (their process sessions), kill every actor, remove the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        stops = [m.handle.stop.remote() for m in self.servers]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=self.actor_timeout)
        for member in [*self.ranks, *self.servers]:
            try:
                ray.kill(member.handle, no_restart=True)
            except Exception:  # already gone
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass


def _bundles_text(bundles: list[dict[str, float]]) -> str:
    return ", ".join("{" + ", ".join(f"{k}: {v:g}" for k, v in b.items()) + "}" for b in bundles)


def _resources_text(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in resources.items())
