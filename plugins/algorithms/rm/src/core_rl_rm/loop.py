"""The ``rm`` loop: pairwise Bradley-Terry reward-model training on (prompt, chosen, rejected) rows.

The model is the actor's backbone with a scalar head without bias (the train engine's ``score``
head: Hugging Face's ``*ForTokenClassification`` with one output and no bias, exported as
``*ForSequenceClassification`` with the same weights). The *score* ``s(x, y)`` of a prompt and
response is the head's output at the last token of ``prompt + response`` (no EOS is added), which
is what a sequence classifier reads on the same text, so the exported model served by the
``reward_model`` reward gives the trained scores.

The engine's values are aligned like log-probs (position ``t`` holds the output at ``t - 1``), so
each row is ``prompt + response + one slot token`` (the pad id, attended to): the value at the slot
is the output at the last real token. A causal model's output there does not depend on the slot.

Per step, over the ``P = data.batch_size`` pairs: ``L = (1/P) sum_i l_i`` with ``l_i`` the
:func:`core_rl.ops.bradley_terry_loss` of ``(s_w, s_l)`` (optional margin column, label smoothing,
score centering). It trains through the engine's per-token value step like the ``dpo`` loop: the
scores are computed without gradient, ``c_i = dL/ds_i`` by autograd, and the value step minimises
``sum_i c_i * s_i`` (the slot's value times ``c_i``), whose gradient is ``grad L`` exactly, whatever
the split into micro-batches or ranks; ``rm/loss`` reports ``L`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from core_rl.data import PromptItem
from core_rl.errors import ConfigError
from core_rl.interfaces import LossOutput
from core_rl.launch import waiting_for
from core_rl.loops.supervised import PairwiseLoop, global_sum, number_in_row, prompt_response_batch
from core_rl.ops import bradley_terry_loss
from core_rl.plugins import TRAIN_ENGINE
from core_rl.protocol import TensorBatch
from core_rl.roles import engine_heads, missing_head_problem

from core_rl_rm.config import RMConfig

#: the per-pair values reported as ``rm/<name>`` (training) and ``rm/val/<name>`` (held-out pairs)
PAIR_METRICS = ("loss", "accuracy", "scores/chosen", "scores/rejected", "scores/margin")


def score_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_token_id: int) -> TensorBatch:
    """Right-padded rows ``prompt + response + [slot]`` (the slot is ``pad_token_id``, attended
    to), with ``score_mask`` 1.0 at each row's slot: the position whose value is the row's score."""
    batch = prompt_response_batch(prompts, [[*r, pad_token_id] for r in responses], pad_token_id)
    slot = batch["attention_mask"].sum(1) - 1
    score_mask = torch.zeros_like(batch["response_mask"])
    score_mask[torch.arange(len(slot)), slot] = 1.0
    batch["score_mask"] = score_mask
    return batch


def slot_loss(batch: TensorBatch, values: torch.Tensor) -> LossOutput:
    """``score_coef[b] * values[b, t]``: with ``loss_weight`` = the slot mask, its gradient is the
    pair loss's (see the module docstring)."""
    return LossOutput(per_token_loss=batch["score_coef"].unsqueeze(1) * values)


