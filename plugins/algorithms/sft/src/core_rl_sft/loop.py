"""The ``sft`` loop: supervised fine-tuning, the negative log-likelihood of the target tokens.

Per step: ``L = -(1 / N) * sum_{b, t} m[b, t] * log pi(x[b, t] | x[b, <t])`` where ``m`` marks the
response tokens (and the prompt's with ``train_on_prompt``; with ``conversations``, the tokens of
every assistant turn) of the step's ``data.batch_size`` rows and ``N = sum m`` over the whole batch
(every rank), so the update does not depend on how rows are split into micro-batches (packed or
padded, ``actor.micro_batch``) or ranks.
"""

from __future__ import annotations

import torch
from core_rl.data import PromptItem
from core_rl.errors import DataError
from core_rl.interfaces import LossOutput
from core_rl.loops.supervised import SupervisedLoop, TrainSequence, sequence_batch
from core_rl.protocol import TensorBatch

from core_rl_sft.config import SFTConfig


def nll_loss(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    """Per-token negative log-likelihood; the batch's ``loss_weight`` selects and normalises."""
    return LossOutput(per_token_loss=-logprobs)


nll_loss.entropy_grad = False  # type: ignore[attr-defined]  # the entropy is a metric only


class SFTLoop(SupervisedLoop):
    loop_config: SFTConfig

    def _build(self) -> None:
        super()._build()
        #: with ``conversations``: each prompt item's rendered conversation (cut to ``data.max_length``)
        self.conversations: dict[int, TrainSequence] = {}
        if self.loop_config.conversations:
            self._render_conversations()

    def _render_conversations(self) -> None:
        """Render every row's conversation once, before the first step; every row that cannot be
        trained on (no assistant turn, a template that rewrites earlier turns) is one problem."""
        problems = []
        for item in self.data.items:
            try:
                (self.conversations[id(item)],) = super().sequences(item)
            except DataError as exc:
                problems.extend(exc.problems)
        if problems:
            raise DataError(problems[:10] + ([f"and {len(problems) - 10} more"] if len(problems) > 10 else []))

    def sequences(self, item: PromptItem) -> list[TrainSequence]:
        if self.loop_config.conversations:
            return [self.conversations[id(item)]]
        return super().sequences(item)

    def make_batch(self, items: list[PromptItem]) -> TensorBatch:
        batch = sequence_batch([s for item in items for s in self.sequences(item)], self.pad_token_id)
        if self.loop_config.train_on_prompt:
            mask = batch["attention_mask"].float()
            mask[:, 0] = 0.0  # the first token has no log-prob
        else:
            mask = batch["response_mask"]
        batch["loss_mask"] = mask
        batch["loss_weight"] = mask / mask.sum().clamp(min=1.0)
        return batch

    def train_batch(self, batch: TensorBatch, step: int) -> dict[str, float]:
        metrics = self.optimizer_step(self.shard_rows(batch), nll_loss, step)
        metrics["sft/loss"] = metrics["actor/loss"]
        metrics["sft/target_tokens"] = float(batch["loss_mask"].sum())
        return metrics
