"""The ``prompt_lm`` training loop: language-model training on the prompt column's text.

Built on core-rl's supervised-loop base (:class:`core_rl.loops.supervised.loop.SupervisedLoop`), which
brings data order and exact resume, loggers and ``metrics.jsonl``, checkpoints, signals and the
final export; the loop only says what a batch is and how it trains. The loss is the mean negative
log-likelihood of every token after the first, over the step's rows (all ranks)."""

from __future__ import annotations

import torch
from core_rl.data import PromptItem
from core_rl.interfaces import LossOutput
from core_rl.loops.supervised import SupervisedLoop, prompt_response_batch
from core_rl.protocol import TensorBatch

from core_rl_example_plugin.config import PromptLMConfig


def next_token_loss(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs)


class PromptLMLoop(SupervisedLoop):
    loop_config: PromptLMConfig

    def make_batch(self, items: list[PromptItem]) -> TensorBatch:
        # the whole text is the "response" of an empty prompt, except its first token (no log-prob)
        texts = [item.prompt_ids[: self.loop_config.max_tokens] for item in items]
        batch = prompt_response_batch([t[:1] for t in texts], [t[1:] for t in texts], self.pad_token_id)
        batch["loss_weight"] = batch["response_mask"] / batch["response_mask"].sum().clamp(min=1.0)
        return batch

    def train_batch(self, batch: TensorBatch, step: int) -> dict[str, float]:
        return self.optimizer_step(self.shard_rows(batch), next_token_loss, step)
