"""``core-rl train --nproc-per-node N CONFIG``: data-parallel training on this machine.

It is ``torchrun --nproc-per-node N -m core_rl.cli train CONFIG`` with safer defaults:

- torch's elastic agent (what ``torchrun`` runs) starts, watches and restarts the workers;
- the agent's rendezvous store, which every worker connects to, listens on 127.0.0.1 only (plain
  ``torchrun`` listens on every interface): it is handed a socket already bound to loopback;
- the workers' gloo / NCCL sockets listen on the loopback interface (``GLOO_SOCKET_IFNAME`` /
  ``NCCL_SOCKET_IFNAME`` are set unless you set them);
- with ``recover.mode: auto`` the agent restarts all workers after a failure, up to
  ``recover.retries`` times; each restart resumes from the newest valid checkpoint;
- SIGINT / SIGTERM to the launcher go to every worker, which finishes its step, saves a checkpoint
  and stops; the agent waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default here 120) before
  killing them.

Exit status: 0, the status of the first worker that failed, or 3 after a signal.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from core_rl.config.schema import RunConfig
from core_rl.trainer.errors import TrainingInterrupted
from core_rl.trainer.ranks import listen_on_loopback_unless_configured

RENDEZVOUS_BACKEND = "core-rl-loopback"
DEFAULT_SHUTDOWN_TIMEOUT_S = 120


def _shutdown_timeout(seconds: int) -> dict[str, int]:
    """``LaunchConfig``'s ``shutdown_timeout`` where this torch has it (2.12 and later); older
    versions take the grace period from ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` alone."""
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return {"shutdown_timeout": seconds}
    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(seconds)
    return {}


class LoopbackRendezvous(StaticTCPRendezvous):
    """The agent's rendezvous: torch's static one, with a store that listens on a socket the
    launcher bound to 127.0.0.1 (its descriptor is ``listen_fd`` in the rendezvous configuration)."""

    def __init__(self, params: RendezvousParameters) -> None:
        host, port = parse_rendezvous_endpoint(params.endpoint, -1)
        timeout = int(params.config.get("timeout", 900))
        super().__init__(host, port, 0, 1, params.run_id, timeout)
        self._store = TCPStore(
            host,
            port,
            1,
            True,
            datetime.timedelta(seconds=timeout),
            multi_tenant=True,
            master_listen_fd=int(params.config["listen_fd"]),
            use_libuv=True,
        )

    def get_backend(self) -> str:
        return RENDEZVOUS_BACKEND


def _register_rendezvous() -> None:
    try:
        rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, LoopbackRendezvous)
    except ValueError:  # registered already, by this function
        pass


def launch(config_path: str, overrides: Sequence[str], nproc: int, cfg: RunConfig) -> int:
    """Run ``core-rl train config_path overrides...`` in ``nproc`` workers; return the exit status."""
    from core_rl.trainer.resume import effective_recover_mode

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    listen_on_loopback_unless_configured("127.0.0.1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several workers
    _register_rendezvous()
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    restarts = cfg.recover.retries if effective_recover_mode(cfg) == "auto" else 0
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"core-rl-{os.getpid()}",
        rdzv_backend=RENDEZVOUS_BACKEND,
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"listen_fd": listener.detach(), "timeout": 900},
        max_restarts=restarts,
        monitor_interval=0.5,
        start_method="spawn",
        local_addr="127.0.0.1",
        **_shutdown_timeout(int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT_S))),
    )
    try:
        elastic_launch(config, sys.executable)("-m", "core_rl.cli", "train", config_path, *overrides)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode < 0:
            name = signal.Signals(-failure.exitcode).name
            print(f"core-rl: error: rank {rank} was killed by {name}", file=sys.stderr)
            return 1
        if failure.exitcode == TrainingInterrupted.exit_code:
            print(f"core-rl: rank {rank} was stopped by a signal (its message is above)", file=sys.stderr)
        else:
            restarted = f" after {restarts} restarts" if restarts else ""
            print(
                f"core-rl: error: rank {rank} exited with status {failure.exitcode}{restarted} (its message is above)",
                file=sys.stderr,
            )
        return failure.exitcode
    except SignalException as exc:
        print(
            f"core-rl: stopped by {signal.Signals(exc.sigval).name}: every rank was asked to finish its step, save "
            "a checkpoint and stop (their messages are above)",
            file=sys.stderr,
        )
        return TrainingInterrupted.exit_code
    return 0
