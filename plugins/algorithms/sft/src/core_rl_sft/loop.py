"""The ``sft`` loop: supervised fine-tuning, the negative log-likelihood of the target tokens.

Per step: ``L = -(1 / N) * sum_{b, t} m[b, t] * log pi(x[b, t] | x[b, <t])`` where ``m`` marks the
response tokens (and the prompt's with ``train_on_prompt``; with ``conversations``, the tokens of
every assistant turn) of the step's ``data.batch_size`` rows and ``N = sum m`` over the whole batch
(every rank), so the update does not depend on how rows are split into micro-batches (packed or
padded, ``actor.micro_batch``) or ranks.
"""

from __future__ import annotations

import torch
from core_rl.chat_template import prompt_messages, render_conversation
from core_rl.errors import DataError
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

    def _build(self) -> None:
        super()._build()
        #: with ``conversations``: each prompt item's whole conversation, ``(token ids, assistant mask)``
        self.conversations: dict[int, tuple[list[int], list[bool]]] = {}
        if self.loop_config.conversations:
            self._render_conversations()

    def _render_conversations(self) -> None:
        """Render every row's conversation once, before the first step; every row that cannot be
        trained on (no assistant turn, a template that rewrites earlier turns) is one problem."""
        data, problems = self.cfg.data, []
        for item in self.data.items:
            messages = prompt_messages(item.row[data.prompt_key], data.system_prompt)
            try:
                self.conversations[id(item)] = render_conversation(self.tokenizer, messages, data.chat_template_kwargs)
            except ValueError as exc:
                where = item.where or f"data row {item.text[:60]!r}"
                problems.append(f"{where}: column {data.prompt_key!r}: {exc}")
        if problems:
            raise DataError(problems[:10] + ([f"and {len(problems) - 10} more"] if len(problems) > 10 else []))

    def make_batch(self, items: list[PromptItem]) -> TensorBatch:
        if self.loop_config.conversations:
            batch = self._conversation_batch(items)
            mask = batch["response_mask"]
        else:
            key = self.loop_config.response_key
            responses = [self.response_ids(item.row[key], item, key) for item in items]
            batch = prompt_response_batch([item.prompt_ids for item in items], responses, self.pad_token_id)
            mask = batch["attention_mask"].float() if self.loop_config.train_on_prompt else batch["response_mask"]
            if self.loop_config.train_on_prompt:
                mask[:, 0] = 0.0  # the first token has no log-prob
        batch["loss_mask"] = mask
        batch["loss_weight"] = mask / mask.sum().clamp(min=1.0)
        return batch

    def _conversation_batch(self, items: list[PromptItem]) -> TensorBatch:
        """Rows split before each conversation's first assistant token (the prompt), with
        ``response_mask`` 1.0 exactly on the assistant turns' tokens."""
        rendered = [self.conversations[id(item)] for item in items]
        firsts = [mask.index(True) for _, mask in rendered]
        batch = prompt_response_batch(
            [ids[:first] for (ids, _), first in zip(rendered, firsts)],
            [ids[first:] for (ids, _), first in zip(rendered, firsts)],
            self.pad_token_id,
        )
        for row, (ids, mask) in enumerate(rendered):
            batch["response_mask"][row, : len(ids)] = torch.tensor(mask, dtype=torch.float32)
        return batch

    def train_batch(self, batch: TensorBatch, step: int) -> dict[str, float]:
        metrics = self.optimizer_step(self.shard_rows(batch), nll_loss, step)
        metrics["sft/loss"] = metrics["actor/loss"]
        metrics["sft/target_tokens"] = float(batch["loss_mask"].sum())
        return metrics
