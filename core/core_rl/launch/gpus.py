"""Which GPUs the inference servers core-rl starts run on (``rollout.engine.server.gpus``).

A server sees only its own GPUs (``CUDA_VISIBLE_DEVICES``), so a vLLM or SGLang server with
``tensor_parallel_size x data_parallel_size = k`` uses exactly the ``k`` it is given.

- :func:`servers_gpus`: the list ``gpus`` split among ``num_servers`` servers of ``per_server``
  GPUs each, in order: server ``i`` takes positions ``i*per_server .. (i+1)*per_server - 1``,
  counted around the list when it is shorter than ``num_servers * per_server`` (servers then
  share GPUs, as colocated servers share the trainer's).
- :func:`placed_gpus`: ``gpus`` when the configuration leaves it empty, from the placement on a
  machine whose first ``trainer_gpus`` GPUs hold the trainer's local ranks (``cuda:LOCAL_RANK``):
  ``split``: the next ``num_servers * per_server`` GPUs; ``colocate``: the trainer's own, server
  ``i`` beginning where its share does.
- :func:`resolve_server_gpus`: the rollout engine's config with ``gpus`` filled in from the
  placement, where core-rl starts CUDA servers on a machine whose GPUs the trainer sees and
  neither ``gpus`` nor ``env.CUDA_VISIBLE_DEVICES`` chooses them; with the line that says so.
- :func:`visible_devices`: the ``CUDA_VISIBLE_DEVICES`` of one server: indices count the GPUs this
  process sees, so under a parent ``CUDA_VISIBLE_DEVICES`` index ``k`` is its ``k``-th entry.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from core_rl.errors import CoreRLError

if TYPE_CHECKING:
    from core_rl.config.checks import MachineInfo
    from core_rl.config.schema import RunConfig

KEY = "rollout.engine.server.gpus"


def gpus_per_server(engine_config: Any) -> int:
    """The GPUs one server of ``engine_config`` takes: its ``gpus_per_server()`` (``vllm``,
    ``sglang``: tensor x data parallel size), 1 for an engine config without one."""
    method = getattr(engine_config, "gpus_per_server", None)
    return int(method()) if callable(method) else 1


def servers_gpus(gpus: Sequence[int], num_servers: int, per_server: int) -> list[list[int]]:
    """Each server's GPUs (see the module doc); a :class:`CoreRLError` naming :data:`KEY` when one
    server's share would hold a GPU twice or when GPUs of the list would go unused."""
    gpus = list(gpus)
    needed = num_servers * per_server
    if len(set(gpus)) != len(gpus):
        raise CoreRLError(f"{KEY}: {gpus} lists a GPU twice; list each GPU once (servers share a shorter list)")
    if len(gpus) < per_server:
        raise CoreRLError(
            f"{KEY}: {gpus} holds {len(gpus)} GPU(s), but one server takes {per_server} (tensor x data parallel "
            f"size); list at least {per_server}"
        )
    if len(gpus) > needed:
        raise CoreRLError(
            f"{KEY}: {gpus} holds {len(gpus)} GPUs, but {num_servers} server(s) of {per_server} GPU(s) use {needed}; "
            f"list {needed}, or raise rollout.engine.server.num_servers to {len(gpus) // per_server}"
        )
    return [[gpus[(i * per_server + j) % len(gpus)] for j in range(per_server)] for i in range(num_servers)]


def placed_gpus(mode: str, trainer_gpus: int, num_servers: int, per_server: int, device_count: int) -> list[int]:
    """The servers' GPUs by placement (see the module doc); a :class:`CoreRLError` when a split
    placement needs more GPUs than ``device_count``."""
    needed = num_servers * per_server
    if mode == "colocate" and trainer_gpus > 0:
        if per_server > trainer_gpus:
            raise CoreRLError(
                f"placement.mode: colocate: one server takes {per_server} GPUs (tensor x data parallel size), but the "
                f"trainer has {trainer_gpus} on this node; lower the server's parallel size, or list its GPUs in {KEY}"
            )
        return list(range(min(needed, trainer_gpus)))
    first = trainer_gpus if mode == "split" else 0
    if first + needed > device_count:
        raise CoreRLError(
            f"placement.mode: {mode}: the trainer's {trainer_gpus} GPU(s) and {num_servers} server(s) of {per_server} "
            f"GPU(s) need {first + needed} GPUs, but this machine has {device_count}; start fewer servers or ranks, "
            f"or list the servers' GPUs in {KEY}"
        )
    return list(range(first, first + needed))


def visible_devices(indices: Sequence[int], parent: str | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a server given ``indices`` of the GPUs this process sees
    (``parent``: this process's own ``CUDA_VISIBLE_DEVICES``, read from the environment when
    ``None``; empty or unset: every GPU, numbered as the driver numbers them)."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES") if parent is None else parent
    seen = [d.strip() for d in parent.split(",") if d.strip()] if parent else []
    if not seen:
        return ",".join(str(i) for i in indices)
    missing = [i for i in indices if i >= len(seen)]
    if missing:
        raise CoreRLError(
            f"{KEY}: GPU(s) {missing} do not exist here: this process sees {len(seen)} "
            f"(CUDA_VISIBLE_DEVICES={parent}), numbered 0 to {len(seen) - 1}"
        )
    return ",".join(seen[i] for i in indices)


def resolve_server_gpus(cfg: RunConfig, machine: MachineInfo) -> tuple[Any, str | None]:
    """``cfg.rollout.engine.config`` with ``server.gpus`` chosen by :func:`placed_gpus` (see the
    module doc), and a note naming the choice; the config unchanged and ``None`` where nothing is
    to choose. The trainer's GPUs on this node: ``machine.local_world_size`` unless the actor's
    engine runs on the CPU (``device: cpu``). A :class:`CoreRLError` when the GPUs do not suffice."""
    from core_rl.launch.placement import placement_mode, rollout_device, server_options

    engine_config = cfg.rollout.engine.config
    server = server_options(cfg)
    if server is None or server.urls or server.gpus or "CUDA_VISIBLE_DEVICES" in server.env:
        return engine_config, None
    if not machine.cuda_available or rollout_device(cfg, True)[0] != "cuda":
        return engine_config, None
    on_cpu = getattr(cfg.actor.engine.config, "device", "auto") == "cpu"
    trainer_gpus = 0 if on_cpu else machine.local_world_size
    per_server = gpus_per_server(engine_config)
    mode = placement_mode(cfg)
    gpus = placed_gpus(mode, trainer_gpus, server.num_servers, per_server, machine.cuda_device_count)
    where = "the trainer's own" if mode == "colocate" and trainer_gpus else f"after the trainer's {trainer_gpus}"
    note = (
        f"{KEY}: [] -> {gpus} (placement {mode}: {server.num_servers} server(s) of {per_server} GPU(s) on the GPUs "
        f"{where}; list them in {KEY} to choose)"
    )
    return attrs.evolve(engine_config, server=attrs.evolve(server, gpus=gpus)), note
