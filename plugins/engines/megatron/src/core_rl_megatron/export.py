"""Gathering tensor- and pipeline-parallel shards into full Hugging Face tensors on the main rank,
bucket by bucket, and writing them as sharded safetensors.

Only the first replica (data- and context-parallel rank 0) takes part. For each parameter, in the
fixed order of :func:`core_rl_megatron.convert.param_maps`, the pipeline stage that holds it
all-gathers the tensor-parallel shards, its tensor-parallel rank 0 joins them and, unless it is the
main rank itself, sends the full tensor to the main rank, which converts it to Hugging Face names.
The main rank holds at most one bucket of converted tensors (plus the one being gathered), never a
second copy of the whole model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from core_rl.checkpoint import files as ckpt
from core_rl.launch import distributed as dist_utils
from core_rl.roles.hf import exported_architecture, value_model_config
from megatron.core import parallel_state as mpu
from torch import nn

from core_rl_megatron import convert
from core_rl_megatron.families import ArchSpec
from core_rl_megatron.hf_io import INDEX_FILE, SINGLE_FILE
from core_rl_megatron.parallel import full_shape

if TYPE_CHECKING:
    from core_rl_megatron.engine import MegatronEngine

TensorGetter = Callable[[nn.Parameter], torch.Tensor]


def parameter_data(param: nn.Parameter) -> torch.Tensor:
    return param.detach()


@attrs.frozen
class Owner:
    """Where a parameter lives in the first replica: its pipeline stage, the global rank of that
    stage's tensor-parallel rank 0, and its rank-local shape and dtype."""

    pp_rank: int
    rank: int
    local_shape: tuple[int, ...]
    dtype: str


