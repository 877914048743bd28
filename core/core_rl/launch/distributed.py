"""Process group and device set-up, and the few collectives train engines need.

One code path serves CPU + gloo and GPU + NCCL:

- if ``torch.distributed`` is already initialised (by the trainer, or by an earlier engine in this
  process: an actor and its frozen reference share one group), that group is used as it is;
- else if ``RANK`` and ``WORLD_SIZE`` are set (``torchrun``), the group is initialised from the
  environment (``env://``);
- else a world-size-1 group is created over an in-process store, so a sharded engine always has a
  group to run on. Groups the engine creates live as long as the process.

A group the engine creates gets the run's collective timeout
(:func:`core_rl.launch.ranks.collective_timeout`, from ``trainer.collective_timeout_s``), so no
collective waits forever for a stopped or dead rank. On one machine (no ``MASTER_ADDR``, or a
loopback one) gloo and NCCL are told to listen on the loopback interface only, unless
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` say otherwise.
"""

from __future__ import annotations

import atexit
import functools
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from core_rl.launch.ranks import collective_timeout, listen_on_loopback_unless_configured

ReduceOp = dist.ReduceOp


#: the values of a train engine's ``device`` option
DEVICES = ("auto", "cpu", "cuda")


def pick_device(preference: str = "auto") -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` (made the current device) for ``cuda``, and for
    ``auto`` when CUDA is available; else ``cpu``. A local rank without a GPU of its own is an
    error naming both counts (two ranks on one GPU would share it and deadlock NCCL)."""
    if preference not in DEVICES:
        raise ValueError(f"device: {preference!r} is not one of {', '.join(DEVICES)}")
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device: cuda, but torch sees no CUDA device on this machine")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU of its own: this node has {count} CUDA device(s); start at most "
            f"{count} process(es) per node, or set the engine's device: cpu"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend string for ``init_process_group``: ``auto`` -> ``cuda:nccl,cpu:gloo`` on a machine
    with CUDA (so CPU tensors and object collectives also work, and an engine kept on the CPU, e.g.
    a reference model, shares the group with GPU engines of the same process; NCCL starts only at
    the first CUDA collective), ``gloo`` without CUDA."""
    if backend != "auto":
        if backend == "nccl" and device.type != "cuda":
            raise ValueError("actor.engine.backend: nccl needs CUDA; use gloo or auto on CPU")
        return backend
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" or torch.cuda.is_available() else "gloo"


@functools.cache
def destroy_process_group_at_exit() -> None:
    """Destroy the default process group (and so every group made from it) when the interpreter
    exits, as torch asks of a program that made one (NCCL warns otherwise). At exit, not now: a
    later run in the same process (the main job's warm start, then GRPO) reuses the group, and
    Megatron's parallel state holds groups made from it. Only after a run that finished: after a
    failure, a collective may still wait on a dead peer, and destroying the group could wait too."""

    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)


def ensure_process_group(backend: str, device: torch.device) -> tuple[int, int]:
    """Initialise the default process group unless it exists (see the module docstring);
    return ``(rank, world_size)``."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build; train engines need it")
    if not dist.is_initialized():
        resolved = resolve_backend(backend, device)
        env_world = os.environ.get("WORLD_SIZE")
        timeout = collective_timeout()
        kwargs: dict = {"timeout": timeout} if timeout is not None else {}
        listen_on_loopback_unless_configured(os.environ.get("MASTER_ADDR"))
        if os.environ.get("RANK") is not None and env_world is not None and "MASTER_ADDR" in os.environ:
            if device.type == "cuda":
                kwargs["device_id"] = device
            dist.init_process_group(resolved, init_method="env://", **kwargs)
        elif env_world is not None and int(env_world) > 1:
            raise RuntimeError(
                f"WORLD_SIZE={env_world} but RANK/MASTER_ADDR/MASTER_PORT are not all set; launch with torchrun"
            )
        else:
            dist.init_process_group(resolved, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
            destroy_process_group_at_exit()  # a group of one has no peer to wait for at exit
    return dist.get_rank(), dist.get_world_size()


#: the reductions that leave one rank's values as they are
_IDENTITY_ALONE = frozenset({ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.MIN})


def all_reduce(values: torch.Tensor, op: dist.ReduceOp.RedOpType = ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``values`` in place over the default group and return it; in a group of one rank,
    where a sum, mean, product, maximum or minimum is the identity, as it is (no call into the
    backend)."""
    if dist.get_world_size() > 1 or op not in _IDENTITY_ALONE:
        dist.all_reduce(values, op=op)
    return values


def summed_over_ranks(values: Sequence[float]) -> list[float]:
    """``values`` summed over every rank of the default group (as they are without one, or with a
    group of one), in float64 on the device the group's backend reduces on. Collective."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return all_reduce(torch.tensor(list(values), dtype=torch.float64, device=device)).tolist()


def union_of_names(names: Sequence[str]) -> list[str]:
    """Sorted union of ``names`` over all ranks (ranks may see different metric names, e.g. a rank
    with no rows never calls the loss)."""
    if dist.get_world_size() == 1:
        return sorted(set(names))
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(set(names)))
    return sorted({n for part in gathered for n in (part or [])})


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank (one all-reduce of a CPU tensor)."""
    if dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.long)
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.all_reduce(value, op=ReduceOp.MAX)
    return bool(value.item())


def barrier() -> None:
    dist.barrier()


def broadcast_object(obj: object, src: int = 0) -> object:
    """``obj`` from rank ``src`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
