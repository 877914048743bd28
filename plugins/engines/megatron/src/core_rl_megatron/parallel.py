"""Megatron's parallel state for the engine, and the exchange of batch rows inside one model replica.

core-rl hands every rank its own rows of the global batch. Under tensor, pipeline or context
parallelism several ranks hold one copy of the model (a *replica*: the ranks sharing a
data-parallel rank) and must process the same rows, so the engine gathers the rows of the ranks
of its replica (:class:`ReplicaRows`), runs them, and returns each rank its own rows' results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.distributed as dist
from core_rl.protocol import TensorBatch
from core_rl_train_kit.row_pool import pool_rows
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel

from core_rl_megatron.config import MegatronConfig
from core_rl_megatron.errors import MegatronSetupError


def _layout(cfg: MegatronConfig) -> dict[str, int | None]:
    return {
        "tensor_model_parallel_size": cfg.tensor_model_parallel_size,
        "pipeline_model_parallel_size": cfg.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": cfg.virtual_pipeline_size if cfg.virtual_pipeline_size > 1 else None,
        "context_parallel_size": cfg.context_parallel_size,
        "expert_model_parallel_size": cfg.expert_model_parallel_size,
    }


def _current_layout() -> dict[str, int | None]:
    return {
        "tensor_model_parallel_size": mpu.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": mpu.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": mpu.get_virtual_pipeline_model_parallel_world_size(),
        "context_parallel_size": mpu.get_context_parallel_world_size(),
        "expert_model_parallel_size": mpu.get_expert_model_parallel_world_size(),
    }


def init_model_parallel(cfg: MegatronConfig, world_size: int) -> None:
    """Initialise Megatron's process groups for ``cfg`` (or check that an earlier engine in this
    process initialised the same layout: Megatron keeps one layout per process), and seed its
    tensor-parallel RNG tracker (``cfg.seed``), leaving the default CUDA generator as it was."""
    if world_size % cfg.model_parallel_size:
        raise MegatronSetupError(
            f"actor.engine: {world_size} ranks cannot be divided into replicas of tensor_model_parallel_size "
            f"x pipeline_model_parallel_size x context_parallel_size = {cfg.model_parallel_size} ranks; "
            f"launch a multiple of {cfg.model_parallel_size} processes or change those sizes"
        )
    wanted = _layout(cfg)
    if mpu.model_parallel_is_initialized():
        current = _current_layout()
        if current != wanted:
            diff = ", ".join(f"{k}: {current[k]} (wanted {wanted[k]})" for k in wanted if current[k] != wanted[k])
            raise MegatronSetupError(
                f"actor.engine: Megatron's parallel state of this process was initialised with another layout "
                f"({diff}); every megatron engine of a process must use the same parallel sizes"
            )
    else:
        mpu.initialize_model_parallel(**wanted)
    # Megatron also seeds the default CUDA generator; everything else in the process (the embedded
    # rollout engine's sampling among it) keeps drawing from the run's own seeding (experiment.seed)
    default_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    if default_state is not None:
        torch.cuda.set_rng_state(default_state)


def tp_group() -> dist.ProcessGroup | None:
    """The tensor-parallel group, ``None`` without tensor parallelism."""
    return mpu.get_tensor_model_parallel_group() if mpu.get_tensor_model_parallel_world_size() > 1 else None


class ReplicaRows:
    """Gathers the rows of every rank of this rank's model replica (one gloo group per replica,
    created collectively by all ranks) and hands back this rank's share of row-aligned results."""

    # one group per layout and process: creating groups is collective, so it happens once
    _groups: ClassVar[dict[tuple[int, ...], tuple[dist.ProcessGroup | None, list[int]]]] = {}

    def __init__(self) -> None:
        world = dist.get_world_size()
        key = (world, *(v or 0 for v in _current_layout().values()))
        if key not in self._groups:
            replica = [None] * world
            dist.all_gather_object(replica, mpu.get_data_parallel_rank())
            mine: tuple[dist.ProcessGroup | None, list[int]] = (None, [dist.get_rank()])
            for index in sorted(set(replica)):
                ranks = [r for r in range(world) if replica[r] == index]
                group = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None
                if dist.get_rank() in ranks:
                    mine = (group, ranks)
            self._groups[key] = mine
        self.group, self.ranks = self._groups[key]
        self.index = self.ranks.index(dist.get_rank())

    @property
    def size(self) -> int:
        return len(self.ranks)

    def gather(self, batch: TensorBatch, pad_token_id: int) -> tuple[TensorBatch, slice, int]:
        """The replica's rows (its ranks' batches in rank order, padded to the widest), the slice of
        them that is this rank's, and this rank's width (:func:`core_rl_train_kit.row_pool.pool_rows`)."""
        rows, mine = pool_rows(batch, self.group, self.size, self.index, pad_token_id)
        return rows, mine, batch["input_ids"].shape[1]


def full_shape(local: Sequence[int], split: str, tp_size: int) -> tuple[int, ...]:
    """The unsharded shape of a parameter whose rank-local shape is ``local``."""
    shape = list(local)
    if split in ("rows", "glu"):
        shape[0] *= tp_size
    elif split == "cols":
        shape[1] *= tp_size
    return tuple(shape)
