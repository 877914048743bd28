"""Training-state directories written by all ranks together, in formats that execute nothing on load
(:mod:`core_rl.checkpointing`): the collective atomic-write protocol, ``meta.json``, and per-rank
RNG states.

Layout every engine shares (engines add their own files)::

    meta.json                       format, engine, step, world size, whether optimizer state exists
    model.safetensors               full (unsharded) weights
    optimizer.{json,safetensors}    full optimizer state, keyed by parameter name
    extra.{json,safetensors}        the trainer's ``extra`` (e.g. the data position)
    rng/rank{r}.{json,safetensors}  each rank's RNG states
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core_rl import checkpointing as ckpt
from core_rl.engine_utils import distributed as dist_utils


def write_collectively(final: Path, rank: int, write: Callable[[Path], None]) -> None:
    """Every rank calls ``write(tmp)`` into the shared partial directory of ``final``; rank 0 moves
    it into place once all have finished. A failure on any rank removes the partial directory and
    raises on every rank (the failing rank's own exception there), so no rank hangs and nothing
    half-written is left."""
    final = Path(final).absolute()
    if rank == 0:
        ckpt.prepare_partial(final)
    dist_utils.barrier()
    error: BaseException | None = None
    try:
        write(ckpt.partial_path(final))
    except BaseException as exc:  # raised after the others learn of it
        error = exc
    if dist_utils.any_rank(error is not None):
        if rank == 0:
            ckpt.discard_partial(final)
        dist_utils.barrier()
        if error is not None:
            raise error
        raise RuntimeError(f"saving checkpoint {final} failed on another rank; nothing was written")
    if rank == 0:
        ckpt.commit_partial(final)
    dist_utils.barrier()


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(final: Path, *, engine: str, format_version: int) -> dict[str, Any]:
    """``final/meta.json``, checked to be a complete checkpoint of ``engine`` in ``format_version``."""
    meta_file = Path(final) / "meta.json"
    if not meta_file.is_file():
        raise ckpt.CheckpointFormatError(f"{final} is not a complete {engine} checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != format_version or meta.get("engine") != engine:
        raise ckpt.CheckpointFormatError(
            f"{final}: unsupported checkpoint (format {meta.get('format')}, engine {meta.get('engine')}); "
            f"expected format {format_version} of {engine}"
        )
    return meta


def save_rng(directory: Path, rank: int) -> None:
    ckpt.save_tree(directory / "rng", f"rank{rank}", ckpt.capture_rng())


def restore_rng(final: Path, rank: int, saved_world_size: int) -> None:
    """Restore this rank's RNG states; warn when the saving run had no such rank."""
    rng_dir = Path(final) / "rng"
    if (rng_dir / f"rank{rank}.json").is_file():
        ckpt.restore_rng(ckpt.load_tree(rng_dir, f"rank{rank}"))
    else:
        warnings.warn(f"{final} was saved by {saved_world_size} ranks: no RNG state for rank {rank}", stacklevel=3)
