"""The ``deepspeed`` train engine: a Hugging Face causal LM trained with DeepSpeed ZeRO over all ranks.

Every rank calls every method with its own rows of the global batch (collectives inside). The
micro-batch loop, log-probs, losses and metrics are the core's
(:class:`core_rl_train_kit.runner.MicroBatchRunner`), shared with every engine, so an algorithm
gets the same numbers here as on ``fsdp``: each micro-batch back-propagates
``world_size * sum(per_token_loss * loss_weight)`` and DeepSpeed averages gradients over ranks.

DeepSpeed's own checkpoint files are pickles; this engine never writes or reads them. Its
:meth:`~DeepSpeedEngine.save_state` consolidates the ZeRO partitions into the full fp32 weights and
the full optimizer state of every parameter (DeepSpeed's ``safe_get_full_*`` accessors, which
gather the fragments of every stage) and stores them with safetensors and JSON
(:mod:`core_rl_train_kit.state`); :meth:`~DeepSpeedEngine.load_state` writes them back into the
partitions (``safe_set_full_*``), so a checkpoint resumes exactly, on any number of ranks and any
ZeRO stage.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Set
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from core_rl.checkpoint import files as ckpt
from core_rl.config.schema import ActorConfig
from core_rl.errors import CoreRLError
from core_rl.interfaces import TrainEngine
from core_rl.launch import distributed as dist_utils
from core_rl.protocol import TensorBatch
from core_rl.roles import hf, lora
from core_rl.sync.buckets import hf_buckets, tied_aliases, tied_sources
from core_rl_train_kit import state as state_files
from core_rl_train_kit import ulysses
from core_rl_train_kit.export import export_adapter_dir, export_model_dir
from core_rl_train_kit.moe_routing import MoERouting
from core_rl_train_kit.optim import build_optimizer, check_schedule, decay_groups, placed_scalar_state
from core_rl_train_kit.runner import EngineState, MicroBatchRunner, check_temperature, pad_token_id_of
from torch import nn

from core_rl_deepspeed.config import DeepSpeedConfig
from core_rl_deepspeed.ds_config import build_ds_config
from core_rl_deepspeed.loss_scale import loss_scale_state, restore_loss_scale
from core_rl_deepspeed.partitioned_load import load_partitioned

CHECKPOINT_FORMAT = 1
ENGINE_NAME = "deepspeed"


@contextlib.contextmanager
def _without_mlflow() -> Iterator[None]:
    """While DeepSpeed's modules load, ``import mlflow`` fails: its autotuner (which core-rl never
    runs) imports MLflow where installed, which takes seconds of every DeepSpeed process's start
    (and MLflow is there with the mlflow logger plugin). Afterwards ``import mlflow`` works as
    before; nothing changes where MLflow or DeepSpeed was imported already."""
    if "mlflow" in sys.modules or "deepspeed" in sys.modules:
        yield
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # import mlflow -> ImportError
    try:
        yield
    finally:
        if sys.modules.get("mlflow", ...) is None:
            del sys.modules["mlflow"]


def import_deepspeed(options: DeepSpeedConfig, device: torch.device) -> Any:
    """``deepspeed``, imported for ``device``: on CPU its accelerator is ``cpu`` (``DS_ACCELERATOR``,
    unless already set) and, unless ``options.shm_comm``, its shared-memory all-reduce extension is
    marked unavailable so nothing is compiled (gloo does the all-reduce)."""
    if device.type != "cuda":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with _without_mlflow():
        import deepspeed
    from deepspeed.accelerator import get_accelerator

    chosen = get_accelerator().device_name()  # once per process, by the first DeepSpeed engine
    if chosen != device.type:
        raise CoreRLError(
            f"deepspeed: this engine runs on {device.type}, but DeepSpeed already works on {chosen} in this process "
            "(an earlier DeepSpeed engine, or DS_ACCELERATOR, chose it; DeepSpeed takes one device type per "
            "process): give every deepspeed engine of the run the same device, or use the fsdp engine for this role"
        )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed calls collectives torch has renamed; the warnings say nothing to a core-rl user
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if device.type != "cuda" and not options.shm_comm:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


class DeepSpeedEngine(EngineState, TrainEngine):
    """See the module docstring. ``trainable=False`` builds a frozen reference model (eval mode, no
    gradients, no optimizer; ZeRO-3 still partitions its parameters). ``head="value"`` builds a value
    model (a critic: the backbone plus a scalar head per token,
    :func:`core_rl.roles.hf.load_value_model`), trained by :meth:`train_value_step`;
    ``head="score"`` the same without a bias in the head (a reward model, exported as
    ``*ForSequenceClassification``)."""

    engine_label = "DeepSpeed"

    def __init__(
        self,
        actor: ActorConfig,
        config: DeepSpeedConfig | None = None,
        *,
        trainable: bool = True,
        head: str = "lm",
    ) -> None:
        self.head = self._check_head_name(head)
        self.actor = actor
        self.config = config if config is not None else DeepSpeedConfig()
        self.trainable = trainable
        if trainable:
            check_schedule(actor.lr_scheduler)
        self.device = dist_utils.pick_device(self.config.device)
        self.rank, self.world_size = dist_utils.ensure_process_group(self.config.backend, self.device)
        if "LOCAL_RANK" not in os.environ:  # DeepSpeed reads it; torchrun sets it, one process needs none
            if self.world_size > 1:
                raise RuntimeError("LOCAL_RANK is not set; launch multi-process DeepSpeed training with torchrun")
            os.environ["LOCAL_RANK"] = "0"
        deepspeed = import_deepspeed(self.config, self.device)
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        attn = hf.resolve_attn_implementation(
            self.config.attn_implementation, self.device, self.config.compute_dtype(actor)
        )
        ds_config = build_ds_config(actor, self.config, on_cuda=self.device.type == "cuda")
        self.sequence = ulysses.engine_group(self.config.sequence_parallel_size, self.world_size, engine="deepspeed")
        load_attn = ulysses.register(attn or "sdpa") if self.sequence is not None else attn
        _, load = hf.loaders_for_head(head)
        if self.zero_stage == 3 and self.config.zero3_init:  # no rank ever holds the whole model
            model = load_partitioned(
                load,
                actor.model_path,
                ds_config,
                head=head,
                dtype=actor.dtype,
                attn_implementation=load_attn,
                trust_remote_code=actor.trust_remote_code,
            )
        else:
            model = load(
                actor.model_path,
                dtype=actor.dtype,
                attn_implementation=load_attn,
                trust_remote_code=actor.trust_remote_code,
            )
        model = hf.prepare_for_role(model, actor, trainable=trainable)
        hf_model = lora.base_model(model)
        if self.sequence is not None:
            ulysses.check_heads(hf_model.config, self.sequence.size, engine="deepspeed")
        self._architectures = [hf.exported_architecture(hf.architecture_name(hf_model), head)]
        self._pad_id = pad_token_id_of(hf_model)
        optimizer = build_optimizer(model.parameters(), actor.optimizer) if trainable else None
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.model: nn.Module = self.ds.module
        self.runner = MicroBatchRunner(
            self.ds,
            actor.micro_batch,
            self.device,
            pad_token_id=self._pad_id,
            attn_implementation=attn,
            head=head,
            fused_head=actor.fused_head,
            sequence=self.sequence,
            moe=MoERouting.build(hf_model, actor.moe, records=trainable) if head == "lm" else None,
        )
        self._step = 0
        self._closed = False

    @property
    def zero_stage(self) -> int:
        return self.config.zero_stage

    # ------------------------------------------------------------------ log-probs and training

    def compute_logprobs(self, batch: TensorBatch, *, temperature: float = 1.0) -> torch.Tensor:
        """Log-probs [B, T] float32 on CPU (see :class:`core_rl.interfaces.TrainEngine`), in eval
        mode without gradients, micro-batched like :meth:`train_step`."""
        self._check_head(("lm",), "compute_logprobs")
        check_temperature(temperature)
        return self.runner.logprobs(batch, temperature)

    def _train_mode(self) -> None:
        self.ds.train()

    def _backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss, scale_wrt_gas=False)

    def _apply_update(self, loss: float) -> float:
        """DeepSpeed clips, skips the update when its overflow check sees a non-finite gradient, and
        zeroes the gradients in ``step()``; the norm is the one it computed over all partitions."""
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    # ------------------------------------------------------------------ full weights

    def _full_param(self, param: nn.Parameter, device: str | None, *, masters: bool = False) -> torch.Tensor:
        """The full value of one parameter, on every rank (collective under ZeRO-3, and for the fp32
        master of a trainable parameter): the fp32 master weight when the optimizer holds one (cast
        to ``actor.dtype`` unless ``masters``: a checkpoint keeps them whole), else the module's own
        value; on ``device`` (:func:`_placed`)."""
        from deepspeed.utils import safe_get_full_fp32_param

        wanted = hf.torch_dtype(self.actor.dtype)
        if not masters and self.zero_stage < 3 and param.dtype == wanted:
            # ZeRO-1/2 gather each step's update into the module's full parameters, already in the
            # dtype wanted: no buffer to assemble and reduce on every rank, no cast
            return _placed(param.detach(), device)
        if self.trainable and param.requires_grad:
            full = safe_get_full_fp32_param(param)  # assembled in a buffer of its own
            if full is not None:
                full = full.detach() if masters else full.detach().to(wanted)
                return _placed(full, device)
        if hasattr(param, "ds_id"):  # a ZeRO-3 partition: gather it
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                return _placed(param.detach(), device, own=True)  # the gathered storage is freed on exit
        return _placed(param.detach(), device)

    def _wrapped_state_dict(self, *, masters: bool = False) -> dict[str, torch.Tensor]:
        """The full state dict of the module as wrapped (peft names with LoRA) on rank 0, ``{}``
        elsewhere, on the CPU (``masters``: see :meth:`_full_param`). Collective."""
        state: dict[str, torch.Tensor] = {}
        for name, value in self._wrapped_named("cpu", masters=masters):  # every rank takes part in each gather
            if self.rank == 0:
                state[name] = value
        return state

    def _wrapped_named(
        self, device: str | None, *, masters: bool = False, skip: Set[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full value)`` of the wrapped module's state dict on ``device`` (:func:`_placed`),
        but the names in ``skip``, drawn on every rank (collectives inside)."""
        for name, value in self.model.state_dict(keep_vars=True).items():
            if name in skip:
                continue
            if isinstance(value, nn.Parameter):
                yield name, self._full_param(value, device, masters=masters)
            else:
                yield name, _placed(value.detach(), device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights with Hugging Face names on rank 0 (``{}`` elsewhere); LoRA adapters merged."""
        self._check_open()
        return lora.hf_state_dict(self.model, self._wrapped_state_dict())

    def hf_weight_buckets(self, bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """:meth:`full_state_dict`'s weights in buckets of about ``bucket_bytes`` (default
        ``weight_bucket_mb``) on this engine's device, never through host memory unless the engine
        lives there: fp32 masters assembled (and cast) on the device, ZeRO-3 partitions gathered
        there, other parameters as they are (:func:`core_rl.sync.buckets.hf_buckets`).
        Collective: every rank iterates to the end."""
        self._check_open()
        size = bucket_bytes or int(self.config.weight_bucket_mb * 2**20)
        tied = tied_aliases(self.model)  # a tied weight goes once
        yield from hf_buckets(self.model, self._wrapped_named(None, skip=tied), size, main=self.rank == 0)

    def export_hf(self, path: str | Path) -> None:
        """Rank 0 writes ``path`` (config, safetensors weights, generation config, tokenizer)
        atomically; with LoRA the weights are merged and the adapter alone goes to ``path/adapter``."""
        self._check_open()
        export_model_dir(
            Path(path).absolute(),
            self.model,
            self._wrapped_state_dict(),
            rank=self.rank,
            architectures=self._architectures,
            tokenizer_path=self.actor.tokenizer_path or self.actor.model_path,
            model_path=self.actor.model_path,
            trust_remote_code=self.actor.trust_remote_code,
        )

    def export_adapter(self, path: str | Path) -> None:
        """Rank 0 writes the LoRA adapter alone to ``path`` (peft's ``save_pretrained`` format),
        atomically; only the adapter's tensors are gathered (each in turn, on every rank)."""
        self._check_open()
        others = {k for k in self.model.state_dict() if not lora.is_adapter_key(k)}
        state = dict(self._wrapped_named("cpu", skip=others))
        export_adapter_dir(Path(path).absolute(), self.model, state if self.rank == 0 else {}, rank=self.rank)

    # ------------------------------------------------------------------ training state

    def _trainable_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _base_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer DeepSpeed steps (over flat fp32 partitions under ZeRO)."""
        assert self.optimizer is not None
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _optimizer_state(self) -> dict[str, Any] | None:
        """The full optimizer state keyed by parameter name, in the layout of
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(full_state_dict=True)``:
        ``{"state": {name: {key: tensor}}, "param_groups": [{...hyper-parameters, "params": [names]}]}``;
        ``None`` before the first step (no state yet). Collective."""
        from deepspeed.utils import safe_get_full_optimizer_state

        base = self._base_optimizer()
        flat_states = [s for s in base.state.values() if s]
        if not flat_states:
            return None
        keys = sorted(flat_states[0])
        self._relink_fragments()  # groups after the first are linked before they have state (see there)
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in self._trainable_params():
            entry: dict[str, torch.Tensor] = {}
            for key in keys:
                value = flat_states[0][key]
                if torch.is_tensor(value) and value.dim() == 0:  # e.g. AdamW's step: one per group
                    entry[key] = value.detach().to("cpu").clone()
                else:
                    full = safe_get_full_optimizer_state(param, key)
                    entry[key] = full.detach().to("cpu", torch.float32).clone()
            if self.rank == 0:
                state[name] = entry
        named = self._trainable_params()
        names = {id(p): name for name, p in named}
        hyper = {k: v for k, v in base.param_groups[0].items() if k not in ("params", "weight_decay")}
        groups = [
            {**hyper, "weight_decay": g.get("weight_decay", self.actor.optimizer.weight_decay)}
            | {"params": [names[id(p)] for p in g["params"]]}
            for g in decay_groups([p for _, p in named], self.actor.optimizer)
        ]
        return {"state": state, "param_groups": groups}

    def save_state(self, path: str | Path, extra: Mapping[str, Any], *, optimizer: bool = True) -> None:
        """Write ``path/`` atomically, in formats that execute nothing on load (see
        :mod:`core_rl_train_kit.state`): ``meta.json`` (with float16's dynamic loss scale,
        :mod:`core_rl_deepspeed.loss_scale`), ``model.safetensors`` (full fp32 master
        weights, the module's names), ``optimizer.*`` (full optimizer state per parameter name;
        not with ``optimizer`` false), ``extra.*`` and ``rng/rank{r}.*``. Full state makes the
        checkpoint loadable on any number of ranks and any ZeRO stage. Collective."""
        self._check_trainable("save_state")
        model_state = self._wrapped_state_dict(masters=True)  # fp32 masters: a resume is exact
        tied = tied_sources(self.model)  # gathered once per name: written once
        record = state_files.optimizer_record(any(self._base_optimizer().state.values()), optimizer)
        optim_state = self._optimizer_state() if record == state_files.OPTIMIZER_SAVED else None
        loss_scale = loss_scale_state(self.optimizer)  # float16's dynamic scale

        def write(tmp: Path) -> None:
            state_files.save_rng(tmp, self.rank)
            if self.rank != 0:
                return
            state_files.save_model_weights(tmp / "model.safetensors", model_state, tied=tied)
            if optim_state is not None:
                ckpt.save_tree(tmp, "optimizer", optim_state)
            ckpt.save_tree(tmp, "extra", dict(extra))
            meta = {
                "format": CHECKPOINT_FORMAT,
                "engine": ENGINE_NAME,
                "step": self._step,
                "world_size": self.world_size,
                "zero_stage": self.zero_stage,
                "optimizer": optim_state is not None,
                "optimizer_state": record,
                "loss_scale": loss_scale,
            }
            state_files.write_meta(tmp, meta)

        state_files.write_collectively(Path(path), self.rank, write)

    def load_state(self, path: str | Path, *, optimizer: bool = True) -> dict[str, Any]:
        """Restore weights, optimizer state (unless ``optimizer`` is false: a fresh one), step and
        this rank's RNG states from :meth:`save_state`'s directory and return its ``extra``. Every
        rank reads the files (a shared file system, as for saving); nothing is unpickled. A
        checkpoint saved without its optimizer state is refused unless ``optimizer`` is false
        (:func:`core_rl_train_kit.state.restores_optimizer`). Collective."""
        self._check_trainable("load_state")
        final = Path(path).absolute()
        meta = state_files.read_meta(final, engine=ENGINE_NAME, format_version=CHECKPOINT_FORMAT)
        restore_optim = state_files.restores_optimizer(meta, final, optimizer)
        model_state = state_files.load_model_weights(final / "model.safetensors")
        self._load_weights(model_state)
        self.reset_optimizer()
        if restore_optim:
            self._load_optimizer_state(ckpt.load_tree(final, "optimizer"))
        self._step = int(meta["step"])
        restore_loss_scale(self.optimizer, meta.get("loss_scale"))  # absent before it was saved
        state_files.restore_rng(final, self.rank, int(meta["world_size"]))
        extra = ckpt.load_tree(final, "extra")
        dist_utils.barrier()
        return extra

    def _load_weights(self, model_state: Mapping[str, torch.Tensor]) -> None:
        """Write full weights into the module (every stage) and the optimizer's fp32 masters."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        missing = sorted(set(self.model.state_dict()) - set(model_state))
        if missing:
            raise ckpt.CheckpointFormatError(
                f"model.safetensors lacks {missing[:5]} (and {max(len(missing) - 5, 0)} more)"
            )
        for name, value in self.model.state_dict(keep_vars=True).items():
            new = model_state[name]
            with torch.no_grad():
                if isinstance(value, nn.Parameter) and hasattr(value, "ds_id"):
                    with deepspeed.zero.GatheredParameters([value], modifier_rank=0):
                        if self.rank == 0:
                            value.data.copy_(new.to(value.device, value.dtype))
                else:
                    value.data.copy_(new.to(value.device, value.dtype))
            if self.trainable and isinstance(value, nn.Parameter) and value.requires_grad:
                safe_set_full_fp32_param(value, new.to(self.device, torch.float32))

    def reset_optimizer(self) -> None:
        """Drop the optimizer state (the next step starts it afresh, as a new engine's first does);
        the fp32 master weights, float16's loss scale and :attr:`step` stay."""
        self._check_trainable("reset_optimizer")
        self._base_optimizer().state.clear()
        self._relink_fragments()

    def _relink_fragments(self) -> None:
        """ZeRO-1/2 keep per-parameter views into the optimizer state, made once after the first
        step; after the state is replaced they must be made again (now, or at the next step).
        DeepSpeed makes them right after stepping the first parameter group, before the others
        (biases and norms under ``no_decay``) have any state, so saving relinks too."""
        zero = self.optimizer
        if hasattr(zero, "_hp_optimizer_states_linked"):
            zero._hp_optimizer_states_linked = False
            if self._base_optimizer().state:
                zero._lazy_init_hp_params_optimizer_state()

    def _load_optimizer_state(self, saved: Mapping[str, Any]) -> None:
        """Recreate the base optimizer's per-partition state, then fill every parameter's fragment
        from the full saved state (``safe_set_full_optimizer_state``)."""
        from deepspeed.utils import safe_set_full_optimizer_state

        base = self._base_optimizer()
        per_param = saved["state"]
        names = [name for name, _ in self._trainable_params()]
        absent = [n for n in names if n not in per_param]
        if absent:
            raise ckpt.CheckpointFormatError(f"optimizer state lacks {absent[:5]}")
        sample = per_param[names[0]]
        # ZeRO-3 steps one flat fp32 partition per sub-group (swapped into param_groups in turn)
        flats = getattr(self.optimizer, "fp32_partitioned_groups_flat", None)
        if flats is None:
            flats = [flat for group in base.param_groups for flat in group["params"]]
        flags = base.param_groups[0]  # the implementation flags (fused, capturable) are the same in every group
        for flat in flats:
            base.state[flat] = {
                key: (
                    placed_scalar_state(value, flat, flags)
                    if value.dim() == 0
                    else torch.zeros_like(flat, dtype=torch.float32)
                )
                for key, value in sample.items()
            }
        self._relink_fragments()
        for name, param in self._trainable_params():
            for key, value in per_param[name].items():
                if value.dim() > 0:
                    safe_set_full_optimizer_state(param, value.to(self.device), key)

    def close(self) -> None:
        """Drop the model and optimizer (the process group stays for other engines)."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self.ds, "destroy"):
            self.ds.destroy()
        _forget_zero3_module(self.ds.module)
        del self.ds, self.model, self.runner
        self.optimizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _forget_zero3_module(module: nn.Module) -> None:
    """Take ``module`` off DeepSpeed's module-level ``FWD_MODULE_STACK``: ZeRO-3's set-up pushes the
    model there and ``destroy()`` leaves it, so the model would outlive its engine."""
    from deepspeed.runtime.zero import parameter_offload

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", [])
    stack[:] = [m for m in stack if m is not module]


def _placed(tensor: torch.Tensor, device: str | None, own: bool = False) -> torch.Tensor:
    """``tensor`` copied to ``device``; with ``device`` ``None`` left where it is (on the engine's
    device, or the CPU for what DeepSpeed offloads), cloned only if ``own``."""
    if device is None:
        return tensor.clone() if own else tensor
    return tensor.to(device, copy=True)
