"""A real Ray cluster on this machine for the module that asks for it: a head and one more node,
each a raylet with 2 CPUs of its own, every process on 127.0.0.1."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

NODE_CPUS = 2

# Ray reads this when it is imported (test modules import it at collection): with it Ray keeps the
# loopback addresses of this cluster instead of rewriting them to the network's (see
# core_rl_ray.cluster.connect, which sets it for a driver attaching to a loopback head).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """The address of a two-node cluster; this process is a driver of it (to find and kill actors)."""
    pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        import ray
        from ray.cluster_utils import Cluster

        node = {"num_cpus": NODE_CPUS, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}
        cluster = Cluster(initialize_head=True, connect=True, head_node_args={**node, "include_dashboard": False})
        try:
            cluster.add_node(**node)
            cluster.wait_for_nodes()
            yield cluster.address
        finally:
            ray.shutdown()
            cluster.shutdown()
