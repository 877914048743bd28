"""The Ray actors of a run: one :class:`TrainerRank` per trainer rank, one :class:`RolloutServer`
per inference server. Both are plain classes here; :mod:`core_rl_ray.group` wraps them with
``ray.remote`` and the resources of their placement-group bundle.

Every method returns promptly (the launcher polls :meth:`TrainerRank.poll` and
:meth:`RolloutServer.failure`), so the actors keep Ray's default of one call at a time, run on the
worker's main thread: the parent-death signal of a child process fires when the thread that
started it ends, and the main thread lives as long as the actor.

A trainer rank does not train inside the actor's own process. It runs ``python -m core_rl_ray.rank``
as a child process, so that

- ``SIGTERM`` reaches the trainer exactly as under ``torchrun`` (finish the step, save a
  checkpoint, exit 3): Ray's worker owns the actor process's signal handlers;
- the child's exit status is the rank's, and a rank that ends leaves no process group, CUDA
  context or imported modules behind in a worker Ray might reuse;
- the child dies with the actor (``PR_SET_PDEATHSIG``): ``ray.kill`` or a lost node leaves no
  orphan trainer;
- the child leaves the line it exits with (its error, or the progress watchdog's diagnosis) in a
  file the actor names (:mod:`core_rl.reliability.exit_note`), which the driver reads back
  (:meth:`TrainerRank.exit_note`) to name the reason in its own message. The file is anonymous
  memory the actor holds open (``memfd_create``), named to the child by its path under the actor's
  ``/proc/PID/fd``: nothing is ever made on disk, so an actor killed outright leaves nothing behind.

A rollout server actor starts its server through the rollout engine plugin itself (the server's
command line, environment variables and health check are the plugin's), from the plugin's managed
server environment (``core-rl server-env create NAME``), under :mod:`core_rl_server_kit.supervise` with the
actor as parent: the server's whole process session stops when the actor stops or dies. The actor
runs the trainer environment's interpreter (Ray workers must import ``ray`` and ``core_rl``, which
a server environment pinning its own torch and transformers does not hold); only the server
process runs the server environment's interpreter.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core_rl.reliability import exit_note

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def normal_priority() -> None:
    """Undo the niceness Ray starts its workers with (``RAY_worker_niceness``, 15): a trainer or
    a server at that priority crawls on a busy node. Needs the right to lower niceness (root,
    ``CAP_SYS_NICE`` or ``RLIMIT_NICE``); without it the actor keeps Ray's."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass


