"""Process-group set-up and collectives: the engine uses the core's (:mod:`core_rl.launch.distributed`)."""

from core_rl.launch.distributed import (
    ReduceOp,
    all_reduce,
    any_rank,
    barrier,
    broadcast_object,
    ensure_process_group,
    pick_device,
    resolve_backend,
    union_of_names,
)

__all__ = [
    "ReduceOp",
    "all_reduce",
    "any_rank",
    "barrier",
    "broadcast_object",
    "ensure_process_group",
    "pick_device",
    "resolve_backend",
    "union_of_names",
]
