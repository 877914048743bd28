"""``core-rl train --nproc-per-node N CONFIG``: data-parallel training on this machine, or with
``--nnodes M --node-rank R --rdzv-endpoint HOST:PORT`` on each of M machines (the ``local``
launcher, :mod:`core_rl.builtin.launchers`).

It is ``torchrun --nproc-per-node N [--nnodes M ...] -m core_rl.cli train CONFIG`` with safer defaults:

- torch's elastic agent (what ``torchrun`` runs) starts, watches and restarts the workers;
- the agent's rendezvous store, which every worker connects to, listens on 127.0.0.1 only (plain
  ``torchrun`` listens on every interface): it is handed a socket already bound to loopback; on
  several nodes, node 0's store listens on the rendezvous endpoint's address alone and the other
  nodes connect to it (within ``rdzv_timeout_s``);
- the workers' gloo / NCCL sockets listen on the loopback interface (``GLOO_SOCKET_IFNAME`` /
  ``NCCL_SOCKET_IFNAME`` are set unless you set them); on several nodes, on the configured
  interface (``launcher.interface``) instead, unless the endpoint is loopback;
- with ``recover.mode: auto`` the agent restarts all workers after a failure, up to
  ``recover.retries`` times; each restart resumes from the newest valid checkpoint (on one node
  only: on several, a failure ends the run on every node, and launching again resumes);
- SIGINT / SIGTERM to the launcher go to every worker, which finishes its step, saves a checkpoint
  and stops, or stops without saving when its step has not finished within ``trainer.stop_grace_s``
  (:mod:`core_rl.loops.signals`); the agent waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds
  (default here 120, or ``stop_grace_s`` plus a minute when that is longer) before killing them;
- when a worker fails, the agent sends SIGTERM to the others and kills those still running 30 s
  later (torch's fixed grace on that path: a stopped or hung rank holds the run's exit that long).

Exit status: 0, the status of the first worker that failed, 3 after a signal, or 128 + the signal's
number when a rank's step did not finish within ``trainer.stop_grace_s`` of it (that rank stopped
without saving; each worker leaves its last line in a file the agent reads, :mod:`core_rl.reliability.exit_note`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from core_rl.config.schema import RunConfig
from core_rl.errors import CoreRLError, stderr_line
from core_rl.launch.ranks import is_loopback, listen_on_loopback_unless_configured
from core_rl.loops.errors import TrainingInterrupted
from core_rl.loops.signals import NOT_SAVED
from core_rl.reliability import exit_note

RENDEZVOUS_BACKEND = "core-rl-loopback"
DEFAULT_SHUTDOWN_TIMEOUT_S = 120

#: the module each rank runs (``python -m RANK_MODULE train CONFIG ...``): :mod:`core_rl.cli`, or a
#: wrapper that registers plugins before it calls :func:`core_rl.cli.main`, which sets this to its own
#: name so that its ranks hold them too (:mod:`core_rl.testing.faults`)
RANK_MODULE = "core_rl.cli"


def _shutdown_timeout(seconds: int) -> dict[str, int]:
    """``LaunchConfig``'s ``shutdown_timeout`` where this torch has it (2.12 and later); older
    versions take the grace period from ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` alone."""
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return {"shutdown_timeout": seconds}
    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(seconds)
    return {}


def shutdown_timeout_s(cfg: RunConfig) -> int:
    """How long the agent waits for the workers after forwarding a signal: at least
    :data:`DEFAULT_SHUTDOWN_TIMEOUT_S`, and a minute more than ``trainer.stop_grace_s`` so that each
    rank stops on its own (saying whether it saved) before the agent kills it."""
    return max(DEFAULT_SHUTDOWN_TIMEOUT_S, int(cfg.trainer.stop_grace_s) + 60)


class LoopbackRendezvous(StaticTCPRendezvous):
    """The agent's rendezvous: torch's static one over ``max_nodes`` nodes, this one being node
    ``rank`` (rendezvous configuration). Node 0's store listens on a socket the launcher bound (to
    127.0.0.1, or to the endpoint's address on several nodes; its descriptor is ``listen_fd``);
    the other nodes' agents connect to it."""

    def __init__(self, params: RendezvousParameters) -> None:
        host, port = parse_rendezvous_endpoint(params.endpoint, -1)
        timeout = int(params.config.get("timeout", 900))
        node_rank, nnodes = int(params.config.get("rank", 0)), params.max_nodes
        super().__init__(host, port, node_rank, nnodes, params.run_id, timeout)
        listen = {"master_listen_fd": int(params.config["listen_fd"])} if node_rank == 0 else {}
        if node_rank != 0:
            _wait_for_listener(host, port, timeout, f"node {node_rank} of {nnodes}")
        try:
            self._store = TCPStore(
                host,
                port,
                nnodes,
                node_rank == 0,
                datetime.timedelta(seconds=timeout),
                multi_tenant=True,
                use_libuv=True,
                **listen,
            )
        except (RuntimeError, TimeoutError) as exc:  # DistStoreError is a RuntimeError
            raise _rendezvous_error(f"node {node_rank} of {nnodes}", host, port, timeout, str(exc)) from exc

    def get_backend(self) -> str:
        return RENDEZVOUS_BACKEND


def _rendezvous_error(who: str, host: str, port: int, timeout: float, why: str) -> CoreRLError:
    return CoreRLError(
        f"{who}: the rendezvous at {host}:{port} did not complete within {timeout:g} s ({why}); start "
        f"`core-rl train --nnodes N --node-rank R --rdzv-endpoint {host}:{port}` on every node, node 0 first, and "
        "check the address is reachable from this one (launcher.rdzv_timeout_s sets the limit)"
    )


def _wait_for_listener(host: str, port: int, timeout: float, who: str) -> None:
    """Wait until node 0's store accepts connections at ``host:port`` (torch's own client would
    log a C++ stack trace for each refused try), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, timeout)).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                why = f"node 0 does not answer: {exc.strerror or exc}"
                raise _rendezvous_error(who, host, port, timeout, why) from None
            time.sleep(0.5)


def _register_rendezvous() -> None:
    try:
        rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, LoopbackRendezvous)
    except ValueError:  # registered already, by this function
        pass


@attrs.frozen
class Nodes:
    """The nodes of a multi-node launch: this is node ``rank`` of ``count``, and node 0's agent
    store listens at ``endpoint`` (``HOST:PORT``); ``interface``: the network interface gloo and
    NCCL use (empty: their own choice; loopback when the endpoint is); ``timeout_s``: how long the
    agents wait for each other."""

    count: int = 1
    rank: int = 0
    endpoint: str = ""
    interface: str = ""
    timeout_s: int = 900


def _store_socket(nodes: Nodes) -> tuple[str, int, int | None]:
    """``(host, port, descriptor)`` of the agent store: a socket bound to 127.0.0.1 on a free port
    for one node; on several, node 0 binds the endpoint's address (the others bind nothing)."""
    if nodes.count == 1:
        host, port = "127.0.0.1", 0
    else:
        host, port = parse_rendezvous_endpoint(nodes.endpoint, -1)
        if nodes.rank != 0:
            return host, port, None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise CoreRLError(
            f"--rdzv-endpoint {nodes.endpoint}: node 0 cannot listen there ({exc.strerror}); give an address of "
            "this machine and a free port"
        ) from None
    listener.listen(128)
    return host, listener.getsockname()[1], listener.detach()


def _listen_on(nodes: Nodes, host: str) -> None:
    """Where the workers' gloo / NCCL sockets listen (see the module docstring)."""
    if nodes.count > 1 and nodes.interface and not is_loopback(host):
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(var, nodes.interface)
    listen_on_loopback_unless_configured(host)


def launch(config_path: str, overrides: Sequence[str], nproc: int, cfg: RunConfig, nodes: Nodes | None = None) -> int:
    """Run ``core-rl train config_path overrides...`` in ``nproc`` workers on this node (one of
    ``nodes``); return the exit status."""
    from core_rl.checkpoint.resume import effective_recover_mode

    nodes = nodes or Nodes()
    host, port, listen_fd = _store_socket(nodes)
    _listen_on(nodes, host)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several workers
    _register_rendezvous()
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    restarts = cfg.recover.retries if effective_recover_mode(cfg) == "auto" and nodes.count == 1 else 0
    rdzv: dict[str, Any] = {"timeout": nodes.timeout_s, "rank": nodes.rank}
    if listen_fd is not None:
        rdzv["listen_fd"] = listen_fd
    # the ranks' exit notes, and torch elastic's per-launch files (left in a temporary directory of
    # their own otherwise, never removed): both go with the launch
    scratch = tempfile.TemporaryDirectory(prefix="core-rl-launch-")
    config = LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=str(Path(scratch.name) / "elastic")),
        min_nodes=nodes.count,
        max_nodes=nodes.count,
        nproc_per_node=nproc,
        # every node's agent must name the same run
        run_id=f"core-rl-{os.getpid()}" if nodes.count == 1 else f"core-rl-{host}-{port}",
        rdzv_backend=RENDEZVOUS_BACKEND,
        rdzv_endpoint=f"{host}:{port}",
        rdzv_configs=rdzv,
        max_restarts=restarts,
        monitor_interval=0.5,
        start_method="spawn",
        local_addr="127.0.0.1" if is_loopback(host) else None,
        **_shutdown_timeout(int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", shutdown_timeout_s(cfg)))),
    )
    os.environ[exit_note.VARIABLE] = str(Path(scratch.name) / "rank-{rank}.txt")  # each worker's last line
    try:
        elastic_launch(config, sys.executable)("-m", RANK_MODULE, "train", config_path, *overrides)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode < 0:
            name = signal.Signals(-failure.exitcode).name
            stderr_line(f"core-rl: error: rank {rank} was killed by {name}")
            return 1
        if failure.exitcode == TrainingInterrupted.exit_code:
            stderr_line(f"core-rl: rank {rank} was stopped by a signal (its message is above)")
        else:
            restarted = f" after {restarts} restarts" if restarts else ""
            stderr_line(
                f"core-rl: error: rank {rank} exited with status {failure.exitcode}{restarted} (its message is above)"
            )
        return failure.exitcode
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        left = sorted(Path(scratch.name).glob("rank-*.txt"), key=lambda f: int(f.stem.removeprefix("rank-")))
        unsaved = [f.stem.removeprefix("rank-") for f in left if exit_note.read(f).startswith(NOT_SAVED)]
        if unsaved:
            who = f"rank {unsaved[0]}" if len(unsaved) == 1 else f"ranks {', '.join(unsaved)}"
            stderr_line(
                f"core-rl: stopped by {name}: {who} did not finish the step within trainer.stop_grace_s and stopped "
                "without saving; the newest complete checkpoint stays as it was (the messages are above)"
            )
            return 128 + exc.sigval
        stderr_line(
            f"core-rl: stopped by {name}: every rank was asked to finish its step, save a checkpoint and stop "
            "(their messages are above)"
        )
        return TrainingInterrupted.exit_code
    finally:
        os.environ.pop(exit_note.VARIABLE, None)
        scratch.cleanup()
    return 0