def where() -> dict[str, Any]:
    """Where the calling actor runs: node address and id, host name, pid and the GPU ids Ray gave it."""
    import ray

    ctx = ray.get_runtime_context()
    return {
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ctx.get_node_id(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
    }


class TrainerRank:
    """One trainer rank: its process is started by :meth:`start` and watched by :meth:`wait`."""

    def __init__(self) -> None:
        normal_priority()  # inherited by the rank's process
        self._proc: subprocess.Popen | None = None
        self._note: int | None = None  # the descriptor of the running rank's note
        self._note_text = ""

    def where(self) -> dict[str, Any]:
        return where()

    def free_port(self) -> int:
        """A port free on this actor's node address (rank 0's is the rendezvous port)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((where()["node_ip"], 0))
            return int(s.getsockname()[1])

    def start(self, argv: Sequence[str], env: Mapping[str, str]) -> int:
        """Start the rank's process (``argv`` after this interpreter) with ``env`` added; its pid."""
        full = {**os.environ, **env}
        full.pop("RAY_ADDRESS", None)  # the rank is no Ray driver
        full.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several workers
        self._close_note()
        self._note, self._note_text = os.memfd_create("core-rl-rank-note"), ""
        full[exit_note.VARIABLE] = self.note_path()  # the line the rank exits with, for the driver
        self._proc = subprocess.Popen(
            [sys.executable, *argv], env=full, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        return self._proc.pid

    def touch(self, path: str) -> None:
        """Create the file ``path`` (and its directory): a mark other nodes look for."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).touch()

    def remove(self, path: str) -> None:
        Path(path).unlink(missing_ok=True)

    def poll(self) -> int | None:
        """The rank's exit status once its process ended (``-N``: killed by signal N), else ``None``."""
        if self._proc is None:
            return None
        code = self._proc.poll()
        if code is not None:
            self._settle_note()
        return code

    def exit_note(self) -> str:
        """The line the rank's process ended with (its error, the watchdog's diagnosis:
        :mod:`core_rl.reliability.exit_note`); empty when it left none."""
        if self._proc is not None and self._proc.poll() is not None:
            self._settle_note()
        return self._note_text if self._note is None else exit_note.read(self.note_path())

    def note_path(self) -> str:
        """The path the running rank writes its note to: the actor's descriptor of the note's
        anonymous file, as ``/proc/PID/fd/N`` (any process of this node and user can open it while
        the actor lives; empty when no rank runs)."""
        return "" if self._note is None else f"/proc/{os.getpid()}/fd/{self._note}"

    def _settle_note(self) -> None:
        """Once the process has ended: keep its note's line and close the file (every ended rank,
        whether or not the driver asks for its note)."""
        if self._note is not None:
            self._note_text = exit_note.read(self.note_path())
            self._close_note()

    def _close_note(self) -> None:
        if self._note is not None:
            os.close(self._note)
            self._note = None

    def stop(self, grace: float) -> int | None:
        """``SIGTERM`` the rank (it finishes its step, saves a checkpoint and exits), ``SIGKILL``
        after ``grace`` seconds; its exit status."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        self._settle_note()
        return proc.returncode


class RolloutServer:
    """One inference server, started by the rollout engine plugin that ``cfg.rollout.engine``
    names, on this actor's node address and a free port."""

    def __init__(self) -> None:
        normal_priority()  # inherited by the server's processes
        self._engine: Any = None

    def where(self) -> dict[str, Any]:
        return where()

    def start(self, config_path: str, overrides: Sequence[str], index: int, log_dir: str) -> str:
        """Start server ``index`` (logs under ``log_dir``) and wait until it answers its health
        check (``rollout.engine.server.startup_timeout``); its base URL."""
        from core_rl.config import load_config
        from core_rl.plugins import ROLLOUT_ENGINE, PluginHost, build_component
        from core_rl.roles import rollout_factory_kwargs

        if self._engine is not None:
            return self.url()
        node_ip = where()["node_ip"]
        own = [
            "rollout.engine.server.urls=[]",
            "rollout.engine.server.num_servers=1",
            "rollout.engine.server.gpus=[]",  # Ray gave this actor its GPUs (the launcher refuses a list)
            "rollout.engine.server.ports=[]",
            f"rollout.engine.server.host={node_ip}",
        ]
        host = PluginHost()
        cfg = load_config(config_path, [*overrides, *own], host=host)
        self._engine = build_component(
            host.get(ROLLOUT_ENGINE, cfg.rollout.engine.name),
            cfg.rollout,
            cfg.rollout.engine.config,
            model_path=cfg.actor.model_path,
            run_dir=Path(log_dir) / f"server-{index}",
            **rollout_factory_kwargs(cfg),
        )
        return self.url()

    def sees(self, path: str) -> bool:
        """Whether the file ``path`` exists on this actor's node."""
        return Path(path).exists()

    def url(self) -> str:
        return str(self._engine.endpoints[0].url)

    def server_pid(self) -> int | None:
        server = self._engine.endpoints[0].server if self._engine is not None else None
        return None if server is None else server.pid

    def failure(self) -> str | None:
        """``None`` while the server runs; once it ended, how (its exit, last error and log tail)."""
        server = self._engine.endpoints[0].server if self._engine is not None else None
        if server is None or server.alive():
            return None
        return str(server.failure("stopped"))

    def stop(self) -> None:
        """Stop the server and every process it started (SIGTERM, then SIGKILL after its grace)."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
