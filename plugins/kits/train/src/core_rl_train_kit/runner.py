"""The micro-batch loop of a train engine, shared by every engine (FSDP, DeepSpeed, ...).

An engine supplies its model and how to back-propagate; :class:`MicroBatchRunner` plans the rank's
micro-batches (:mod:`core_rl_train_kit.packing`), aligns their count over ranks (a sharded
engine's collectives must line up: a rank with fewer runs placeholder micro-batches), runs each
forward in the configured layout (:mod:`core_rl_train_kit.packed`; in the ``shared`` layout
rows that begin with the same prompt are planned together and run it once,
:mod:`core_rl_train_kit.shared_prefix`), calls the algorithm's loss and accumulates
:class:`~core_rl.loops.step_metrics.StepMetrics`.

Gradient convention: each micro-batch back-propagates
``world_size * sum(per_token_loss * loss_weight)``; engines average gradients over ranks, so the
update is the gradient of the global batch's ``sum(per_token_loss * loss_weight)`` whatever the
split into micro-batches or ranks (``loss_weight`` is normalised over the global batch).
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import torch
from core_rl.config.schema import ActorConfig, MicroBatchConfig
from core_rl.data import row_lengths
from core_rl.errors import ConfigError
from core_rl.interfaces import HEADS, VALUE_HEADS, LossFn, LossOutput, ValueLossFn
from core_rl.launch import distributed as dist_utils
from core_rl.loops import StepMetrics, tokens_per_mb
from core_rl.protocol import TensorBatch
from core_rl.vision.media import row_media
from torch import nn

from core_rl_train_kit import shared_prefix
from core_rl_train_kit.fused_head import check_fusable
from core_rl_train_kit.microbatch import micro_batch_width, placeholder_micro_batch, take_micro_batch
from core_rl_train_kit.moe_routing import MoERouting
from core_rl_train_kit.optim import lr_at, set_lr
from core_rl_train_kit.packed import VARLEN_ATTENTION, forward_logprobs, forward_values, resolve_layout
from core_rl_train_kit.packing import plan_micro_batches
from core_rl_train_kit.row_pool import pool_rows
from core_rl_train_kit.sharded_forward import sharded_logprobs, sharded_values
from core_rl_train_kit.shared_prefix import (
    AUTO_MIN_SAVING,
    SHARED_ATTENTION,
    Planned,
    find_units,
    plan_cost,
    plan_units,
)
from core_rl_train_kit.topk_runner import TopkForwards
from core_rl_train_kit.ulysses import SequenceGroup
from core_rl_train_kit.vision_tower import idle_vision_pass

TRAIN_KEYS = ("input_ids", "attention_mask", "response_mask", "loss_weight")


class EngineState(ABC):
    """What every train engine built on :class:`MicroBatchRunner` shares: the optimizer step count,
    open/trainable/head/temperature checks, and the optimizer step itself (:meth:`train_step`,
    :meth:`train_value_step`): the learning rate of this step from the schedule, gradients
    accumulated over the micro-batches (none left behind when one fails), the global metrics, then
    the engine's own :meth:`_apply_update` (clip, step, zero: FSDP and DeepSpeed do these
    differently). Subclasses set ``actor``, ``optimizer``, ``runner``, ``world_size``, ``_step``,
    ``_closed``, ``trainable``, ``engine_label`` and ``head``, and implement :meth:`_train_mode`,
    :meth:`_backward` and :meth:`_apply_update`."""

    engine_label = "train"
    actor: ActorConfig
    optimizer: Any
    runner: MicroBatchRunner
    world_size: int
    trainable: bool
    head: str = "lm"
    _step: int
    _closed: bool

    @property
    def step(self) -> int:
        return self._step

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {self.engine_label} engine was closed")

    def _check_trainable(self, what: str) -> None:
        self._check_open()
        if not self.trainable:
            raise RuntimeError(f"{what} needs a trainable engine; this one is a frozen reference (trainable=False)")

    @staticmethod
    def _check_head_name(head: str) -> str:
        if head not in HEADS:
            raise ValueError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
        return head

    def _check_head(self, heads: tuple[str, ...], what: str) -> None:
        self._check_open()
        if self.head not in heads:
            wanted = f"head={heads[0]!r}" if len(heads) == 1 else f"head in {heads}"
            raise RuntimeError(f"{what} needs an engine built with {wanted}; this one has head={self.head!r}")

    # -- the engine's part of a step --------------------------------------------------------------

    @abstractmethod
    def _train_mode(self) -> None:
        """Put the model in training mode."""

    @abstractmethod
    def _backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's loss."""

    @abstractmethod
    def _apply_update(self, loss: float) -> float:
        """After the micro-batches: clip, step (only if ``loss`` and the gradient norm are finite, the
        same decision on every rank) and zero the gradients; return the gradient norm over all ranks
        before clipping."""

    # -- the shared step ----------------------------------------------------------------------------

    def train_step(self, batch: TensorBatch, loss_fn: LossFn, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step (see :class:`core_rl.interfaces.TrainEngine` and :class:`MicroBatchRunner`).

        Returns, reduced over ranks: ``loss`` (sum of ``per_token_loss * loss_weight`` over the
        global batch), ``grad_norm`` (before clipping), ``lr`` (used by this step), ``entropy`` and
        every token metric (means over the global batch's response tokens),
        ``num_micro_batches`` (per rank), ``tokens`` (non-padding tokens processed) and
        ``nonfinite``: 1.0 when the global loss or gradient norm is NaN/inf, in which case no rank
        updates its weights or optimizer state (the step still counts, for the schedule).
        """
        self._check_trainable("train_step")
        self._check_head(("lm",), "train_step")
        check_temperature(temperature)
        return self._optimizer_step(batch, loss_fn, temperature)

    def _optimizer_step(self, batch: TensorBatch, loss_fn: LossFn, temperature: float) -> dict[str, float]:
        assert self.optimizer is not None
        lr = lr_at(self._step, self.actor.optimizer.lr, self.actor.lr_scheduler)
        set_lr(self.optimizer, lr)
        self._train_mode()
        try:
            acc, num_micro_batches = self.runner.accumulate_gradients(
                batch, loss_fn, temperature, self._backward, self.world_size
            )
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)  # a failed step leaves no partial gradient behind
            raise
        metrics = acc.reduce()  # global sums: every rank takes the same decision in _apply_update
        if self.runner.moe is not None:
            metrics.update(self.runner.moe.metrics(self.world_size))
        grad_norm = self._apply_update(metrics["loss"])
        self._step += 1
        metrics.update(
            grad_norm=grad_norm,
            lr=lr,
            num_micro_batches=float(num_micro_batches),
            nonfinite=0.0 if math.isfinite(grad_norm) and math.isfinite(metrics["loss"]) else 1.0,
        )
        return metrics

    def compute_values(self, batch: TensorBatch) -> torch.Tensor:
        """Values [B, T] float32 on CPU of a value model (see :class:`core_rl.interfaces.TrainEngine`),
        in eval mode without gradients, micro-batched like training."""
        self._check_head(VALUE_HEADS, "compute_values")
        return self.runner.logprobs(batch, 1.0)  # the runner's forward gives values for this head

    def compute_topk_logprobs(
        self, batch: TensorBatch, k: int, *, temperature: float = 1.0, vocab_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k ids and log-probs [B, T, k] on CPU (see :class:`core_rl.interfaces.TrainEngine`), in
        eval mode without gradients, micro-batched like training."""
        self._check_head(("lm",), "compute_topk_logprobs")
        check_temperature(temperature)
        return self.runner.topk_logprobs(batch, k, temperature, vocab_size)

    def train_value_step(self, batch: TensorBatch, loss_fn: ValueLossFn) -> dict[str, float]:
        """One optimizer step of a value model: the engine's ``train_step`` with
        ``loss_fn(micro_batch, values)`` (no ``entropy`` metric)."""
        self._check_trainable("train_value_step")
        self._check_head(VALUE_HEADS, "train_value_step")

        def on_values(mb: TensorBatch, values: torch.Tensor, _entropy: torch.Tensor) -> LossOutput:
            return loss_fn(mb, values)

        metrics = self._optimizer_step(batch, on_values, 1.0)
        metrics.pop("entropy", None)
        return metrics


def pad_token_id_of(model: nn.Module) -> int:
    """The pad token id of the Hugging Face ``model``'s language model (a vision-language model's
    is its text config's), 0 where it names none: what an engine pads micro-batches with."""
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    pad_id = getattr(config, "pad_token_id", None)
    return int(pad_id) if pad_id is not None else 0


def check_temperature(temperature: float) -> None:
    """Sampling temperatures divide logits: they must be positive."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


class MicroBatchRunner(TopkForwards):
    """Runs ``model`` over a rank's rows in micro-batches. ``attn_implementation`` is the one the
    model was loaded with (it decides the ``auto`` layout and whether flash-attn varlen arguments
    are passed). ``head="value"`` or ``"score"``: ``model`` is a value model; :meth:`forward` and :meth:`logprobs`
    then give values (:func:`~core_rl_train_kit.packed.forward_values`) in place of log-probs,
    and entropies are 0. ``autocast_dtype``: run the model's forward passes under
    ``torch.autocast`` in that dtype (mixed precision: weights and gradients keep their dtype;
    log-probs are still taken from float32 logits); backward passes run outside it, replaying the
    forward's dtypes. ``fused_head``: log-probs of a language model from its last hidden states
    and head weight, the logits never whole (:mod:`core_rl_train_kit.fused_head`; a
    :class:`~core_rl.errors.ConfigError` where the model cannot).

    ``sequence``: a sequence-parallel group of more than one rank (the model loaded with a
    :func:`core_rl_train_kit.ulysses.register`-ed attention; never shared): the group's ranks pool their rows
    (:func:`~core_rl_train_kit.row_pool.pool_rows`), plan the same micro-batches of them, and
    run each over the group, every rank on its slice of the positions
    (:mod:`core_rl_train_kit.sharded_forward`); ``max_tokens_per_mb`` then counts the tokens one
    rank holds, so a micro-batch holds up to the group's size times as many. Each rank computes
    the loss of the whole micro-batch and back-propagates it through its own positions; the
    step's metrics are counted by the group's first rank only.

    ``layout`` (``config.layout`` resolved, :func:`~core_rl_train_kit.packed.resolve_layout`):
    ``padded``, ``packed`` or ``shared``. In ``shared`` each plan groups the rows that share a
    prompt (:func:`~core_rl_train_kit.shared_prefix.find_units`) and runs them shared when the
    layout was asked for (whatever the cost), or, under ``auto``, when the shared plan costs at least
    :data:`~core_rl_train_kit.shared_prefix.AUTO_MIN_SAVING` less than the padded one
    (:func:`~core_rl_train_kit.shared_prefix.plan_cost`); otherwise padded. Top-k log-probs and
    log-probs of given ids always run padded (their rows would share prompt positions).

    ``moe``: a mixture-of-experts model's routing (:mod:`core_rl_train_kit.moe_routing`): every
    forward replays the routes it asks for, the update forwards count its metrics and add its
    load-balancing loss. Replay needs each micro-batch's tokens in the padded ``[b, width]`` order,
    so with replay on the layout is ``padded`` whatever ``layout`` says, and sequence parallelism is
    refused."""

    def __init__(
        self,
        model: nn.Module,
        config: MicroBatchConfig,
        device: torch.device,
        *,
        pad_token_id: int,
        attn_implementation: str | None,
        head: str = "lm",
        autocast_dtype: torch.dtype | None = None,
        fused_head: bool = False,
        sequence: SequenceGroup | None = None,
        moe: MoERouting | None = None,
    ) -> None:
        self.model = model
        self.moe = moe
        self.sequence = sequence if sequence is not None and sequence.size > 1 else None
        self.attn_implementation = attn_implementation
        self.head = head
        self.fused_head = fused_head and head == "lm"
        if self.fused_head:
            reason = check_fusable(model)
            if reason is not None:
                raise ConfigError(
                    f"fused_head: this model cannot compute log-probs from its head's weight: {reason}; "
                    "set fused_head: false"
                )
        self.autocast_dtype = autocast_dtype
        self.config = config
        self.device = device
        self.pad_token_id = pad_token_id
        # the attention the model runs: the engine's, or the model's own (its config's) for the
        # shared layout alone (a varlen kernel the engine did not name gets no packed rows)
        attention = attn_implementation or shared_prefix.model_attention(model)
        unshareable = shared_prefix.shared_unsupported(model, attention)
        if self.sequence is not None:
            unshareable = "it runs over a sequence-parallel group"
        named = attention if attn_implementation is None and attention in SHARED_ATTENTION else attn_implementation
        if moe is not None and moe.mode != "none":
            if self.sequence is not None:
                raise ConfigError(
                    [
                        "actor.moe.routing_replay: replaying routes needs each rank to hold whole sequences; "
                        "set actor.engine.sequence_parallel_size: 1 or routing_replay: none"
                    ]
                )
            unshareable = "routing replay needs the padded layout"
        self.layout = resolve_layout(config.layout, named, unshareable)
        if moe is not None and moe.mode != "none":
            self.layout = "padded"
        #: the layout of what is not shared: a shared plan's micro-batches without a unit of several
        #: rows, or whole plans the cost comparison (``auto``) left padded
        self.base_layout = "padded" if self.layout == "shared" else self.layout
        #: the least saving of a shared plan over the padded one (``auto``); ``shared`` asked for
        #: runs every plan with rows to share shared
        self.shared_min_saving = AUTO_MIN_SAVING if config.layout == "auto" else -math.inf
        self.attention_span = shared_prefix.attention_span(model) if self.layout == "shared" else 0.0
        self._additive_mask = attention == "eager"
        self._probed = False
        self.varlen_kwargs = self.layout == "packed" and attn_implementation in VARLEN_ATTENTION

    # ------------------------------------------------------------------ plan

    def plan(self, batch: TensorBatch, *, share: bool = True) -> tuple[list[int], list[Planned]]:
        """Row lengths and this rank's micro-batches, padded with empty ones to the same count on
        every rank (the maximum over ranks; ranks with fewer first split further if they can).
        In the ``shared`` layout (and ``share``) a plan of the rows sharing prompts where it pays
        (class docstring); the ranks' choices may differ (either runs every module once per
        micro-batch). Collective."""
        attention_mask = batch["attention_mask"]
        lengths = row_lengths(attention_mask)
        mb = self.config
        packed = self.base_layout == "packed"

        budget = tokens_per_mb(mb) * (self.sequence.size if self.sequence is not None else 1)
        units = None
        if share and self.layout == "shared":
            response = batch["response_mask"] if "response_mask" in batch else None
            if "image_grid_thw" not in batch:  # rows with images run padded (their positions are the model's)
                units = find_units(batch["input_ids"], attention_mask, response, budget, self.attention_span)
            if not self._check_shared(units is not None):  # collective: every rank asks, images or not
                units = None

        def make(min_num: int) -> list[Planned]:
            rows = plan_micro_batches(lengths, budget, min_num, algorithm=mb.packing_algorithm, packed=packed)
            plain = [Planned(r) for r in rows]
            if units is None:
                return plain
            shared = plan_units(units, lengths, budget, min_num, algorithm=mb.packing_algorithm)
            span = self.attention_span
            saving = 1 - plan_cost(shared, lengths, span) / max(plan_cost(plain, lengths, span), 1.0)
            return shared if saving >= self.shared_min_saving else plain

        plan = make(mb.min_num_mb)
        count = torch.tensor([len(plan)], dtype=torch.long, device=self.device)
        target = int(dist_utils.all_reduce(count, dist_utils.ReduceOp.MAX).item())
        if target > len(plan):
            plan = make(target)
        return lengths, plan + [Planned([]) for _ in range(target - len(plan))]

    def _check_shared(self, wanted: bool) -> bool:
        """Whether the model runs the shared layout right, checked once (:func:`~core_rl_train_kit.
        shared_prefix.probe`), at the first plan where some rank has rows to share (``wanted`` on
        this rank): until then every plan asks the ranks (they plan at the same points), then every
        rank probes together. Under ``auto`` a model that fails runs padded from then on; an
        asked-for ``shared`` is a :class:`~core_rl.errors.ConfigError`."""
        if not self._probed:
            if not dist_utils.any_rank(wanted):
                return False
            self._probed = True
            with self._precision():
                reason = shared_prefix.probe(self.model, self.device, additive=self._additive_mask)
            if reason is not None:
                if self.config.layout == "shared":
                    raise ConfigError(
                        [f"actor.micro_batch.layout: shared cannot run on this model: {reason}; use auto or padded"]
                    )
                self.layout = self.base_layout = "padded"
        return self.layout == "shared"

    # ------------------------------------------------------------------ forward

    def _precision(self) -> contextlib.AbstractContextManager[object]:
        """The forward's autocast region (nothing without ``autocast_dtype``)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool = True,
        units: tuple[tuple[int, int], ...] | None = None,
        media: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) ``[b, width]`` of one micro-batch on the engine's device
        (``entropy_grad``: see :func:`~core_rl_train_kit.logprobs.token_logprobs`); ``units``:
        its rows run shared (a :class:`~core_rl_train_kit.shared_prefix.Planned` micro-batch's);
        ``media``: its rows' pixel inputs (:func:`core_rl.vision.media.row_media`; padded layout)."""
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        media = {k: v.to(self.device) for k, v in media.items()} if media else None
        if media and (self.sequence is not None or self.head != "lm"):
            raise ConfigError("rows with images train a language-model head without sequence parallelism only")
        if self.sequence is not None:
            return self._sharded_forward(input_ids, attention_mask, temperature, with_entropy, entropy_grad)
        stream = None
        if units is not None and any(count > 1 for count, _ in units):
            stream = shared_prefix.share_rows(input_ids, attention_mask, units, additive=self._additive_mask)
        layout = {"layout": self.base_layout, "varlen_kwargs": self.varlen_kwargs, "stream": stream}
        with self._precision():
            if self.head != "lm":
                values = forward_values(self.model, input_ids, attention_mask, **layout)
                return values, (torch.zeros_like(values.detach()) if with_entropy else None)
            return forward_logprobs(
                self.model,
                input_ids,
                attention_mask,
                temperature=temperature,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
                fused=self.fused_head,
                media=media,
                **layout,
            )

    def _sharded_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` over the sequence-parallel group (:mod:`core_rl_train_kit.sharded_forward`)."""
        assert self.sequence is not None
        layout = {"layout": self.layout, "attn_implementation": self.attn_implementation}
        with self._precision():
            if self.head != "lm":
                values = sharded_values(self.model, input_ids, attention_mask, self.sequence, **layout)
                return values, (torch.zeros_like(values.detach()) if with_entropy else None)
            return sharded_logprobs(
                self.model,
                input_ids,
                attention_mask,
                self.sequence,
                temperature=temperature,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
                fused=self.fused_head,
                **layout,
            )

    def _pool(self, batch: TensorBatch) -> tuple[TensorBatch, slice]:
        """The sequence-parallel group's rows and this rank's slice of them (the batch itself without a group)."""
        if self.sequence is None:
            return batch, slice(0, batch.batch_size)
        sg = self.sequence
        return pool_rows(batch, sg.group, sg.size, sg.index, self.pad_token_id)

    def _placeholder_forward(self, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        dummy = placeholder_micro_batch(self.pad_token_id)
        # padded: one token needs no packing, and it reaches every parameter just the same
        with self._precision():
            with idle_vision_pass(self.model, self.device):  # a VLM's tower runs on every rank
                logits = self.model(
                    input_ids=dummy["input_ids"].to(self.device),
                    attention_mask=dummy["attention_mask"].to(self.device),
                    use_cache=False,
                ).logits
        return logits.float().sum() * 0.0, None

    # ------------------------------------------------------------------ log-probs

    def logprobs(self, batch: TensorBatch, temperature: float) -> torch.Tensor:
        """Log-probs ``[B, T]`` float32 on CPU, in eval mode without gradients. Collective."""
        pooled, mine = self._pool(batch)
        out = self._pooled_logprobs(pooled, temperature)
        return out if self.sequence is None else out[mine, : batch["input_ids"].shape[1]].contiguous()

    def _pooled_logprobs(self, batch: TensorBatch, temperature: float) -> torch.Tensor:
        def forward(
            ids: torch.Tensor,
            mask: torch.Tensor,
            units: tuple[tuple[int, int], ...] | None,
            media: Mapping[str, torch.Tensor] | None = None,
        ):
            return (self.forward(ids, mask, temperature, False, units=units, media=media)[0],)

        (out,) = self._eval_rows(batch, temperature, [torch.float32], forward)
        return out

    def _eval_rows(
        self,
        batch: TensorBatch,
        temperature: float,
        dtypes: list[torch.dtype],
        forward: Callable[..., tuple[torch.Tensor, ...]],
        trailing: tuple[int, ...] = (),
        share: bool = True,
    ) -> list[torch.Tensor]:
        """``forward(input_ids, attention_mask, units)`` of every micro-batch of ``batch``'s rows
        (``units``: how its rows are shared, or ``None``; never shared without ``share``), in eval
        mode without gradients, its outputs (``[b, width, *trailing]`` each) written into CPU tensors
        ``[B, T, *trailing]`` of ``dtypes`` (0 elsewhere). Collective."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        with_images = "image_grid_thw" in batch  # rows with images are never shared (plan)
        lengths, plan = self.plan(batch, share=share)
        outs = [torch.zeros(*input_ids.shape, *trailing, dtype=dtype) for dtype in dtypes]
        moe = self.moe
        replay = moe.routes_for(batch) if moe is not None else None
        recorded = None
        if moe is not None and moe.records and replay is None:
            recorded = torch.full((*input_ids.shape, moe.layers, moe.top_k), -1, dtype=torch.int16)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for planned in plan:
                    rows = planned.rows
                    if not rows:
                        self._placeholder_forward(temperature)
                        continue
                    width = micro_batch_width(lengths, rows)
                    index = torch.as_tensor(rows, dtype=torch.long)
                    routes = None if replay is None else replay[index, :width]
                    media = row_media(batch, rows) if with_images else {}
                    with moe.forward(routes) if moe is not None else contextlib.nullcontext():
                        values = forward(
                            input_ids[index, :width].to(self.device),
                            attention_mask[index, :width].to(self.device),
                            planned.units,
                            **({"media": media} if media else {}),
                        )
                        if recorded is not None:
                            recorded[index, :width] = moe.own_routes(torch.Size((len(rows), width)))
                    for out, value in zip(outs, values, strict=True):
                        out[index, :width] = value.to(out.dtype).cpu()
        finally:
            self.model.train(was_training)
        if recorded is not None:
            moe.record_first_forward(batch, recorded)
        return outs

    # ------------------------------------------------------------------ training

    def accumulate_gradients(
        self,
        batch: TensorBatch,
        loss_fn: LossFn,
        temperature: float,
        backward: Callable[[torch.Tensor], None],
        world_size: int,
    ) -> tuple[StepMetrics, int]:
        """Forward, loss and ``backward(world_size * weighted_loss)`` for every micro-batch of this
        rank (placeholders back-propagate a zero through every parameter); returns the step's
        metric sums (not yet reduced) and the number of micro-batches. Collective."""
        for key in TRAIN_KEYS:
            if key not in batch:
                raise KeyError(f"train_step needs batch[{key!r}]")
        batch, _mine = self._pool(batch)
        counts = self.sequence is None or self.sequence.index == 0  # the group's ranks share micro-batches
        entropy_grad = bool(getattr(loss_fn, "entropy_grad", True))
        logprobs_key = getattr(loss_fn, "logprobs_at_key", None)
        with_images = "image_grid_thw" in batch  # rows with images are never shared (plan)
        lengths, plan = self.plan(batch, share=logprobs_key is None)
        acc = StepMetrics(self.device)
        moe = self.moe
        rank_tokens = max(int(batch["attention_mask"].sum()), 1)
        for planned in plan:
            rows = planned.rows
            if not rows:
                zero, _ = self._placeholder_forward(temperature)
                backward(zero)
                continue
            mb = take_micro_batch(batch, rows, micro_batch_width(lengths, rows)).to(self.device)
            aux = None
            with moe.forward(moe.routes_for(mb)) if moe is not None else contextlib.nullcontext():
                if logprobs_key is None:
                    lp, ent = self.forward(
                        mb["input_ids"],
                        mb["attention_mask"],
                        temperature,
                        True,
                        entropy_grad,
                        units=planned.units,
                        media=row_media(mb) if with_images else None,
                    )
                else:
                    lp, ent = self._forward_at(mb, logprobs_key, temperature, entropy_grad)
                if moe is not None:
                    aux = moe.observe(mb, int(mb["attention_mask"].sum()) / rank_tokens)
            assert ent is not None
            out = loss_fn(mb, lp, ent)
            if out.per_token_loss.shape != lp.shape:
                raise ValueError(
                    f"loss per_token_loss has shape {tuple(out.per_token_loss.shape)}, expected {tuple(lp.shape)}"
                )
            weighted = (out.per_token_loss.float() * mb["loss_weight"]).sum()
            backward(weighted * world_size if aux is None else weighted * world_size + aux)
            if counts:
                acc.add(mb, weighted.detach(), ent.detach(), out.token_metrics)
        return acc, len(plan)
