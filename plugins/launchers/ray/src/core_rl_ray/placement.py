"""From the run's ``placement:`` section to Ray placement-group bundles (:func:`plan`).

- Trainer ranks: ``placement.actor.nodes`` nodes, each with one rank per GPU
  (``placement.actor.gpus``), or with ``gpus: 0`` ``nproc_per_node`` CPU ranks (default 1). A
  rank's bundle holds its GPU and its share of ``placement.actor.cpus`` (1 CPU when 0 are given:
  Ray's default for an actor).
- ``split``: ``num_servers`` rollout servers (``rollout.engine.server.num_servers``), each in a
  bundle of its own holding its share of ``placement.rollout``'s GPUs and CPUs (1 CPU when none).
- ``colocate``: server ``j`` shares the bundle of rank ``j mod ranks``: on GPUs each of the two
  actors takes half of the bundle's GPU (Ray then gives both the same device), and the server takes
  none of the bundle's CPUs (the rank's cores are shared).
- ``external``, or an engine without servers (``hf``): no server bundles.

The strategy: ``launcher.strategy``, or by default ``STRICT_PACK`` (every bundle on one node) for
``colocate`` on one node, ``SPREAD`` when a role asks for several nodes, else ``PACK`` (as few
nodes as the bundles fit on).
"""

from __future__ import annotations

import attrs
from core_rl.config.placement import RolePlacement

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@attrs.frozen
class Slot:
    """Where one actor goes: its bundle's index and the resources it takes from that bundle."""

    bundle: int
    cpus: float
    gpus: float


@attrs.frozen
class Plan:
    bundles: list[dict[str, float]]
    strategy: str
    ranks: list[Slot]
    servers: list[Slot]

    def totals(self) -> dict[str, float]:
        """Resources the placement group reserves, summed over its bundles."""
        out: dict[str, float] = {}
        for bundle in self.bundles:
            for key, value in bundle.items():
                out[key] = out.get(key, 0.0) + value
        return out


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def plan(
    mode: str,
    actor: RolePlacement,
    rollout: RolePlacement,
    *,
    cpu_ranks_per_node: int,
    num_servers: int,
    strategy: str = "",
) -> Plan:
    """The bundles of a run (see the module doc). ``actor`` and ``rollout`` are the
    ``placement.actor`` / ``placement.rollout`` sections (``gpus``, ``cpus``, ``nodes``);
    ``num_servers``: rollout servers the launcher starts (0: none)."""
    per_node = actor.gpus or max(1, cpu_ranks_per_node)
    ranks = per_node * actor.nodes
    rank_cpus = actor.cpus / per_node if actor.cpus else 1.0
    rank_gpus = 1.0 if actor.gpus else 0.0
    colocated = mode == "colocate" and num_servers > 0
    bundles = [_bundle(rank_cpus, rank_gpus) for _ in range(ranks)]
    share = 0.5 if colocated and rank_gpus else 1.0
    rank_slots = [Slot(i, rank_cpus, rank_gpus * share) for i in range(ranks)]
    servers: list[Slot] = []
    if colocated:
        per_bundle = [len(range(b, num_servers, ranks)) for b in range(ranks)]
        servers = [Slot(j % ranks, 0.0, rank_gpus * share / per_bundle[j % ranks]) for j in range(num_servers)]
    elif mode == "split" and num_servers > 0:
        gpus = rollout.gpus * rollout.nodes / num_servers
        cpus = rollout.cpus * rollout.nodes / num_servers if rollout.cpus else 1.0
        for _ in range(num_servers):
            servers.append(Slot(len(bundles), cpus, gpus))
            bundles.append(_bundle(cpus, gpus))
    if not strategy:
        several = actor.nodes > 1 or (mode == "split" and rollout.nodes > 1)
        strategy = "SPREAD" if several else "STRICT_PACK" if mode == "colocate" else "PACK"
    return Plan(bundles=bundles, strategy=strategy, ranks=rank_slots, servers=servers)
