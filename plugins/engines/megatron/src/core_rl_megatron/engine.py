"""The ``megatron`` train engine: a Hugging Face decoder rebuilt as a Megatron-core ``GPTModel``.

Every rank calls every method with its own rows of the global batch. The ranks of one model
replica (tensor x pipeline x context parallel) first pool their rows
(:class:`~core_rl_megatron.parallel.ReplicaRows`); each replica then runs its rows in micro-batches
and back-propagates, for each, ``sum(per_token_loss * loss_weight)``. Megatron's DDP *sums*
gradients over replicas (``calculate_per_token_loss``), so the update is the gradient of
``sum over the global batch of per_token_loss * loss_weight`` whatever the split, the same
contract as the ``fsdp`` engine.

Two ways to run a step:

- **Megatron's schedules and optimizer** (CUDA): ``get_forward_backward_func()`` (1F1B, interleaved
  with virtual pipelining, or no pipelining) and ``get_megatron_optimizer`` (fp32 master weights
  under ``bf16``, the distributed optimizer);
- **a plain loop** (CPU, where those hard-code CUDA; pipeline size 1): forward/backward per
  micro-batch under DDP's ``no_sync``, Megatron's ``finalize_model_grads``, then the core's
  ``build_optimizer`` over DDP's gradient buffers (``param.main_grad``), with gradient norm and
  clipping computed over the model-parallel group exactly as Megatron's optimizer does.

Either way the optimizer step itself (learning rate from the schedule, metrics, the non-finite
decision, the step count, and the value-model methods) is the one every train engine shares,
:class:`core_rl_train_kit.runner.EngineState`; this engine supplies its micro-batch loop
(:class:`_ReplicaRunner`), back-propagation and update.

``head="value"`` (a critic) or ``"score"`` (a reward model) builds the same model with a scalar head
in place of the output layer (:mod:`core_rl_megatron.heads`): :meth:`compute_values` and
:meth:`train_value_step` then give and train per-token values, and the export is Hugging Face's
``*ForTokenClassification`` (``value``) or ``*ForSequenceClassification`` (``score``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from core_rl.config.schema import ActorConfig
from core_rl.data import row_lengths
from core_rl.interfaces import LossFn, TrainEngine
from core_rl.launch import distributed as dist_utils
from core_rl.loops import StepMetrics, tokens_per_mb
from core_rl.protocol import TensorBatch
from core_rl.roles.hf import torch_dtype
from core_rl_train_kit.logprobs import align_to_tokens
from core_rl_train_kit.microbatch import micro_batch_width, pack_micro_batches, take_micro_batch
from core_rl_train_kit.optim import build_optimizer, check_schedule
from core_rl_train_kit.runner import TRAIN_KEYS, EngineState, check_temperature
from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads

from core_rl_megatron import checkpoint, optim, parallel
from core_rl_megatron import model as mcore_model
from core_rl_megatron.batches import MicroBatch, ModelInputs, gather_columns, model_inputs, width_multiple
from core_rl_megatron.config import MegatronConfig
from core_rl_megatron.device import NEEDS_CUDA, check_cpu_settings, megatron_can_run
from core_rl_megatron.errors import MegatronSetupError
from core_rl_megatron.export import ShardGatherer, export_config, export_engine
from core_rl_megatron.families import arch_spec, padded_vocab_size
from core_rl_megatron.hf_io import HFWeights, load_hf_config
from core_rl_megatron.vocab_parallel import vocab_parallel_stats


class MegatronEngine(EngineState, TrainEngine):
    """See the module docstring. ``trainable=False`` builds a frozen reference model (no DDP, no
    gradients, no optimizer; :meth:`train_step`, :meth:`save_state` and :meth:`load_state` raise).
    ``head``: ``lm`` (a causal LM), ``value`` or ``score`` (a scalar head, see the module docstring)."""

    engine_label = "megatron"

    def __init__(
        self, actor: ActorConfig, config: MegatronConfig | None = None, *, trainable: bool = True, head: str = "lm"
    ) -> None:
        self.head = self._check_head_name(head)
        self.actor = actor
        cfg = config if config is not None else MegatronConfig()
        if actor.gradient_checkpointing and cfg.recompute_granularity is None:
            # the core's switch: recompute every layer in backward (as Hugging Face's checkpointing does)
            cfg = attrs.evolve(cfg, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        self.config = cfg
        self.trainable = trainable
        if trainable:
            check_schedule(actor.lr_scheduler)
        self.hf_config = load_hf_config(actor.model_path)
        self.spec = arch_spec(self.hf_config, head=head)
        self.export_config = export_config(self.hf_config, actor.model_path, head)
        if cfg.expert_model_parallel_size > 1:
            raise MegatronSetupError(
                f"actor.engine.expert_model_parallel_size: {cfg.expert_model_parallel_size} needs a mixture-of-experts "
                f"model; {self.spec.family} has no experts (set it to 1)"
            )
        if not megatron_can_run():
            raise MegatronSetupError(NEEDS_CUDA)
        self.device = dist_utils.pick_device()
        self.use_megatron_schedule = self.device.type == "cuda"
        if not self.use_megatron_schedule:
            check_cpu_settings(cfg)
        self.rank, self.world_size = dist_utils.ensure_process_group(cfg.backend, self.device)
        parallel.init_model_parallel(cfg, self.world_size)
        self.tp_rank, self.tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
        self.cp_rank, self.cp_size = mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size()
        self.padded_vocab = padded_vocab_size(self.spec.vocab_size, cfg.make_vocab_size_divisible_by, self.tp_size)
        self.vocab_start = self.tp_rank * (self.padded_vocab // self.tp_size)
        self.dtype = torch_dtype(actor.dtype)
        self._pad_id = int(self.hf_config.pad_token_id) if self.hf_config.pad_token_id is not None else 0
        self._multiple = width_multiple(self.tp_size, cfg.sequence_parallel, self.cp_size)
        self.tconfig = mcore_model.transformer_config(
            self.spec, cfg, params_dtype=self.dtype, on_cuda=self.device.type == "cuda"
        )
        chunks = mcore_model.build_chunks(self.spec, cfg, self.tconfig, self.padded_vocab, self.device)
        built = mcore_model.global_parameters(chunks)
        mcore_model.tag_tensor_parallel(built, self.spec, cfg.transformer_impl)
        mcore_model.mirror_padding_idx(chunks, self.hf_config.pad_token_id)
        with HFWeights(actor.model_path) as weights:
            mcore_model.load_hf_weights(built, weights, self.spec, self.padded_vocab, cfg.transformer_impl)
        if trainable:
            self.model = mcore_model.wrap_chunks(chunks, cfg, self.tconfig)
        else:
            self.model = mcore_model.float16_wrapped(chunks, cfg, self.tconfig)
            for chunk in self.model:
                chunk.requires_grad_(False)
                chunk.eval()
        self.params = mcore_model.global_parameters(self.model)
        self.replica = parallel.ReplicaRows()
        self.runner = _ReplicaRunner(self)
        self.gatherer = ShardGatherer(self.params, self.spec, cfg.transformer_impl, self.device)
        # the loss (and so every metric) is complete on tensor- and context-parallel rank 0 of the
        # last pipeline stage; other ranks contribute nothing to the step's metric sums
        self._owns_metrics = self.tp_rank == 0 and self.cp_rank == 0 and mpu.is_pipeline_last_stage()
        self.optimizer: Any = None
        if trainable:
            self.optimizer = self._build_optimizer()
            if self.use_megatron_schedule:
                optim.install_schedule_hooks(self.tconfig, self.model, cfg.ddp)
        self._step = 0
        self._closed = False

    # ------------------------------------------------------------------ set-up

    def pending_state_bytes(self) -> int:
        """See :func:`core_rl_megatron.optim.pending_state_bytes` (0 for a frozen engine)."""
        return 0 if self.optimizer is None else optim.pending_state_bytes(self.optimizer, self.actor.optimizer)

    def _build_optimizer(self) -> Any:
        if not self.use_megatron_schedule:
            return build_optimizer(
                self._trainable_params(), self.actor.optimizer, adamw_only=optim.embeddings_and_head(self.model)
            )
        return optim.megatron_optimizer(self.model, self.actor.optimizer, self.config, self.actor.grad_clip, self.dtype)

    def _trainable_params(self) -> list[torch.nn.Parameter]:
        return [p for chunk in self.model for p in chunk.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ micro-batches

    def _micro_batches(self, rows: TensorBatch) -> list[MicroBatch]:
        """This replica's micro-batches, padded with placeholders to the same count on every rank
        (the maximum over ranks, rounded up to a multiple of the pipeline size under virtual
        pipelining, as the interleaved schedule needs)."""
        lengths = row_lengths(rows["attention_mask"])
        mb = self.actor.micro_batch
        plan = pack_micro_batches(lengths, tokens_per_mb(mb), mb.min_num_mb)
        count = torch.tensor([len(plan)], dtype=torch.long, device=self.device)
        target = int(dist_utils.all_reduce(count, dist_utils.ReduceOp.MAX).item())
        if self.config.virtual_pipeline_size > 1:
            pp = self.config.pipeline_model_parallel_size
            target = -(-target // pp) * pp
        if target > len(plan):
            plan = pack_micro_batches(lengths, tokens_per_mb(mb), target)
        out = [MicroBatch.of(take_micro_batch(rows, r, micro_batch_width(lengths, r)), r) for r in plan]
        return out + [MicroBatch.placeholder(self._pad_id) for _ in range(target - len(plan))]

    def _inputs(self, mb: MicroBatch) -> ModelInputs:
        return model_inputs(
            mb,
            self.device,
            multiple=self._multiple,
            pad_token_id=self._pad_id,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            explicit_mask=self.config.transformer_impl == "local",
        )

    def _on_tokens(self, mb: MicroBatch, inputs: ModelInputs, per_position: torch.Tensor) -> torch.Tensor:
        """``[b, w]`` aligned with ``mb``'s tokens (:func:`core_rl_train_kit.logprobs.align_to_tokens`:
        position ``t`` holds the prediction made at ``t - 1``) from this rank's context-parallel
        positions' ``[b, n]`` values."""
        cp_group = mpu.get_context_parallel_group() if self.cp_size > 1 else None
        full = gather_columns(per_position, inputs.padded_width, self.cp_size, self.cp_rank, cp_group)
        return align_to_tokens(full[:, : mb.width - 1], mb.attention_mask.to(self.device))

    def _token_stats(
        self,
        mb: MicroBatch,
        inputs: ModelInputs,
        logits: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) ``[b, w]`` aligned with ``mb``'s tokens from this rank's
        vocabulary slice of the logits of its context-parallel positions; for a scalar head, the
        values in place of log-probs (entropies 0), as :class:`~core_rl_train_kit.runner.MicroBatchRunner`
        gives them."""
        if self.head != "lm":
            values = self._on_tokens(mb, inputs, logits[..., 0].float())
            return values, (torch.zeros_like(values.detach()) if with_entropy else None)
        ids = mb.input_ids.to(self.device)
        nxt = torch.cat(
            [ids[:, 1:], ids.new_full((ids.shape[0], inputs.padded_width - ids.shape[1] + 1), self._pad_id)], 1
        )
        targets = nxt[:, inputs.positions.to(self.device)]
        lp, ent = vocab_parallel_stats(
            logits,
            targets,
            vocab_start=self.vocab_start,
            vocab_size=self.spec.vocab_size,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            group=parallel.tp_group(),
        )
        return self._on_tokens(mb, inputs, lp), (None if ent is None else self._on_tokens(mb, inputs, ent))

    def _loss(
        self,
        mb: MicroBatch,
        inputs: ModelInputs,
        logits: torch.Tensor,
        loss_fn: LossFn,
        temperature: float,
        acc: StepMetrics,
    ) -> torch.Tensor:
        """The scalar this micro-batch back-propagates: ``sum(per_token_loss * loss_weight)``, or a
        zero that still reaches every parameter for a placeholder."""
        entropy_grad = bool(getattr(loss_fn, "entropy_grad", True))
        lp, ent = self._token_stats(mb, inputs, logits, temperature, with_entropy=True, entropy_grad=entropy_grad)
        assert ent is not None
        if mb.batch is None:
            return (lp.sum() + ent.sum()) * 0.0
        batch = mb.batch.to(self.device)
        out = loss_fn(batch, lp, ent)
        if out.per_token_loss.shape != lp.shape:
            raise ValueError(f"loss per_token_loss has shape {tuple(out.per_token_loss.shape)}, expected {lp.shape}")
        weighted = (out.per_token_loss.float() * batch["loss_weight"]).sum()
        if self._owns_metrics:
            acc.add(batch, weighted.detach(), ent.detach(), out.token_metrics)
        return weighted

    # ------------------------------------------------------------------ running micro-batches

    def _run_local(
        self,
        micro: list[MicroBatch],
        loss_fn: LossFn | None,
        temperature: float,
        acc: StepMetrics | None,
        sink: dict,
        backward: Callable[[torch.Tensor], None],
    ) -> None:
        """The CPU loop (pipeline size 1). With ``loss_fn`` it trains (forward, ``backward``, DDP's
        gradient reduction); without, it stores each micro-batch's log-probs in ``sink``."""
        model = self.model[0]
        last = len(micro) - 1
        for i, mb in enumerate(micro):
            inputs = self._inputs(mb)
            if loss_fn is None:
                logits = model(**inputs.forward_kwargs())
                sink[i] = self._token_stats(mb, inputs, logits, temperature, with_entropy=False)[0]
                continue
            with model.no_sync() if i < last else nullcontext():
                logits = model(**inputs.forward_kwargs())
                backward(self._loss(mb, inputs, logits, loss_fn, temperature, acc))  # type: ignore[arg-type]
        if loss_fn is not None:
            finalize_model_grads(self.model)

    def _run_schedule(
        self,
        micro: list[MicroBatch],
        loss_fn: LossFn | None,
        temperature: float,
        acc: StepMetrics | None,
        sink: dict,
        backward: Callable[[torch.Tensor], None],
    ) -> None:
        """Megatron's schedule (``get_forward_backward_func``) over ``micro``; same contract as
        :meth:`_run_local`, except that the schedule back-propagates itself (``backward`` is not
        called). The loss runs on the last pipeline stage only."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        zero_tokens = torch.zeros((), dtype=torch.int, device=self.device)

        def forward_step(data_iterator: Iterator[tuple[int, MicroBatch]], model: torch.nn.Module):
            index, mb = next(data_iterator)
            inputs = self._inputs(mb)
            output = model(**inputs.forward_kwargs())

            def loss_func(logits: torch.Tensor):
                if loss_fn is None:
                    sink[index] = self._token_stats(mb, inputs, logits, temperature, with_entropy=False)[0]
                    return logits.new_zeros(()), zero_tokens, {}
                return self._loss(mb, inputs, logits, loss_fn, temperature, acc), zero_tokens, {}  # type: ignore[arg-type]

            return output, loss_func

        forward_backward = get_forward_backward_func()
        forward_backward(
            forward_step_func=forward_step,
            # one iterator per model chunk (virtual pipeline stage), each over every micro-batch
            data_iterator=[iter(enumerate(micro)) for _ in self.model]
            if len(self.model) > 1
            else iter(enumerate(micro)),
            model=self.model,
            num_microbatches=len(micro),
            seq_length=max(-(-mb.width // self._multiple) * self._multiple for mb in micro),
            micro_batch_size=max(mb.input_ids.shape[0] for mb in micro),
            forward_only=loss_fn is None,
        )

    def _run(
        self,
        micro: list[MicroBatch],
        loss_fn: LossFn | None,
        temperature: float,
        acc: StepMetrics | None,
        backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    ) -> dict:
        sink: dict[int, torch.Tensor] = {}
        run = self._run_schedule if self.use_megatron_schedule else self._run_local
        run(micro, loss_fn, temperature, acc, sink, backward)
        return sink

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(self, batch: TensorBatch, *, temperature: float = 1.0) -> torch.Tensor:
        """Log-probs [B, T] float32 on CPU of this rank's rows (see
        :func:`core_rl_train_kit.logprobs.token_logprobs`), in eval mode without gradients."""
        self._check_head(("lm",), "compute_logprobs")
        check_temperature(temperature)
        return self.runner.logprobs(batch, temperature)

    def _forward_only(self, batch: TensorBatch, temperature: float) -> torch.Tensor:
        """Log-probs (values for a scalar head) [B, T] float32 on CPU of this rank's rows: the
        replica's rows in micro-batches, in eval mode without gradients. Collective."""
        rows, mine, width = self.replica.gather(batch, self._pad_id)
        micro = self._micro_batches(rows)
        was_training = [c.training for c in self.model]
        for chunk in self.model:
            chunk.eval()
        try:
            with torch.no_grad():
                sink = self._run(micro, None, temperature, None)
        finally:
            for chunk, mode in zip(self.model, was_training):
                chunk.train(mode)
        out = torch.zeros(rows["input_ids"].shape, dtype=torch.float32, device=self.device)
        if mpu.is_pipeline_last_stage():
            for i, mb in enumerate(micro):
                if mb.rows:
                    out[list(mb.rows), : mb.width] = sink[i]
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(
                out, src=mpu.get_pipeline_model_parallel_last_rank(), group=mpu.get_pipeline_model_parallel_group()
            )
        return out[mine, :width].cpu()

    # ------------------------------------------------------------------ training

    def _accumulate(
        self, batch: TensorBatch, loss_fn: LossFn, temperature: float, backward: Callable[[torch.Tensor], None]
    ) -> tuple[StepMetrics, int]:
        """Forward, loss and backward of every micro-batch of this replica's rows (see the module
        docstring); the step's metric sums (not yet reduced) and the number of micro-batches.
        Collective."""
        for key in TRAIN_KEYS:
            if key not in batch:
                raise KeyError(f"train_step needs batch[{key!r}]")
        rows, _mine, _width = self.replica.gather(batch, self._pad_id)
        micro = self._micro_batches(rows)
        acc = StepMetrics(self.device)
        self._run(micro, loss_fn, temperature, acc, backward)
        return acc, len(micro)

    def _train_mode(self) -> None:
        """Training mode, and DDP's gradient buffers and the parameters' gradients emptied."""
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self._zero_grad()

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _zero_grad(self) -> None:
        if self.use_megatron_schedule:
            self.optimizer.zero_grad()
        else:
            for p in self._trainable_params():
                p.grad = None

    def _apply_update(self, loss: float) -> float:
        """See :func:`core_rl_megatron.optim.apply_update`."""
        return optim.apply_update(self, loss)

    # ------------------------------------------------------------------ weights

    def _sync_params(self) -> None:
        """With overlapped parameter gathering the distributed optimizer's updates reach the model
        only in the next forward; force them in before weights are read."""
        if self.trainable and self.config.ddp.overlap_param_gather:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    def hf_weight_buckets(
        self, bucket_bytes: int | None = None, *, device: str | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The model's weights with Hugging Face names, on the main rank, in buckets of about
        ``bucket_bytes`` (default ``export_bucket_mb``; streaming: never a second full copy), on
        ``device`` (``None``: the engine's, so no trip through host memory). Collective: every rank
        must iterate to the end; other ranks receive nothing."""
        self._check_open()
        self._sync_params()
        return self.gatherer.hf_buckets(bucket_bytes or int(self.config.export_bucket_mb * 2**20), device=device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The gathered weights copied to the CPU (a snapshot: a parameter that needs no conversion
        would otherwise come back as itself on a CPU engine)."""
        state: dict[str, torch.Tensor] = {}
        for bucket in self.hf_weight_buckets(device=None):
            state.update({name: tensor.to("cpu", copy=True) for name, tensor in bucket.items()})
        if self.rank == 0 and self.spec.ties_output_layer:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def export_hf(self, path: str | Path) -> None:
        """See :func:`core_rl_megatron.export.export_engine` (rank 0 writes; every rank gathers)."""
        export_engine(self, Path(path).absolute())

    # ------------------------------------------------------------------ training state

    def save_state(self, path: str | Path, extra: Mapping[str, Any], *, optimizer: bool = True) -> None:
        """Write ``path/`` atomically in formats that execute nothing on load (see
        :mod:`core_rl_megatron.checkpoint`); ``optimizer=False`` leaves the optimizer state out."""
        self._check_trainable("save_state")
        self._sync_params()
        checkpoint.save(self, Path(path).absolute(), extra, optimizer=optimizer)

    def load_state(self, path: str | Path, *, optimizer: bool = True) -> dict[str, Any]:
        """Restore what :meth:`save_state` wrote (``optimizer=False``: but a fresh optimizer); return its ``extra``."""
        self._check_trainable("load_state")
        return checkpoint.load(self, Path(path).absolute(), optimizer=optimizer)

    def reset_optimizer(self) -> None:
        """See :func:`core_rl_megatron.checkpoint.reset_optimizer`."""
        self._check_trainable("reset_optimizer")
        checkpoint.reset_optimizer(self)

    def close(self) -> None:
        """Drop the model and optimizer (Megatron's parallel state stays for other engines)."""
        if self._closed:
            return
        self._closed = True
        optim.remove_schedule_hooks(self.tconfig)
        self.model = []
        self.params = {}
        self.gatherer = None  # type: ignore[assignment]
        self.runner = None  # type: ignore[assignment]
        self.optimizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class _ReplicaRunner:
    """The engine's micro-batch loop in the shape :class:`~core_rl_train_kit.runner.EngineState`
    drives (that of :class:`~core_rl_train_kit.runner.MicroBatchRunner`): each rank's rows pooled
    inside its model replica, Megatron's schedule or the CPU loop. Megatron's DDP *sums* gradients
    over replicas, so the world-size factor of ``MicroBatchRunner``'s convention does not apply
    (``world_size`` is ignored)."""

    #: no mixture-of-experts routing replay: the engine's families are dense (``replays_routes`` unset)
    moe = None

    def __init__(self, engine: MegatronEngine) -> None:
        self.engine = engine

    def logprobs(self, batch: TensorBatch, temperature: float) -> torch.Tensor:
        return self.engine._forward_only(batch, temperature)

    def accumulate_gradients(
        self,
        batch: TensorBatch,
        loss_fn: LossFn,
        temperature: float,
        backward: Callable[[torch.Tensor], None],
        world_size: int,
    ) -> tuple[StepMetrics, int]:
        return self.engine._accumulate(batch, loss_fn, temperature, backward)
