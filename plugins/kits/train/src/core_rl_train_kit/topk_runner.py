"""The top-k part of :class:`~core_rl_train_kit.runner.MicroBatchRunner` (``teacher.loss:
topk_forward_kl``, :mod:`core_rl.loops.rl.distill`): a teacher's top-k ids and log-probs per token
(:func:`~core_rl_train_kit.packed.forward_topk`) and, in a training forward, the policy's
log-probs of given ids (:func:`~core_rl_train_kit.packed.forward_logprobs_at`), which a loss asks
for with ``logprobs_at_key`` and reads at :data:`core_rl.interfaces.LOGPROBS_AT`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from core_rl.errors import ConfigError
from core_rl.interfaces import LOGPROBS_AT
from core_rl.protocol import TensorBatch
from torch import nn

from core_rl_train_kit.packed import forward_logprobs_at, forward_topk
from core_rl_train_kit.ulysses import SequenceGroup


class TopkForwards:
    """Mixed into :class:`~core_rl_train_kit.runner.MicroBatchRunner`, whose state it reads."""

    model: nn.Module
    head: str
    fused_head: bool
    sequence: SequenceGroup | None
    base_layout: str
    varlen_kwargs: bool
    _precision: Callable[[], contextlib.AbstractContextManager[object]]
    _eval_rows: Callable[..., list[torch.Tensor]]

    def _check_topk(self, what: str) -> None:
        """Top-k log-probs need the whole logits of a language model on one rank: not a scalar head,
        the fused head or a sequence-parallel group (a :class:`~core_rl.errors.ConfigError`)."""
        if self.head != "lm":
            raise ConfigError(f"{what} needs a language model (head='lm'), this engine has head={self.head!r}")
        if self.fused_head:
            raise ConfigError(f"{what} needs the logits, which the fused head never forms; set fused_head: false")
        if self.sequence is not None:
            raise ConfigError(f"{what} is not computed over a sequence-parallel group; set sequence_parallel_size: 1")

    def topk_logprobs(
        self, batch: TensorBatch, k: int, temperature: float, vocab_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely tokens (among the first ``vocab_size``) of the prediction of every
        token: ids ``[B, T, k]`` long and log-probs ``[B, T, k]`` float32 on CPU
        (:func:`~core_rl_train_kit.packed.forward_topk`), in eval mode without gradients. Collective."""
        self._check_topk("top-k log-probs")

        def forward(ids: torch.Tensor, mask: torch.Tensor, _units: object) -> tuple[torch.Tensor, ...]:
            with self._precision():
                return forward_topk(
                    self.model,
                    ids,
                    mask,
                    k,
                    temperature=temperature,
                    vocab_size=vocab_size,
                    layout=self.base_layout,
                    varlen_kwargs=self.varlen_kwargs,
                )

        # padded (or packed): the rows of the shared layout would share their prompts' positions
        top_ids, values = self._eval_rows(batch, temperature, [torch.long, torch.float32], forward, (k,), share=False)
        return top_ids, values

    def _forward_at(
        self, mb: TensorBatch, key: str, temperature: float, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` of a training micro-batch that also sets ``mb[LOGPROBS_AT]``: the log-probs
        (with gradient) of the tokens ``mb[key]`` ``[b, width, k]`` (a loss's ``logprobs_at_key``)."""
        self._check_topk(f"a loss asking for the log-probs of batch[{key!r}]")
        with self._precision():
            lp, ent, at = forward_logprobs_at(
                self.model,
                mb["input_ids"],
                mb["attention_mask"],
                mb[key],
                temperature=temperature,
                with_entropy=True,
                entropy_grad=entropy_grad,
                layout=self.base_layout,
                varlen_kwargs=self.varlen_kwargs,
            )
        mb[LOGPROBS_AT] = at
        return lp, ent
