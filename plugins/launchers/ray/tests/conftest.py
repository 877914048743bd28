"""A real Ray cluster on this machine for the module that asks for it: a head and one more node,
each a raylet with 2 CPUs of its own, every process on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

NODE_CPUS = 2
#: how long the second node may take to register (Ray's own wait is a fixed 30 s, too short for a
#: loaded 2-core machine)
NODE_START_S = 240

# Ray reads this when it is imported (test modules import it at collection): with it Ray keeps the
# loopback addresses of this cluster instead of rewriting them to the network's (see
# core_rl_ray.cluster.connect, which sets it for a driver attaching to a loopback head).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _wait_for_nodes(count: int, timeout: float) -> None:
    import ray

    deadline = time.monotonic() + timeout
    while sum(1 for n in ray.nodes() if n.get("Alive")) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test's Ray cluster did not have {count} nodes alive within {timeout:g} s")
        time.sleep(1.0)


@pytest.fixture(scope="module")
def ray_cluster(ray_test_cluster) -> str:
    """The address of the module's two-node cluster."""
    return ray_test_cluster.address


@pytest.fixture(scope="module")
def ray_test_cluster() -> Iterator[Any]:
    """A two-node ``ray.cluster_utils.Cluster``; this process is a driver of it (to find and kill
    actors, or remove a node). Every process the cluster started is gone after the module."""
    pytest.importorskip("ray")
    from core_rl.testing.processes import process_tree

    before = set(process_tree(os.getpid()))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        import ray
        from ray.cluster_utils import Cluster

        node = {"num_cpus": NODE_CPUS, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}
        cluster = Cluster(initialize_head=True, connect=True, head_node_args={**node, "include_dashboard": False})
        try:
            try:
                cluster.add_node(**node)
            except Exception as exc:  # Ray gave up waiting after 30 s; the raylet itself goes on starting
                if "timed out during startup" not in str(exc):
                    raise
            _wait_for_nodes(2, NODE_START_S)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
            for pid in set(process_tree(os.getpid())) - before:  # a node Ray gave up on, say
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
