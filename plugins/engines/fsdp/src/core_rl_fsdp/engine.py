"""The ``fsdp`` train engine: a Hugging Face causal LM sharded with FSDP2 over all ranks.

Every rank calls every method with its own rows of the global batch (collectives inside).
Gradients: FSDP averages them over ranks, and ``loss_weight`` is normalised over the global batch,
so each micro-batch back-propagates ``world_size * sum(per_token_loss * loss_weight)``; the update is
then the gradient of ``sum over the global batch of per_token_loss * loss_weight``, whatever the
split into micro-batches or ranks.
"""

from __future__ import annotations

import gc
import json
import math
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from core_rl.checkpoint import files as ckpt
from core_rl.config.schema import ActorConfig
from core_rl.interfaces import TrainEngine
from core_rl.protocol import TensorBatch
from core_rl.roles import lora
from core_rl.roles.hf import architecture_name, exported_architecture, torch_dtype
from core_rl.sync.buckets import hf_buckets, state_items, tied_aliases, tied_sources
from core_rl_train_kit import ulysses
from core_rl_train_kit.export import export_adapter_dir, export_model_dir
from core_rl_train_kit.moe_routing import MoERouting
from core_rl_train_kit.muon import embeddings_and_head
from core_rl_train_kit.optim import build_optimizer, check_schedule, restore_weight_decay, settle_scalar_states
from core_rl_train_kit.runner import EngineState, MicroBatchRunner, check_temperature, pad_token_id_of
from core_rl_train_kit.state import (
    OPTIMIZER_SAVED,
    load_model_weights,
    optimizer_record,
    restores_optimizer,
    save_model_weights,
    write_collectively,
    write_meta,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from core_rl_fsdp import attention
from core_rl_fsdp import distributed as dist_utils
from core_rl_fsdp.config import FSDPConfig
from core_rl_fsdp.model import FSDPModule, build_model, compile_model

CHECKPOINT_FORMAT = 2  # 2: full state in safetensors + JSON (1 was a pickled DCP)


class FSDPEngine(EngineState, TrainEngine):
    """See the module docstring. ``trainable=False`` builds a frozen reference model (eval mode,
    no gradients, no optimizer; :meth:`train_step`, :meth:`save_state` and :meth:`load_state`
    raise). ``head="value"`` builds a value model (a critic: the backbone plus a scalar head per
    token, :func:`core_rl.roles.hf.load_value_model`), trained by :meth:`train_value_step`;
    ``head="score"`` the same without a bias in the head (a reward model), exported as
    ``*ForSequenceClassification``."""

    engine_label = "FSDP"

    def __init__(
        self, actor: ActorConfig, config: FSDPConfig | None = None, *, trainable: bool = True, head: str = "lm"
    ) -> None:
        self.head = self._check_head_name(head)
        self.actor = actor
        self.config = config if config is not None else FSDPConfig()
        self.trainable = trainable
        if trainable:
            check_schedule(actor.lr_scheduler)
        self.device = dist_utils.pick_device(self.config.device)
        self.rank, self.world_size = dist_utils.ensure_process_group(self.config.backend, self.device)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        attn = attention.resolve(self.config, self.device, self.config.compute_dtype(actor))
        self.sequence = ulysses.engine_group(self.config.sequence_parallel_size, self.world_size, engine="fsdp")
        self.model = build_model(
            actor,
            self.config,
            trainable=trainable,
            mesh=self.mesh,
            device=self.device,
            rank=self.rank,
            world_size=self.world_size,
            attn_implementation=ulysses.register(attn or "sdpa") if self.sequence is not None else attn,
            head=head,
        )
        if self.config.compile:
            compile_model(self.model, self.config, self.world_size)
        hf_model = lora.base_model(self.model)
        if self.sequence is not None:
            ulysses.check_heads(hf_model.config, self.sequence.size, engine="fsdp")
        self._architectures = [exported_architecture(architecture_name(hf_model), head)]
        self._pad_id = pad_token_id_of(hf_model)
        self.runner = MicroBatchRunner(
            self.model,
            actor.micro_batch,
            self.device,
            pad_token_id=self._pad_id,
            attn_implementation=attn,
            head=head,
            autocast_dtype=torch_dtype(self.config.autocast_dtype) if self.config.autocast_dtype else None,
            fused_head=actor.fused_head,
            sequence=self.sequence,
            moe=MoERouting.build(hf_model, actor.moe, records=trainable) if head == "lm" else None,
        )
        self.optimizer = self._build_optimizer() if trainable else None
        self._step = 0
        self._closed = False

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """``actor.optimizer`` over the model's parameters (Muon leaves embeddings and head to AdamW)."""
        return build_optimizer(
            self.model.parameters(), self.actor.optimizer, adamw_only=embeddings_and_head(self.model)
        )

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(self, batch: TensorBatch, *, temperature: float = 1.0) -> torch.Tensor:
        """Log-probs [B, T] float32 on CPU (see :func:`core_rl_train_kit.logprobs.token_logprobs`),
        computed in eval mode without gradients, micro-batched like :meth:`train_step`."""
        self._check_head(("lm",), "compute_logprobs")
        check_temperature(temperature)
        return self.runner.logprobs(batch, temperature)

    # ------------------------------------------------------------------ training

    def _train_mode(self) -> None:
        self.model.train()

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _apply_update(self, loss: float) -> float:
        assert self.optimizer is not None
        grad_norm = self._clip_gradients()
        if math.isfinite(grad_norm) and math.isfinite(loss):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _clip_gradients(self) -> float:
        """Total gradient norm over all ranks before clipping; clip to ``actor.grad_clip`` (0: no
        clipping)."""
        max_norm = self.actor.grad_clip if self.actor.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # ------------------------------------------------------------------ weights

    def _wrapped_state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict of the model as wrapped (peft names with LoRA) on rank 0, ``{}`` elsewhere."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        return state if self.rank == 0 else {}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights with Hugging Face names on rank 0 (``{}`` elsewhere); with LoRA the
        adapters are merged into the base weights (:func:`core_rl.roles.lora.merged_state_dict`)."""
        self._check_open()
        if isinstance(self.model, FSDPModule):
            state = self._wrapped_state_dict()
        else:  # one rank, plain module (model.needs_fsdp): a copy of its tensors (a snapshot, also on the CPU)
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        return lora.hf_state_dict(self.model, state)

    def hf_weight_buckets(self, bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """:meth:`full_state_dict`'s weights in buckets of about ``bucket_bytes`` (default
        ``weight_bucket_mb``), on this engine's device (the CPU with ``cpu_offload``), never through
        host memory otherwise: on one rank the parameters themselves (no copy at all); on several,
        each parameter gathered (``DTensor.full_tensor``) on every rank and kept on rank 0 until its
        bucket has been read; a tied weight once (:func:`core_rl.sync.buckets.hf_buckets`; with LoRA each
        adapted weight merged as soon as its adapter is drawn). Collective: every rank iterates to the end."""
        self._check_open()
        size = bucket_bytes or int(self.config.weight_bucket_mb * 2**20)
        tied = tied_aliases(self.model)  # a tied weight goes once
        for module in self.model.modules():  # what state_dict()'s hooks would do: the sharded parameters
            if isinstance(module, FSDPModule):
                module.reshard()
        named = ((k, _full_tensor(v)) for k, v in state_items(self.model) if k not in tied)
        yield from hf_buckets(self.model, named, size, main=self.rank == 0)

    def export_hf(self, path: str | Path) -> None:
        """Rank 0 writes ``path`` (config, safetensors weights, generation config, tokenizer) via
        a temporary directory next to it, then moves it into place (see :mod:`core_rl.checkpoint.files`).
        With LoRA the weights are merged, and the adapter alone goes to ``path/adapter`` (peft's
        ``save_pretrained`` format)."""
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
        state = {
            k: _full_tensor(v).to("cpu", copy=True)
            for k, v in self.model.state_dict().items()
            if lora.is_adapter_key(k)
        }
        export_adapter_dir(Path(path).absolute(), self.model, state if self.rank == 0 else {}, rank=self.rank)

    # ------------------------------------------------------------------ training state

    def save_state(self, path: str | Path, extra: Mapping[str, Any], *, optimizer: bool = True) -> None:
        """Write ``path/`` atomically (as ``.NAME.partial``, renamed by rank 0 once every rank has
        finished), in formats that execute nothing on load (:mod:`core_rl.checkpoint.files`):

        - ``meta.json``: format, step, world size, whether optimizer state is saved (``optimizer``)
          and what became of it (``optimizer_state``, :mod:`core_rl_train_kit.state`);
        - ``model.safetensors``: the full (unsharded) weights, gathered on rank 0, a tied weight once
          (:func:`core_rl_train_kit.state.save_model_weights`);
        - ``optimizer.{json,safetensors}``: the full optimizer state (keyed by parameter name),
          unless ``optimizer`` is false or there is none yet;
        - ``extra.{json,safetensors}``: ``extra`` (e.g. the data position), from rank 0;
        - ``rng/rank{r}.{json,safetensors}``: each rank's RNG states.

        Full (not sharded) state makes the checkpoint loadable on any number of ranks. A failure on
        any rank (e.g. a full disk) removes the partial directory on rank 0 and raises on every rank.
        """
        self._check_trainable("save_state")
        assert self.optimizer is not None
        # An optimizer that has not stepped has no state; asking for it would create some (torch
        # initialises it with a zero-lr step), which would change the run. Save none instead.
        record = optimizer_record(_optimizer_has_state(self.optimizer), optimizer)
        has_optim = record == OPTIMIZER_SAVED
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)

        def write(tmp: Path) -> None:
            model_state = get_model_state_dict(self.model, options=full)
            optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=full) if has_optim else None
            ckpt.save_tree(tmp / "rng", f"rank{self.rank}", ckpt.capture_rng())
            if self.rank == 0:
                save_model_weights(tmp / "model.safetensors", model_state, tied=tied_sources(self.model))
                if optim_state is not None:
                    ckpt.save_tree(tmp, "optimizer", optim_state)
                ckpt.save_tree(tmp, "extra", dict(extra))
                meta = {
                    "format": CHECKPOINT_FORMAT,
                    "engine": "fsdp",
                    "head": self.head,
                    "step": self._step,
                    "world_size": self.world_size,
                    "optimizer": has_optim,
                    "optimizer_state": record,
                }
                write_meta(tmp, meta)

        write_collectively(Path(path), self.rank, write)

    def check_checkpoint(self, path: str | Path) -> None:
        """Raise :class:`~core_rl.checkpoint.files.CheckpointFormatError` unless ``path`` holds a
        complete checkpoint of this format: ``meta.json`` with this format and a step, the weights'
        and optimizer's safetensors headers, ``extra`` and rank 0's RNG state readable. Reads
        headers and JSON only."""
        from safetensors import SafetensorError, safe_open

        final = Path(path)
        meta = self._read_own_meta(final)
        files = ["model.safetensors", "extra.json", "rng/rank0.json"]
        if meta.get("optimizer"):
            files += ["optimizer.json", "optimizer.safetensors"]
        for name in files:
            file = final / name
            if not file.is_file():
                raise ckpt.CheckpointFormatError(f"{file}: missing")
            try:
                if file.suffix == ".json":
                    json.loads(file.read_text(encoding="utf-8"))
                else:
                    with safe_open(str(file), framework="pt") as f:
                        f.keys()
            except (SafetensorError, OSError, ValueError) as exc:
                raise ckpt.CheckpointFormatError(f"{file}: cannot be read ({exc})") from None

    def load_state(self, path: str | Path, *, optimizer: bool = True) -> dict[str, Any]:
        """Restore model, optimizer (unless ``optimizer`` is false: a fresh one), step and this
        rank's RNG states from :meth:`save_state`'s directory and return its ``extra``. Rank 0 reads
        the weights and optimizer state and broadcasts them; the world size may differ from the
        saving run's (RNG states are then restored only for ranks that existed). Nothing is
        unpickled. A checkpoint saved without its optimizer state is refused unless ``optimizer``
        is false (:func:`core_rl_train_kit.state.restores_optimizer`)."""
        self._check_trainable("load_state")
        final = Path(path).absolute()
        meta = self._read_own_meta(final)
        restore_optim = restores_optimizer(meta, final, optimizer)
        self.reset_optimizer()
        model_state: dict[str, torch.Tensor] = {}
        optim_state: dict[str, Any] = {}
        if self.rank == 0:
            model_state = load_model_weights(final / "model.safetensors")
            if restore_optim:
                optim_state = ckpt.load_tree(final, "optimizer")
        broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, model_state, options=broadcast)
        if restore_optim:
            # the kernel (fused/foreach) is this run's choice, not the saving run's (its parameters
            # may have been plain tensors where these are DTensors)
            # (per group: Muon's groups have no such flags)
            kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in self.optimizer.param_groups]
            set_optimizer_state_dict(self.model, self.optimizer, optim_state, options=broadcast)
            for group, kernel in zip(self.optimizer.param_groups, kernels, strict=True):
                for key, value in group.items():  # the broadcast turns tuples (betas) into lists
                    if key != "params" and isinstance(value, list):
                        group[key] = tuple(value)
                group.update(kernel)
            restore_weight_decay(self.optimizer, self.actor.optimizer)  # this run's choice, not the saved groups'
            settle_scalar_states(self.optimizer)  # ``step`` where this run's kernel reads it
        self._step = int(meta["step"])
        rng_dir = final / "rng"
        if (rng_dir / f"rank{self.rank}.json").is_file():
            ckpt.restore_rng(ckpt.load_tree(rng_dir, f"rank{self.rank}"))
        else:
            warnings.warn(
                f"{final} was saved by {meta['world_size']} ranks: no RNG state for rank {self.rank}", stacklevel=2
            )
        extra = ckpt.load_tree(final, "extra")
        dist_utils.barrier()
        return extra

    def reset_optimizer(self) -> None:
        """A fresh optimizer over the same parameters (no state: the next step starts it afresh);
        weights and :attr:`step` stay."""
        self._check_trainable("reset_optimizer")
        self.optimizer = self._build_optimizer()

    def _read_own_meta(self, final: Path) -> dict[str, Any]:
        """:func:`_read_meta`, refusing a checkpoint of the other head (a critic's for a policy)."""
        meta = _read_meta(final)
        if meta.get("head", "lm") != self.head:
            raise ckpt.CheckpointFormatError(
                f"{final}: holds a model with head={meta.get('head', 'lm')!r}, this engine has head={self.head!r}"
            )
        return meta

    def close(self) -> None:
        """Drop the model and optimizer (the process group stays for other engines)."""
        if self._closed:
            return
        self._closed = True
        del self.model, self.runner
        self.optimizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _read_meta(final: Path) -> dict[str, Any]:
    """``final/meta.json`` of a checkpoint in this engine's format; raises
    :class:`~core_rl.checkpoint.files.CheckpointFormatError` otherwise."""
    meta_file = final / "meta.json"
    if not meta_file.is_file():
        raise ckpt.CheckpointFormatError(f"{final} is not a complete fsdp checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ckpt.CheckpointFormatError(f"{meta_file}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT or meta.get("engine") != "fsdp":
        got = (meta.get("format"), meta.get("engine")) if isinstance(meta, dict) else (None, None)
        raise ckpt.CheckpointFormatError(f"{final}: unsupported checkpoint (format {got[0]}, engine {got[1]})")
    if not isinstance(meta.get("step"), int):
        raise ckpt.CheckpointFormatError(f"{meta_file}: no step")
    return meta


def _full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole of one state-dict entry where it lives: a sharded parameter's local shard when one
    rank holds it all (no copy), else gathered from every rank (a collective); a plain tensor as is."""
    if isinstance(value, DTensor):
        with torch.no_grad():
            return value.to_local() if value.device_mesh.size() == 1 else value.full_tensor()
    return value.detach()


def _optimizer_has_state(optimizer: torch.optim.Optimizer) -> bool:
    return any(len(s) > 0 for s in optimizer.state.values())
