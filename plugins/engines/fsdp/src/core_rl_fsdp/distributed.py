"""Process-group set-up and collectives: the engine uses the core's (:mod:`core_rl.engine_utils.distributed`)."""

from core_rl.engine_utils.distributed import (
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
