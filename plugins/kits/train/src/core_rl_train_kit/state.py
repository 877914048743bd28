"""Training-state directories written by all ranks together, in formats that execute nothing on load
(:mod:`core_rl.checkpoint.files`): the collective atomic-write protocol, ``meta.json``, and per-rank
RNG states.

Layout every engine shares (engines add their own files)::

    meta.json                       format, engine, step, world size, whether optimizer state exists
                                    (``optimizer``) and what became of it (``optimizer_state``)
    model.safetensors               full (unsharded) weights, a tied weight once (its other names in
                                    the file's metadata: :func:`save_model_weights`)
    optimizer.{json,safetensors}    full optimizer state, keyed by parameter name
    extra.{json,safetensors}        the trainer's ``extra`` (e.g. the data position)
    rng/rank{r}.{json,safetensors}  each rank's RNG states
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from core_rl.checkpoint import files as ckpt
from core_rl.launch import distributed as dist_utils


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


#: ``meta.json``'s ``optimizer_state``: the checkpoint holds the optimizer state
OPTIMIZER_SAVED = "saved"
#: none existed when it was saved (before the first optimizer step, or right after
#: :meth:`~core_rl.interfaces.TrainEngine.reset_optimizer`): a resume starts the optimizer afresh,
#: as the saving run would have gone on
OPTIMIZER_NONE_YET = "none_yet"
#: it existed, and ``save_state(..., optimizer=False)`` (``saver.save_optimizer: false``) left it out
OPTIMIZER_LEFT_OUT = "left_out"
OPTIMIZER_RECORDS = (OPTIMIZER_SAVED, OPTIMIZER_NONE_YET, OPTIMIZER_LEFT_OUT)


def optimizer_record(has_state: bool, save: bool) -> str:
    """``meta.json``'s ``optimizer_state`` for an engine whose optimizer holds state (``has_state``),
    saved with ``save_state(..., optimizer=save)``: the engine writes the state only when this is
    :data:`OPTIMIZER_SAVED`."""
    if not has_state:
        return OPTIMIZER_NONE_YET
    return OPTIMIZER_SAVED if save else OPTIMIZER_LEFT_OUT


def restores_optimizer(meta: dict[str, Any], final: Path, load: bool) -> bool:
    """Whether ``load_state(final, optimizer=load)`` restores the optimizer state of the checkpoint
    whose ``meta.json`` is ``meta``: when ``load`` and it holds some. Asking for the state of a
    checkpoint that left it out raises :class:`~core_rl.checkpoint.files.OptimizerStateLeftOut` (a fresh
    optimizer is then the caller's explicit choice, never a silent one); one saved before any
    state existed resumes with a fresh optimizer either way. Checkpoints older than
    ``optimizer_state`` count as :data:`OPTIMIZER_SAVED` when they hold optimizer state, else as
    :data:`OPTIMIZER_NONE_YET`."""
    record = meta.get("optimizer_state", OPTIMIZER_SAVED if meta.get("optimizer") else OPTIMIZER_NONE_YET)
    if record not in OPTIMIZER_RECORDS:
        raise ckpt.CheckpointFormatError(
            f"{final}/meta.json: optimizer_state {record!r} is none of {OPTIMIZER_RECORDS}"
        )
    if record == OPTIMIZER_LEFT_OUT and load:
        raise ckpt.OptimizerStateLeftOut(
            f"{final} was saved without its optimizer state (saver.save_optimizer: false); set "
            "recover.load_optimizer: false to resume from it with a fresh optimizer (weights, step, data position, "
            "schedule and RNG still resume), or resume from a checkpoint saved with its optimizer state"
        )
    return load and record == OPTIMIZER_SAVED


#: the metadata key of ``model.safetensors`` that lists its tied names: JSON ``{alias: name}``
TIED_METADATA_KEY = "core_rl.tied"


def shared_names(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: first name}`` for every entry of ``state`` that is the same tensor data as an earlier
    entry (same storage, offset, shape, strides and dtype: tied weights, as a full state dict of a
    model with an output head tied to its embedding holds them)."""
    first: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        if tensor.device.type == "meta":
            continue
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def save_model_weights(file: Path, state: Mapping[str, torch.Tensor], *, tied: Mapping[str, str] | None = None) -> None:
    """Write the weights ``state`` to the safetensors ``file``. A tied weight is written once, under
    its first name; its other names go to the file's metadata (:data:`TIED_METADATA_KEY`), and
    :func:`load_model_weights` gives them back. Tied names are those of ``tied`` (``{alias: name}``,
    :func:`core_rl.sync.buckets.tied_sources` of the model, for engines whose state dicts
    hold a copy per name) and every entry that shares its data with an earlier one
    (:func:`shared_names`); safetensors refuses to write shared tensors. Other entries that
    overlap in memory are written as copies of their own."""
    from safetensors.torch import save_file

    aliases = {**shared_names(state), **{a: n for a, n in (tied or {}).items() if a in state and n in state}}
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        if name in aliases:
            continue
        ptr = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else None
        # a view sharing storage with another entry without being the same tensor: its own copy
        tensors[name] = tensor.clone() if ptr in seen and ptr else tensor.contiguous()
        if ptr:
            seen.add(ptr)
    save_file(tensors, str(file), metadata={TIED_METADATA_KEY: json.dumps(aliases, sort_keys=True)})


def load_model_weights(file: Path) -> dict[str, torch.Tensor]:
    """What :func:`save_model_weights` wrote: every name, a tied name as the same tensor as its twin."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(file), framework="pt") as handle:
        metadata = handle.metadata() or {}
    state = load_file(str(file))
    aliases = json.loads(metadata.get(TIED_METADATA_KEY, "{}"))
    missing = sorted({name for name in aliases.values() if name not in state})
    if missing:
        raise ckpt.CheckpointFormatError(f"{file}: tied names point at absent weights {missing[:5]}")
    for alias, name in aliases.items():
        state[alias] = state[name]
    return state


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
