"""The ``sft`` loop: supervised fine-tuning, the negative log-likelihood of the target tokens.

Per step: ``L = -(1 / N) * sum_{b, t} m[b, t] * log pi(x[b, t] | x[b, <t])`` where ``m`` marks the
response tokens (and the prompt's with ``train_on_prompt``) of the step's ``data.batch_size`` rows
and ``N = sum m`` over the whole batch (every rank), so the update does not depend on how rows are
split into micro-batches (packed or padded, ``actor.micro_batch``) or ranks.
"""

from __future__ import annotations

import torch
from core_rl.interfaces import LossOutput
from core_rl.protocol import TensorBatch
from core_rl.trainer.data import PromptItem
from core_rl.trainer.supervised import SupervisedLoop, prompt_response_batch

from core_rl_sft.config import SFTConfig


def nll_loss(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    """Per-token negative log-likelihood; the batch's ``loss_weight`` selects and normalises."""
    return LossOutput(per_token_loss=-logprobs)


nll_loss.entropy_grad = False  # type: ignore[attr-defined]  # the entropy is a metric only


class SFTLoop(SupervisedLoop):
    loop_config: SFTConfig

    def make_batch(self, items: list[PromptItem]) -> TensorBatch:
        key = self.loop_config.response_key
        responses = [self.response_ids(item.row[key], item, key) for item in items]
        batch = prompt_response_batch([item.prompt_ids for item in items], responses, self.pad_token_id)
        mask = batch["attention_mask"].float() if self.loop_config.train_on_prompt else batch["response_mask"]
        if self.loop_config.train_on_prompt:
            mask[:, 0] = 0.0  # the first token has no log-prob
        batch["loss_mask"] = mask
        batch["loss_weight"] = mask / mask.sum().clamp(min=1.0)
        return batch

    def train_batch(self, batch: TensorBatch, step: int) -> dict[str, float]:
        metrics = self.optimizer_step(self.shard_rows(batch), nll_loss, step)
        metrics["sft/loss"] = metrics["actor/loss"]
        metrics["sft/target_tokens"] = float(batch["loss_mask"].sum())
        return metrics