class ShardGatherer:
    """Collective iteration over full parameters (see the module docstring). Build it on every
    rank at the same time (it exchanges where each parameter lives)."""

    def __init__(self, params: Mapping[str, nn.Parameter], spec: ArchSpec, impl: str, device: torch.device) -> None:
        self.params = params
        self.spec = spec
        self.device = device
        self.maps = convert.param_maps(spec, impl)
        self.rank = dist.get_rank()
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.tp_size = mpu.get_tensor_model_parallel_world_size()
        self.pp_rank = mpu.get_pipeline_model_parallel_rank()
        self.in_first_replica = mpu.get_data_parallel_rank(with_context_parallel=True) == 0
        mine = {}
        if self.in_first_replica and self.tp_rank == 0:
            mine = {
                name: Owner(self.pp_rank, self.rank, tuple(p.shape), str(p.dtype).removeprefix("torch."))
                for name, p in params.items()
            }
        everyone: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        self.owners: dict[str, Owner] = {}
        for part in everyone:
            for name, owner in part.items():  # type: ignore[union-attr]
                self.owners.setdefault(name, owner)

    def full_tensors(
        self, getter: TensorGetter = parameter_data, device: str | None = "cpu"
    ) -> Iterator[tuple[convert.ParamMap, torch.Tensor]]:
        """``(map, full Megatron tensor)`` for every exported parameter, on the main rank, moved to
        ``device`` (``None``: left where it was assembled, the engine's device); other ranks yield
        nothing but must iterate to the end (they take part in the collectives)."""
        for pm in self.maps:
            if not pm.exported:
                continue
            owner = self.owners.get(pm.megatron)
            if owner is None:
                raise RuntimeError(f"no rank of the first replica holds {pm.megatron}")
            full = None
            if self.in_first_replica and self.pp_rank == owner.pp_rank:
                full = self._join_tp(pm, getter(self.params[pm.megatron]))
            if owner.rank != 0:
                if self.rank == owner.rank:
                    dist.send(full.contiguous(), dst=0)
                elif self.rank == 0:
                    shape = full_shape(owner.local_shape, pm.split.value, self.tp_size)
                    full = torch.empty(shape, dtype=getattr(torch, owner.dtype), device=self.device)
                    dist.recv(full, src=owner.rank)
            if self.rank == 0:
                yield pm, full if device is None else full.to(device)
                del full  # not held while the next one is gathered

    def _join_tp(self, pm: convert.ParamMap, local: torch.Tensor) -> torch.Tensor | None:
        """The full tensor on tensor-parallel rank 0 of this stage (``None`` on the others)."""
        if self.tp_size == 1 or pm.split is convert.Split.REPLICATED:
            return local if self.tp_rank == 0 else None
        local = local.contiguous()
        shards = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(shards, local, group=mpu.get_tensor_model_parallel_group())
        return convert.unshard(shards, pm.split) if self.tp_rank == 0 else None

    def hf_buckets(
        self, bucket_bytes: int, getter: TensorGetter = parameter_data, device: str | None = "cpu"
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Buckets of Hugging Face tensors (name -> tensor on ``device``, see :meth:`full_tensors`)
        of about ``bucket_bytes`` each, on the main rank; every rank must iterate to the end."""
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        for pm, full in self.full_tensors(getter, device):
            for name, tensor in convert.to_hf(pm, full, self.spec).items():
                bucket[name] = tensor.contiguous()
                size += tensor.numel() * tensor.element_size()
            del full
            if size >= bucket_bytes:
                yield bucket
                bucket, size = {}, 0
        if bucket:
            yield bucket


def write_safetensors_shards(directory: Path, buckets: Iterator[dict[str, torch.Tensor]]) -> list[str]:
    """Write each bucket as one safetensors file in ``directory`` (``model.safetensors`` if there is
    only one, else ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``, the
    layout transformers reads); return the tensor names written."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, list[str]]] = []
    total = 0
    for i, bucket in enumerate(buckets):
        path = directory / f".bucket-{i:05d}.safetensors"
        save_file(bucket, str(path), metadata={"format": "pt"})
        written.append((path, list(bucket)))
        total += sum(t.numel() * t.element_size() for t in bucket.values())
    if len(written) == 1:
        written[0][0].rename(directory / SINGLE_FILE)
        return written[0][1]
    weight_map = {}
    for i, (path, names) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        path.rename(directory / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return list(weight_map)


def write_hf_model_dir(
    final: Path,
    buckets: Iterator[dict[str, torch.Tensor]],
    *,
    hf_config: object,
    dtype: torch.dtype,
    tokenizer_path: str,
    generation: bool = True,
) -> None:
    """A Hugging Face model directory at ``final`` (weights from ``buckets``, ``hf_config`` with
    ``dtype``, a generation config unless ``generation`` is false, the tokenizer of
    ``tokenizer_path``), written atomically via a partial directory (:mod:`core_rl.checkpoint.files`).
    Called on the main rank only."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    tmp = ckpt.prepare_partial(final)
    try:
        write_safetensors_shards(tmp, buckets)
        config = hf_config.__class__.from_dict(hf_config.to_dict())  # type: ignore[attr-defined]
        config.dtype = dtype
        config.save_pretrained(tmp)
        if generation:
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ckpt.commit_partial(final)


def export_config(hf_config: Any, model_path: str, head: str) -> Any:
    """The Hugging Face config an export writes: the model's own for ``lm``; for a scalar head the
    value-model config the other engines write (:func:`core_rl.roles.hf.value_model_config`:
    one label, no classifier dropout, a bias for ``value`` only) with the family's token classifier
    (``score``: sequence classifier) as its architecture."""
    if head == "lm":
        return hf_config
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    config = value_model_config(model_path, bias=head == "value")
    token_classifier = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES[config.model_type]
    config.architectures = [exported_architecture(token_classifier, head)]
    return config


def export_engine(engine: MegatronEngine, final: Path) -> None:
    """Rank 0 writes ``final`` (config, safetensors weights in buckets, generation config,
    tokenizer) via a partial directory moved into place (:mod:`core_rl.checkpoint.files`); every rank
    takes its share of the gathering. A scalar head's model is written as Hugging Face's
    ``*ForTokenClassification`` (``value``) or ``*ForSequenceClassification`` (``score``) with one
    label, without a generation config."""
    buckets = engine.hf_weight_buckets(device="cpu")  # written from host memory
    error: BaseException | None = None
    if engine.rank == 0:
        try:
            write_hf_model_dir(
                final,
                buckets,
                hf_config=engine.export_config,
                dtype=torch.bfloat16 if engine.config.bf16 else engine.dtype,
                tokenizer_path=engine.actor.tokenizer_path or engine.actor.model_path,
                generation=engine.head == "lm",
            )
        except BaseException as exc:  # finish the collectives, then raise
            error = exc
    for _ in buckets:  # the other ranks' share of the gathering (and rank 0's rest after a failure)
        pass
    if dist_utils.any_rank(error is not None) and error is None:
        raise RuntimeError(f"exporting {final} failed on rank 0")
    if error is not None:
        raise error
