"""The engines' contracts: the train engine (:class:`TrainEngine`, with the loss function it is given,
:data:`LossFn`) and the rollout engine (:class:`RolloutEngine`)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from core_rl.interfaces.sampling import SamplingParams

if TYPE_CHECKING:  # torch is imported by the components themselves, not by their registration
    import torch

    from core_rl.protocol import Sample, TensorBatch


@attrs.define
class LossOutput:
    """What a policy loss returns for one micro-batch.

    ``per_token_loss`` [b, T]: the loss of each token; the engine minimises
    ``sum(per_token_loss * batch["loss_weight"])``.
    ``token_metrics``: name -> [b, T] tensor, reported as its mean over response tokens of the whole
    batch (for example ``clipped`` as 0/1 gives the clip fraction), or as its maximum over them when
    the name ends in ``_max`` (e.g. ``ratio_max``).
    """

    per_token_loss: torch.Tensor
    token_metrics: dict[str, torch.Tensor] = attrs.field(factory=dict)


# (micro-batch, current log-probs [b, T], entropy [b, T]) -> LossOutput
LossFn = Callable[["TensorBatch", "torch.Tensor", "torch.Tensor"], LossOutput]

# (micro-batch, current values [b, T]) -> LossOutput (a value model's loss, e.g. a critic's)
ValueLossFn = Callable[["TensorBatch", "torch.Tensor"], LossOutput]

#: a loss that needs the policy's log-probs of more tokens than the sampled one sets
#: ``logprobs_at_key`` (a batch key of token ids ``[B, T, k]``, e.g. a teacher's top-k ids); the
#: engines that support it (``topk_logprobs = True`` on their config class) then put in each
#: micro-batch, under this key, the log-probs ``[b, T, k]`` (with gradient) of those ids under the
#: prediction of token ``t``, in the alignment of the log-probs (0 at column 0 and on padding)
LOGPROBS_AT = "logprobs_at"

#: what a train engine's model outputs: ``lm`` (a causal LM: log-probs), ``value`` (a value model:
#: one scalar per token) or ``score`` (a value model whose head has no bias, Hugging Face's
#: ``*ForSequenceClassification`` head: a reward model, exported as such a classifier). An engine lists
#: the heads it builds in the ``heads`` attribute of its ``config_cls`` (``("lm",)`` when absent) and
#: receives ``head=...`` from its factory only then.
HEADS = ("lm", "value", "score")
#: the heads whose model gives values (:meth:`TrainEngine.compute_values`, :meth:`TrainEngine.train_value_step`)
VALUE_HEADS = ("value", "score")


class TrainEngine(ABC):
    """Holds a policy (or a frozen reference model), computes log-probs and runs optimiser steps.

    Every rank of a data-parallel group runs the same calls with its shard of the batch rows.
    """

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    @abstractmethod
    def step(self) -> int:
        """Number of optimiser steps taken (restored by :meth:`load_state`)."""

    @abstractmethod
    def compute_logprobs(self, batch: TensorBatch, *, temperature: float = 1.0) -> torch.Tensor:
        """Log-probs [B, T] of ``input_ids`` under ``softmax(logits / temperature)``; position ``t``
        holds log p(token_t | tokens_<t), position 0 and padding hold 0. No gradient."""

    @abstractmethod
    def train_step(self, batch: TensorBatch, loss_fn: LossFn, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimiser step on ``batch`` (this rank's rows), split into micro-batches.

        For each micro-batch the engine computes log-probs and entropy at ``temperature``, calls
        ``loss_fn`` and back-propagates ``sum(per_token_loss * loss_weight)`` so the gradient does
        not depend on the split. Then it clips gradients, steps the optimiser and scheduler.
        Returns at least ``loss``, ``grad_norm``, ``lr``, ``entropy`` and each token metric, reduced
        over all ranks.

        A loss or gradient norm that is not finite (on any rank) skips the update on every rank: no
        optimiser step, gradients dropped, and ``nonfinite`` is 1.0 in the metrics (else 0.0).
        """

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) model weights with Hugging Face names, on CPU, on the main rank;
        an empty dict elsewhere. A snapshot: its tensors share no storage with the parameters, so
        later training leaves them unchanged (a CPU engine copies). Every rank must call it (it is
        a collective)."""

    def hf_weight_buckets(self, bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """The weights of :meth:`full_state_dict` (same names and values; a tied weight repeated there
        may be left out) in buckets of about ``bucket_bytes`` (``None``: the engine's choice), on the
        main rank; other ranks' buckets are empty. The tensors stay where the engine keeps its weights
        (a GPU engine's never pass through host memory) and may share storage with its parameters:
        never write to them, and read them before the next :meth:`train_step` or :meth:`load_state`.
        Collective: every rank iterates to the end. Default: :meth:`full_state_dict` as one bucket."""
        yield self.full_state_dict()

    @abstractmethod
    def export_hf(self, path: str | Path) -> None:
        """Write the model as a Hugging Face directory (config, safetensors weights, tokenizer).
        Collective; the main rank writes, atomically."""

    def export_adapter(self, path: str | Path) -> None:
        """Write the LoRA adapter alone to ``path`` in peft's ``save_pretrained`` format, gathering
        only its tensors (``rollout.lora_sync: adapter``; an engine that can declares
        ``exports_lora_adapter``). Collective; the main rank writes, atomically. Default: raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot write a LoRA adapter alone")

    @abstractmethod
    def save_state(self, path: str | Path, extra: Mapping[str, Any], *, optimizer: bool = True) -> None:
        """Save the full training state (model, optimiser, scheduler, step, RNG; the optimiser's only
        with ``optimizer``) plus ``extra`` (e.g. the data position; the main rank's copy is kept)
        under ``path``, atomically. Collective."""

    @abstractmethod
    def load_state(self, path: str | Path, *, optimizer: bool = True) -> dict[str, Any]:
        """Restore what :meth:`save_state` wrote (without ``optimizer``: a fresh optimiser); return
        its ``extra``. Collective. With ``optimizer``, a checkpoint that left existing optimiser state
        out is refused on every rank: :func:`core_rl_train_kit.state.restores_optimizer`."""

    def reset_optimizer(self) -> None:
        """Drop the optimiser state, keeping weights and :attr:`step`. Collective. Default: raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot reset its optimizer state")

    def compute_values(self, batch: TensorBatch) -> torch.Tensor:
        """Values [B, T] of an engine built with a value head (:data:`VALUE_HEADS`): position ``t`` holds the value of
        the state before token ``t`` (computed from the hidden state at ``t - 1``, the alignment of
        :meth:`compute_logprobs`); position 0 and padding hold 0. No gradient."""
        raise NotImplementedError(f"{type(self).__name__} does not build value models (head='value')")

    def train_value_step(self, batch: TensorBatch, loss_fn: ValueLossFn) -> dict[str, float]:
        """One optimiser step of a value model on ``batch``, like :meth:`train_step` but ``loss_fn``
        receives each micro-batch's values [b, T] (with gradient) instead of log-probs and entropy.
        Returns at least ``loss``, ``grad_norm``, ``lr``, ``nonfinite`` and each token metric."""
        raise NotImplementedError(f"{type(self).__name__} does not build value models (head='value')")

    def compute_topk_logprobs(
        self, batch: TensorBatch, k: int, *, temperature: float = 1.0, vocab_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely tokens of the prediction of every token of ``input_ids`` under
        ``softmax(logits / temperature)`` (over the first ``vocab_size`` tokens: the student's
        vocabulary, which a teacher's padded embedding may exceed; ``None``: all): ids [B, T, k]
        (long, most likely first) and their log-probs [B, T, k] (float32), position ``t`` from the
        prediction of token ``t`` (the alignment of :meth:`compute_logprobs`); position 0 and
        padding hold 0. No gradient. Engines that implement it set ``topk_logprobs = True`` on
        their config class. Default: raises."""
        raise NotImplementedError(f"{type(self).__name__} does not compute top-k log-probs")

    def check_checkpoint(self, path: str | Path) -> None:
        """Raise :class:`core_rl.checkpoint.files.CheckpointFormatError` (naming the file) unless
        ``path`` holds a complete checkpoint :meth:`load_state` can read. Cheap (headers, not
        tensors); called on the main rank only, to pick the newest valid checkpoint before the
        collective :meth:`load_state`. The default only checks that ``path`` is a directory."""
        from core_rl.checkpoint.files import CheckpointFormatError

        if not Path(path).is_dir():
            raise CheckpointFormatError(f"{path}: not a directory")

    def close(self) -> None:
        """Release resources."""


#: how ``rollout.weight_sync`` may move new weights to a rollout engine
WEIGHT_SYNC_MODES = ("memory", "disk", "collective")
#: what :meth:`RolloutEngine.pause` does with requests already running
PAUSE_MODES = ("wait", "keep", "abort")
#: what :meth:`RolloutEngine.restore_memory` takes back: the weights' storage, and the KV cache with
#: whatever else generating needs besides the weights (CUDA graphs)
MEMORY_PARTS = ("weights", "kv_cache")


class RolloutEngine(ABC):
    """Generates responses with a known weight version and accepts new weights.

    Two ways to generate, both thread-safe:

    - :meth:`agenerate` (per request, asyncio): the ``n`` samples of one prompt; a caller keeps as
      many requests in flight as it likes (the engine bounds its own concurrency) and may await
      them from any event loop.
    - :meth:`generate` (batch, blocking): every prompt of a batch, in order.

    A subclass implements at least one of them; the default of each is built on the other.

    :attr:`weight_sync_modes` lists the ``rollout.weight_sync`` values the engine supports
    (checked when a configuration is validated, through the same attribute on its ``config_cls``).
    ``memory`` calls :meth:`update_weights_from_buckets`, ``disk`` :meth:`load_weights_from_path`,
    ``collective`` :meth:`update_weights_collective`.
    """

    weight_sync_modes: ClassVar[tuple[str, ...]] = ("memory", "disk")
    #: the engine samples under a ``response_format`` constraint (guided decoding: JSON objects
    #: and JSON schemas, :func:`core_rl.interfaces.sampling.required_json_schema`); the rollout
    #: controller refuses such requests for an engine without it
    guided_decoding: ClassVar[bool] = False

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """Version of the weights now used for generation (it advances only once every replica
        of the engine holds the new weights)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        media: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
    ) -> list[list[Sample]]:
        """For each prompt (token ids), ``sampling.n`` samples, in prompt order. Blocks.

        ``media`` (only for engines whose config class claims ``multimodal = True``; passed only when
        some prompt has images): per prompt, the pixel inputs of the images its ids hold placeholders
        for (:attr:`core_rl.protocol.Sample.media`), or ``None``.

        Default: every prompt's :meth:`agenerate` run concurrently on a private event loop."""

        per_prompt = list(media) if media is not None else [None] * len(prompts)

        async def all_prompts() -> list[list[Sample]]:
            calls = (
                self.agenerate(p, sampling, **({"media": m} if m is not None else {}))
                for p, m in zip(prompts, per_prompt)
            )
            return list(await asyncio.gather(*calls))

        return asyncio.run(all_prompts())

    async def agenerate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, media: Mapping[str, torch.Tensor] | None = None
    ) -> list[Sample]:
        """The ``sampling.n`` samples of one prompt (token ids in, token ids, behaviour log-probs
        and weight versions out). Safe to await from any event loop and thread. ``media``: the
        prompt's pixel inputs (see :meth:`generate`).

        Default: :meth:`generate` of that one prompt in a worker thread."""
        if type(self).generate is RolloutEngine.generate:
            raise TypeError(f"{type(self).__name__} must implement generate() or agenerate()")
        with_media = {"media": [media]} if media is not None else {}
        groups = await asyncio.to_thread(self.generate, [prompt_ids], sampling, **with_media)
        return groups[0]

    def pause(self, mode: str = "wait") -> None:
        """Stop generating until :meth:`resume`. Requests submitted meanwhile wait (they are not
        lost); requests already running, by ``mode`` (:data:`PAUSE_MODES`):

        - ``wait``: they run to completion before ``pause`` returns;
        - ``keep``: they are frozen where they are and continue after ``resume``;
        - ``abort``: they are interrupted and continued after ``resume`` from the tokens they
          had (the tokens after the interruption carry the version of the weights then loaded).

        Blocks until the engine is paused. Default: nothing to do (an engine that generates only
        inside blocking calls is idle between them)."""

    def resume(self) -> None:
        """Undo :meth:`pause`: waiting and frozen requests go on."""

    def health(self) -> dict[str, bool]:
        """Whether each replica (server) of the engine answers, by name."""
        return {"engine": True}

    @abstractmethod
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load full weights (Hugging Face names) from memory and set the weight version."""

    def update_weights_from_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        """Like :meth:`update_weights`, the weights arriving in buckets (what
        :meth:`TrainEngine.hf_weight_buckets` yields: tensors on any device, possibly sharing storage
        with the trainer's parameters; copy them, keep none). Default: the buckets gathered into one
        state dict on the CPU for :meth:`update_weights`."""
        self.update_weights({k: v.detach().cpu() for bucket in buckets for k, v in bucket.items()}, version)

    @abstractmethod
    def load_weights_from_path(self, path: str | Path, version: int) -> None:
        """Load weights from a Hugging Face directory on disk and set the weight version."""

    def update_weights_collective(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Send full weights (Hugging Face names) from this process to the engine's workers over a
        process group (gloo on CPU, NCCL on GPU) and set the weight version. Only engines listing
        ``collective`` in :attr:`weight_sync_modes` implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not support weight_sync=collective")

    def fingerprint_dtypes(self, names: list[str], dtypes: list[torch.dtype], mode: str) -> list[torch.dtype]:
        """For the sync check: the dtype in which this engine's :meth:`weight_fingerprints` see each
        weight of a ``mode`` update (``rollout.weight_sync``; ``names`` and the sent ``dtypes`` in
        order): the dtype it travelled in, where the trainer cast it before sending (a server's
        collective), or the one the engine holds it in, where it fingerprints its own copy. The
        trainer folds its samples in these. Default: as sent."""
        return list(dtypes)

    #: for the sync check: ``None`` (the default) when :meth:`weight_fingerprints` fingerprints whole
    #: tensors; ``N`` when the engine can read back only each tensor's first rows, those that hold at
    #: least ``N`` elements (:func:`core_rl.sync.fingerprint.prefix_numel`): the trainer then draws
    #: its samples from those rows alone
    fingerprint_prefix: int | None = None

    def weight_fingerprints(self, version: int) -> Mapping[str, Mapping[str, float]] | None:
        """For the sync check (:mod:`core_rl.sync.check`): by replica (server) name, the
        fingerprints (:func:`core_rl.sync.fingerprint.fingerprint` at ``version``) of every tensor
        the last weight update loaded, by Hugging Face name, in the dtype :meth:`fingerprint_dtypes`
        names: computed from the tensors as they arrived (before the engine fused them), or read
        back from what the engine holds (within :attr:`fingerprint_prefix`); an empty mapping for a
        replica whose last update was not of ``version`` (or that has loaded none since it
        started). ``None``: the engine cannot say (the check is then skipped, with a note).
        Default: ``None``."""
        return None

    def release_memory(self) -> None:
        """Give back the accelerator memory generation holds (KV cache, CUDA graphs and, where the
        engine can, the weights), for a trainer on the same devices (``rollout.sleep_while_training``).
        Called with nothing generating and nothing in flight. Until :meth:`restore_memory` of
        ``kv_cache`` the engine must not generate; the weights' contents may be lost: the next weight
        update, which sends every weight, must follow :meth:`restore_memory` of ``weights``.
        Releasing twice is releasing once. Default: nothing held that could be given back."""

    def restore_memory(self, parts: Sequence[str] = MEMORY_PARTS) -> None:
        """Take back what :meth:`release_memory` gave up, for ``parts`` (:data:`MEMORY_PARTS`): the
        trainer restores ``weights`` just before a weight update and ``kv_cache`` just before
        generating, so the cache is not allocated while the update needs memory. A part not
        released is left as it is. Blocks until the memory is back. Default: nothing to restore."""

    def state_dict(self) -> dict[str, Any]:
        """State a resumed run needs to continue exactly, e.g. the engine's own random generator,
        as a state tree (:func:`core_rl.checkpoint.files.save_tree`). Saved in every checkpoint.
        Default: nothing."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (an empty mapping for a checkpoint that holds
        none). Default: nothing to restore."""

    def close(self) -> None:
        """Release resources (stop servers, free memory)."""