def pair_values(chosen: torch.Tensor, rejected: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """``[len(PAIR_METRICS), P]``: each pair's loss, whether the chosen score is higher (0/1), the
    two scores and their difference."""
    chosen, rejected = chosen.detach(), rejected.detach()
    return torch.stack([losses.detach(), (chosen > rejected).float(), chosen, rejected, chosen - rejected]).float()


class RMLoop(PairwiseLoop):
    loop_config: RMConfig
    actor_head = "score"
    val_items: list[PromptItem]

    def _build(self) -> None:
        entry = self.host.get(TRAIN_ENGINE, self.cfg.actor.engine.name)
        if "score" not in engine_heads(entry):
            raise ConfigError([missing_head_problem(entry, "score", "actor.engine.name", "a reward model")])
        super()._build()
        files = self.loop_config.val_files
        self.val_items = self.read_pairs(files, key="trainer.loop.val_files") if files else []

    # -- data -----------------------------------------------------------------------------------

    def make_batch(self, items: list[PromptItem]) -> TensorBatch:
        rows = self.pair_sequences(items)
        batch = score_batch([s.prompt for s in rows], [s.response for s in rows], self.pad_token_id)
        batch["loss_mask"] = batch["score_mask"]
        batch["loss_weight"] = batch["score_mask"].clone()
        margins = [self.margin(item) for item in items]
        batch["pair_margin"] = torch.tensor(margins + margins, dtype=torch.float32)
        return batch

    def margin(self, item: PromptItem) -> float:
        """The pair's required margin (column ``margin_key``; 0 without one); a
        :class:`~core_rl.errors.DataError` naming the column when it holds no number."""
        key = self.loop_config.margin_key
        if key is None:
            return 0.0
        return number_in_row(
            item, key, setting=f"trainer.loop.margin_key is {key!r}", remedy="add it to every row or remove margin_key"
        )

    # -- scores and loss --------------------------------------------------------------------------

    def scores(self, shard: TensorBatch, what: str) -> torch.Tensor:
        """Each row's score ``[b]`` with the current weights (no gradient; collective)."""
        with waiting_for(f"the other ranks in {what}"):
            values = self.engine.compute_values(shard)
        return (values * shard["score_mask"]).sum(1)

    def pair_losses(self, scores: torch.Tensor, shard: TensorBatch) -> torch.Tensor:
        cfg, mine = self.loop_config, shard.batch_size // 2
        return bradley_terry_loss(
            scores[:mine],
            scores[mine:],
            margin=shard["pair_margin"][:mine],
            label_smoothing=cfg.label_smoothing,
            center_coef=cfg.center_coef,
        )

    def train_batch(self, batch: TensorBatch, step: int) -> dict[str, float]:
        num_pairs = batch.batch_size // 2
        shard = self.shard_rows(batch)
        mine = shard.batch_size // 2
        scores = self.scores(shard, f"the scores of step {step}").requires_grad_(True)
        losses = self.pair_losses(scores, shard)
        (coef,) = torch.autograd.grad(losses.sum() / num_pairs, scores)
        shard["score_coef"] = coef.detach()
        metrics = self.optimizer_step(shard, slot_loss, step)
        sums = global_sum(pair_values(scores[:mine], scores[mine:], losses).sum(1)) / num_pairs
        metrics.update({f"rm/{name}": float(v) for name, v in zip(PAIR_METRICS, sums)})
        metrics["actor/loss"] = metrics["rm/loss"]  # the engine's is the surrogate's value
        return metrics

    # -- held-out pairs ---------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """``rm/val/<name>`` of :data:`PAIR_METRICS`, means over every held-out pair (collective)."""
        cfg = self.loop_config
        sums = torch.zeros(len(PAIR_METRICS))
        for start in range(0, len(self.val_items), cfg.eval_batch_size):
            shard = self.shard_rows(self.make_batch(self.val_items[start : start + cfg.eval_batch_size]))
            mine = shard.batch_size // 2
            scores = self.scores(shard, "the scores of the held-out pairs")
            sums += pair_values(scores[:mine], scores[mine:], self.pair_losses(scores, shard)).sum(1)
        sums = global_sum(sums) / len(self.val_items)
        return {f"rm/val/{name}": float(v) for name, v in zip(PAIR_METRICS, sums)}

    def step(self, step: int) -> dict[str, float]:
        metrics = super().step(step)
        every = self.loop_config.eval_every_n_steps
        if self.val_items and (step == self.cfg.trainer.total_steps or (every and step % every == 0)):
            metrics.update(self.evaluate())
        return metrics
