"""Training state of the ``megatron`` engine on disk, in formats that execute nothing on load
(:mod:`core_rl.checkpoint.files`: safetensors and JSON), written atomically.

Layout of a checkpoint directory:

- ``meta.json``: format, head (``lm``, ``value`` or ``score``), step, world size, parallel layout,
  which optimizer state it holds (``optimizer``) and what became of it (``optimizer_state``:
  saved, none yet, or left out by ``save_state(..., optimizer=False)``; :mod:`core_rl_train_kit.state`);
- ``model/``: the weights with Hugging Face names (safetensors, sharded in buckets, with an index
  when there are several files), gathered from every tensor- and pipeline-parallel shard;
- with the CPU optimizer (a torch optimizer over DDP's gradient buffers): ``optimizer/<key>/``
  each per-parameter state tensor (e.g. ``exp_avg``) converted to Hugging Face names the same way,
  plus ``optimizer.json`` (the scalar state, e.g. Adam's step). Model and optimizer state are
  independent of the parallel layout, so a checkpoint resumes on any tensor-parallel size;
- with Megatron's optimizer (GPU): ``optimizer/tp{t}_pp{p}.{json,safetensors}`` (its
  ``state_dict()`` from each model-parallel rank of the first replica) and, with the distributed
  optimizer, ``optimizer/params_tp{t}_pp{p}`` (its parameter state gathered on data-parallel
  rank 0); such a checkpoint resumes on the same layout only;
- ``extra.{json,safetensors}`` from rank 0, ``rng/rank{r}.{json,safetensors}`` per rank (torch,
  CUDA, Python, NumPy and Megatron's tensor-parallel RNG tracker).

A failure on any rank (e.g. a full disk) removes the partial directory and raises on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from core_rl.checkpoint import files as ckpt
from core_rl.launch import distributed as dist_utils
from core_rl_train_kit.optim import settle_scalar_states
from core_rl_train_kit.state import (
    OPTIMIZER_SAVED,
    optimizer_record,
    restores_optimizer,
    write_collectively,
    write_meta,
)
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel

from core_rl_megatron import convert
from core_rl_megatron.export import write_safetensors_shards
from core_rl_megatron.hf_io import HFWeights
from core_rl_megatron.optim import set_group_weight_decay

if TYPE_CHECKING:
    from core_rl_megatron.engine import MegatronEngine

FORMAT = 1
ENGINE = "megatron"


def _layout(engine: MegatronEngine) -> dict[str, int]:
    cfg = engine.config
    return {
        "tensor_model_parallel_size": cfg.tensor_model_parallel_size,
        "pipeline_model_parallel_size": cfg.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": cfg.virtual_pipeline_size,
        "context_parallel_size": cfg.context_parallel_size,
    }


def _write_collectively(rank: int, directory: Path, buckets: Iterator[dict[str, torch.Tensor]]) -> BaseException | None:
    """Rank 0 writes ``buckets``; every rank iterates them to the end (they are gathered
    collectively), also after a write failure, which is returned rather than raised."""
    error: BaseException | None = None
    if rank == 0:
        try:
            write_safetensors_shards(directory, buckets)
        except BaseException as exc:
            error = exc
    for _ in buckets:
        pass
    return error


def _state_keys(engine: MegatronEngine) -> tuple[list[str], dict[str, float]]:
    """The torch optimizer's per-parameter tensor keys (shaped like the parameter) and its scalar
    state (e.g. Adam's ``step``), read from one parameter (the same on every parameter)."""
    state = next(iter(engine.optimizer.state.values()))
    tensors, scalars = [], {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            tensors.append(key)
        elif value is not None:
            scalars[key] = float(value)
    return sorted(tensors), scalars


def _optimizer_state(optimizer: torch.optim.Optimizer, key: str, param: torch.nn.Parameter) -> torch.Tensor:
    return optimizer.state[param][key]


def _has_state(optimizer: Any) -> bool:
    """Whether ``optimizer`` holds state to save: a torch optimizer (the CPU path), or Megatron's,
    whose torch optimizers have state once an update has run (before one, the distributed
    optimizer cannot save: its ``state_dict`` reads AdamW's step; a resume then builds a fresh
    optimizer from the loaded weights, which is what it would hold)."""
    inner = getattr(optimizer, "state", None)
    if isinstance(inner, Mapping):
        return any(len(s) > 0 for s in inner.values())
    return any(len(part.optimizer.state) > 0 for part in _chained(optimizer))


def save(engine: MegatronEngine, final: Path, extra: Mapping[str, Any], *, optimizer: bool = True) -> None:
    rank = engine.rank
    record = optimizer_record(_has_state(engine.optimizer), optimizer)
    has_optim = record == OPTIMIZER_SAVED
    bucket = int(engine.config.export_bucket_mb * 2**20)

    def write(tmp: Path) -> None:
        # a failed shard write is held until every collective gather has run, so no rank hangs
        error = _write_collectively(rank, tmp / "model", engine.gatherer.hf_buckets(bucket))
        scalars: dict[str, float] = {}
        if has_optim and engine.use_megatron_schedule:
            _save_megatron_optimizer(engine, tmp / "optimizer")
        elif has_optim:
            keys, scalars = _state_keys(engine)
            for key in keys:
                getter = functools.partial(_optimizer_state, engine.optimizer, key)
                failed = _write_collectively(rank, tmp / "optimizer" / key, engine.gatherer.hf_buckets(bucket, getter))
                error = error or failed
        if error is not None:
            raise error
        ckpt.save_tree(tmp / "rng", f"rank{rank}", _capture_rng())
        if rank == 0:
            ckpt.save_tree(tmp, "extra", dict(extra))
            meta = {
                "format": FORMAT,
                "engine": ENGINE,
                "head": engine.head,
                "step": engine.step,
                "world_size": engine.world_size,
                "layout": _layout(engine),
                "optimizer": ("megatron" if engine.use_megatron_schedule else "torch") if has_optim else None,
                "optimizer_state": record,
                "optimizer_scalars": scalars,
            }
            write_meta(tmp, meta)

    write_collectively(final, rank, write)


def load(engine: MegatronEngine, final: Path, *, optimizer: bool = True) -> dict[str, Any]:
    meta_file = final / "meta.json"
    if not meta_file.is_file():
        raise ckpt.CheckpointFormatError(f"{final} is not a complete megatron checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT or meta.get("engine") != ENGINE:
        raise ckpt.CheckpointFormatError(
            f"{final}: unsupported checkpoint (format {meta.get('format')}, engine {meta.get('engine')})"
        )
    if meta.get("head", "lm") != engine.head:
        raise ckpt.CheckpointFormatError(
            f"{final}: holds a model with head={meta.get('head', 'lm')!r}, this engine has head={engine.head!r}"
        )
    kind = meta.get("optimizer") if restores_optimizer(meta, final, optimizer) else None
    if kind == "megatron" and meta["layout"] != _layout(engine):
        raise ckpt.CheckpointFormatError(
            f"{final} holds Megatron optimizer state for the layout {meta['layout']}; this engine has "
            f"{_layout(engine)}. Resume with the same parallel sizes."
        )
    if (kind == "torch" and engine.use_megatron_schedule) or (kind == "megatron" and not engine.use_megatron_schedule):
        raise ckpt.CheckpointFormatError(f"{final} holds {kind} optimizer state, which this engine does not use")
    from core_rl_megatron.model import load_hf_weights

    with HFWeights(final / "model") as weights:
        load_hf_weights(engine.params, weights, engine.spec, engine.padded_vocab, engine.config.transformer_impl)
    if engine.use_megatron_schedule and kind == "megatron":
        # Megatron's optimizer is kept (it is tied to DDP's buffers); its fp32 copies of the
        # weights are refreshed, then overwritten by the saved ones
        engine.optimizer.reload_model_params()
        _load_megatron_optimizer(engine, final / "optimizer")
    else:  # a fresh optimizer, then the saved per-parameter state
        engine.optimizer = engine._build_optimizer()
        if kind == "torch":
            _load_torch_optimizer(engine, final / "optimizer", meta["optimizer_scalars"])
    engine._step = int(meta["step"])
    rng_dir = final / "rng"
    if (rng_dir / f"rank{engine.rank}.json").is_file():
        _restore_rng(ckpt.load_tree(rng_dir, f"rank{engine.rank}"))
    else:
        warnings.warn(
            f"{final} was saved by {meta['world_size']} ranks: no RNG state for rank {engine.rank}", stacklevel=3
        )
    extra = ckpt.load_tree(final, "extra")
    dist_utils.barrier()
    return extra


def reset_optimizer(engine: MegatronEngine) -> None:
    """Drop the optimizer state: the CPU optimizer is built again over the same parameters;
    Megatron's (tied to DDP's buffers) keeps its float32 master weights and hyper-parameters, and
    each of its torch optimizers forgets its state, with the step count that Apex's and
    Transformer Engine's FusedAdam keep in their parameter groups."""
    if not engine.use_megatron_schedule:
        engine.optimizer = engine._build_optimizer()
        return
    for part in _chained(engine.optimizer):
        part.optimizer.state.clear()
        for group in part.optimizer.param_groups:
            group.pop("step", None)


def _load_torch_optimizer(engine: MegatronEngine, directory: Path, scalars: Mapping[str, float]) -> None:
    """Each local parameter's optimizer state: its shard of every per-parameter tensor (stored with
    Hugging Face names) plus the scalars."""
    keys = sorted(p.name for p in directory.iterdir() if p.is_dir())
    maps = {pm.megatron: pm for pm in convert.param_maps(engine.spec, engine.config.transformer_impl)}
    with contextlib.ExitStack() as stack:
        readers = {key: stack.enter_context(HFWeights(directory / key)) for key in keys}
        for name, param in engine.params.items():
            pm = maps[name]
            state: dict[str, torch.Tensor] = {}
            for key, reader in readers.items():
                full = convert.to_megatron(pm, [reader.get(n) for n in pm.hf], engine.spec, engine.padded_vocab)
                part = convert.shard(full, pm.split, engine.tp_rank, engine.tp_size)
                # a shard is a view of the full tensor: give each state tensor its own contiguous
                # storage, which the fused AdamW kernel updates in place
                dtype = param.dtype if part.is_floating_point() else part.dtype
                state[key] = part.to(device=param.device, dtype=dtype).contiguous()
            for key, value in scalars.items():
                state[key] = torch.tensor(value, dtype=torch.float32)
            engine.optimizer.state[param] = state


# --------------------------------------------------------------------------- Megatron's optimizer (GPU)


def _replica_tag() -> str:
    return f"tp{mpu.get_tensor_model_parallel_rank()}_pp{mpu.get_pipeline_model_parallel_rank()}"


def _first_replica() -> bool:
    return mpu.get_data_parallel_rank(with_context_parallel=True) == 0


def _save_megatron_optimizer(engine: MegatronEngine, directory: Path) -> None:
    optimizer = engine.optimizer
    if _first_replica():
        ckpt.save_tree(directory, _replica_tag(), optimizer.state_dict())
    if engine.config.ddp.use_distributed_optimizer:
        param_state = _distributed_parts(optimizer, "get_parameter_state_dp_zero")
        if _first_replica():
            ckpt.save_tree(directory, f"params_{_replica_tag()}", param_state)


def _load_megatron_optimizer(engine: MegatronEngine, directory: Path) -> None:
    optimizer = engine.optimizer
    optimizer.load_state_dict(ckpt.load_tree(directory, _replica_tag()))
    if engine.config.ddp.use_distributed_optimizer:
        state = ckpt.load_tree(directory, f"params_{_replica_tag()}") if _first_replica() else None
        for inner, part in zip(
            _chained(optimizer), state if isinstance(state, list) else [state] * len(_chained(optimizer))
        ):
            with _scalar_states_set_aside(inner.optimizer):
                inner.load_parameter_state_from_dp_zero(part)
    for inner in _chained(optimizer):
        # without Apex or Transformer Engine megatron-core loads one ``step`` tensor into every
        # parameter's AdamW state: each gets its own
        settle_scalar_states(inner.optimizer)
    set_group_weight_decay(optimizer, engine.actor.optimizer)


@contextlib.contextmanager
def _scalar_states_set_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """megatron-core's gathered parameter state holds each parameter and Adam's two moments, yet its
    loader copies every key of the torch optimizer's per-parameter state into place, ``step`` too
    (torch's AdamW keeps it per parameter; without Apex or Transformer Engine that is the optimizer):
    the scalars are set aside while it loads, and put back (``load_state_dict`` restored them)."""
    aside = {
        param: {k: state.pop(k) for k in list(state) if torch.is_tensor(state[k]) and state[k].dim() == 0}
        for param, state in optimizer.state.items()
    }
    try:
        yield
    finally:
        for param, scalars in aside.items():
            optimizer.state[param].update(scalars)


def _chained(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _distributed_parts(optimizer: Any, method: str) -> list[Any]:
    return [getattr(inner, method)() for inner in _chained(optimizer)]


# --------------------------------------------------------------------------- RNG


def _capture_rng() -> dict[str, Any]:
    return {"global": ckpt.capture_rng(), "megatron": dict(tensor_parallel.get_cuda_rng_tracker().get_states())}


def _restore_rng(state: Mapping[str, Any]) -> None:
    ckpt.restore_rng(state["global"])
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["megatron"]))
