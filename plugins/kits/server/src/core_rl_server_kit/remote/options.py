"""The ``server`` subsection of a server-backed rollout engine's config (:class:`ServerOptions`)."""

from __future__ import annotations

import attrs
from core_rl.config.validators import FieldValueError, non_negative, one_of, positive
from core_rl.interfaces import PAUSE_MODES


@attrs.define
class ServerOptions:
    """The ``server`` subsection of a server-backed rollout engine: where servers come from and how
    requests to them behave.

    - ``urls``: base URLs of servers already running; core-rl neither starts nor stops them.
      Empty: core-rl starts ``num_servers`` servers on ``host`` at ``ports`` (free ports if empty).
    - ``python``: the interpreter to start servers with; empty: the plugin's managed server
      environment (``core-rl server-env create NAME``; built on first use when
      ``create_env`` is true), of ``env_variant`` (``cpu``/``cuda``; empty: ``cuda`` where
      ``nvidia-smi`` exists).
    - ``env``: environment variables for the servers.
    - ``gpus``: GPUs the started servers run on (indices of the GPUs the trainer sees), split in
      order among them (:mod:`core_rl.launch.gpus`); empty: on CUDA, the placement decides (``split``:
      the GPUs after the trainer's on this node; ``colocate``: the trainer's own), and the choice is
      printed at the start.
    - ``cpus``: CPU cores the started servers run on (their processes' affinity; empty: any). Where
      rollout and training share a machine's CPUs, giving each side its own cores keeps one
      side's threads (and an inference engine's busy-polling scheduler) off the other's.
    - ``startup_timeout``: seconds a server may take to answer its health check.
    - ``request_timeout``, ``max_retries``, ``retry_backoff``: each request may take
      ``request_timeout`` s; a failed one is retried up to ``max_retries`` times, after
      ``retry_backoff * 2**k`` s.
    - ``max_concurrent_requests``: requests in flight over all servers (each asks for the ``n``
      samples of one prompt).
    - ``batch_window_s``: requests for one server that arrive within this many seconds of the
      first go to it in one HTTP round trip, where the plugin can send several at once (each is
      still its own request on the server and comes back as soon as it finishes); 0: one HTTP
      request each.
    - ``on_server_failure``: ``restart`` a managed server that died (at most ``max_restarts``
      times each) or ``fail`` the run with its name and log (see :mod:`core_rl_server_kit.remote.recovery`
      for what a restarted server gets back, and when a death is not restarted).
    - ``update_pause_mode``: how generation pauses around a weight update when the caller has not
      paused it already (``wait``, ``keep`` or ``abort``, see :meth:`RolloutEngine.pause`).
    - ``weight_sync_backend``: ``auto`` (``nccl`` for ``cuda`` servers with GPUs of their own:
      connected by ``urls``, started with ``CUDA_VISIBLE_DEVICES`` in ``env``, or on ``gpus`` without
      GPU 0, the trainer's rank 0's; else ``gloo``), ``gloo`` or ``nccl``; ``weight_sync_timeout``:
      seconds a weight update may take;
      ``weight_sync_address``: the trainer's address as the servers reach it (empty: ``host``
      for started servers, 127.0.0.1 for ``urls``).
    """

    urls: list[str] = attrs.field(factory=list)
    python: str = ""
    create_env: bool = True
    env_variant: str = attrs.field(default="", validator=one_of(("", "cpu", "cuda")))
    num_servers: int = attrs.field(default=1, validator=positive())
    host: str = "127.0.0.1"
    ports: list[int] = attrs.field(factory=list)
    env: dict[str, str] = attrs.field(factory=dict)
    gpus: list[int] = attrs.field(factory=list, validator=lambda _i, a, v: _check_gpus(a.name, v))
    cpus: list[int] = attrs.field(factory=list, validator=lambda _i, a, v: _check_cpus(a.name, v))
    startup_timeout: float = attrs.field(default=600.0, validator=positive())
    shutdown_grace: float = attrs.field(default=15.0, validator=positive())
    request_timeout: float = attrs.field(default=600.0, validator=positive())
    max_retries: int = attrs.field(default=3, validator=non_negative())
    retry_backoff: float = attrs.field(default=1.0, validator=non_negative())
    max_concurrent_requests: int = attrs.field(default=64, validator=positive())
    batch_window_s: float = attrs.field(default=0.002, validator=non_negative())
    on_server_failure: str = attrs.field(default="restart", validator=one_of(("restart", "fail")))
    max_restarts: int = attrs.field(default=2, validator=non_negative())
    update_pause_mode: str = attrs.field(default="wait", validator=one_of(PAUSE_MODES))
    weight_sync_backend: str = attrs.field(default="auto", validator=one_of(("auto", "gloo", "nccl")))
    weight_sync_address: str = ""
    weight_sync_timeout: float = attrs.field(default=600.0, validator=positive())


def _check_cpus(name: str, cpus: list[int]) -> None:
    """Every core of ``cpus`` must exist on this machine (``0 .. os.cpu_count() - 1``)."""
    import os

    count = os.cpu_count() or 1
    missing = [c for c in cpus if not 0 <= c < count]
    if missing:
        raise FieldValueError(name, cpus, f"cores {missing} do not exist here (cores 0 to {count - 1})")


def _check_gpus(name: str, gpus: list[int]) -> None:
    """GPU indices are not negative and each appears once (see :func:`core_rl.launch.gpus.servers_gpus`)."""
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise FieldValueError(name, gpus, "list each GPU's index (0, 1, ...) once")
