"""Attaching to a Ray cluster, or starting one on this machine (:func:`connect`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from core_rl.errors import CoreRLError
from core_rl.launch import ClusterResources, is_loopback

#: actors live in this namespace, named ``<experiment.name>/rank-<i>`` and ``.../server-<j>``
NAMESPACE = "core-rl"
#: Ray's switch between "clusters" (addresses resolved to the network's) and loopback-only runs
KEEP_LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class RayClusterError(CoreRLError):
    """The Ray cluster cannot be reached or cannot hold the run (exit status 2)."""


@contextlib.contextmanager
def connect(address: str, *, local_cpus: int = 0, local_gpus: int | None = None) -> Iterator[bool]:
    """Be a driver of the Ray cluster at ``address`` (``host:port`` of its head, or ``auto``) for
    the ``with`` block; without an address, of a cluster started here on 127.0.0.1 (``local_cpus``
    CPUs, 0: all of this machine's) and shut down on leaving. Yields whether the cluster was
    started here."""
    if address and is_loopback(address.rsplit(":", 1)[0]):
        # Ray rewrites a loopback head address to this machine's network address before it
        # connects, where a head started with --node-ip-address 127.0.0.1 does not listen; with
        # this variable (read when ray is imported) it keeps the loopback address.
        os.environ.setdefault(KEEP_LOOPBACK, "0")
    import ray

    if ray.is_initialized():  # an embedding program's own connection: keep it
        yield False
        return
    started = not address
    try:
        if started:
            ray.init(
                address="local",
                namespace=NAMESPACE,
                num_cpus=local_cpus or None,
                num_gpus=local_gpus,
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                log_to_driver=True,
                configure_logging=False,
            )
        else:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=True, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {address} (--ray-address / launcher.address)" if address else "a local Ray cluster"
        raise RayClusterError(f"ray launcher: cannot connect to {where}: {exc}") from None
    try:
        yield started
    finally:
        ray.shutdown()  # the local cluster's processes stop with it


def cluster_resources() -> dict[str, float]:
    """CPUs, GPUs and nodes of the connected cluster (``nodes``: alive nodes)."""
    import ray

    total = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return {"CPU": total.get("CPU", 0.0), "GPU": total.get("GPU", 0.0), "nodes": float(len(nodes))}


def offered_by(address: str) -> ClusterResources:
    """What the cluster at ``address`` offers a placement: its alive nodes, each with the most
    GPUs and CPUs any of them has (a cluster of unlike nodes may still refuse a placement that
    passes: the placement group's wait says so at launch)."""
    import ray

    with connect(address):
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    return ClusterResources(
        nodes=len(nodes),
        gpus_per_node=int(max((n.get("GPU", 0) for n in nodes), default=0)),
        cpus_per_node=int(max((n.get("CPU", 0) for n in nodes), default=0)),
        source=f"the Ray cluster at {address}",
    )
