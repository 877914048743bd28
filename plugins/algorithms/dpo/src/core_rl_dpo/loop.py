"""The ``dpo`` loop: preference optimisation on (prompt, chosen, rejected) rows.

Each step's ``data.batch_size`` pairs become ``2 * P`` rows (the chosen responses, then the rejected
ones in the same order). The per-pair loss is averaged over the ``P`` pairs of the step: either
:func:`core_rl.ops.preference_loss` of the chosen and rejected log-ratios
``log pi(y|x) - log pi_ref(y|x)`` (sequence log-probs summed over the response tokens), or, with
``reference: none``, a reference-free loss (:func:`core_rl.ops.simpo_loss`,
:func:`core_rl.ops.orpo_loss`) of the policy's length-normalised log-probs ``log pi(y|x) / |y|``
(:func:`core_rl.ops.mean_token_logprob`). With ``rpo_alpha > 0`` (RPO) the step's loss also holds
the NLL of the chosen responses as a token mean over every chosen token of the step (all ranks)::

    L = (1/P) * sum_pairs loss_pair + rpo_alpha * (-sum_{chosen i} log pi(y_i|x_i)) / sum_{chosen i} |y_i|

reported as ``dpo/rpo_nll`` (the token-mean NLL; ``dpo/loss`` is the whole ``L``).

It trains through the engine's per-token ``train_step`` on a surrogate whose gradient is the
step's loss's exactly, whatever the split into micro-batches or ranks (:mod:`core_rl_dpo.sequence`);
the reported ``dpo/loss`` is that loss itself.

Under ``torchrun`` rank ``r`` trains pairs ``r, r + W, ...`` (both rows of a pair on one rank;
:class:`core_rl.loops.supervised.pairwise.PairwiseLoop`).
"""

from __future__ import annotations

import torch
from core_rl.data import PromptItem
from core_rl.loops.supervised import global_sum, number_in_row, sequence_batch
from core_rl.ops import (
    log_odds,
    mean_token_logprob,
    orpo_loss,
    preference_loss,
    preference_metrics,
    simpo_loss,
)
from core_rl.protocol import TensorBatch

from core_rl_dpo.config import DPOConfig
from core_rl_dpo.sequence import SequenceLossLoop


def reference_value(item: PromptItem, key: str) -> float:
    """The precomputed reference log-prob in column ``key`` of ``item``'s row; a
    :class:`~core_rl.errors.DataError` naming the column when it holds no number."""
    return number_in_row(
        item,
        key,
        setting="trainer.loop.reference is 'precomputed'",
        remedy="add the reference's sequence log-probs or use reference: model",
    )


class DPOLoop(SequenceLossLoop):
    loop_config: DPOConfig

    @property
    def uses_reference_model(self) -> bool:
        """A frozen reference model with ``reference: model`` only (none with ``precomputed``, ``none``)."""
        return self.loop_config.reference == "model"

    def make_batch(self, items: list[PromptItem]) -> TensorBatch:
        cfg = self.loop_config
        batch = sequence_batch(self.pair_sequences(items), self.pad_token_id)
        batch["loss_mask"] = batch["response_mask"]
        batch["loss_weight"] = batch["response_mask"].clone()
        batch["pair_index"] = torch.arange(len(items)).repeat(2)
        if cfg.reference == "precomputed":
            ref = [reference_value(i, cfg.ref_chosen_key) for i in items]
            ref += [reference_value(i, cfg.ref_rejected_key) for i in items]
            batch["ref_seq_logprob"] = torch.tensor(ref, dtype=torch.float32)
        return batch

    def _reference_logprobs(self, shard: TensorBatch, step: int) -> torch.Tensor:
        if "ref_seq_logprob" in shard:
            return shard["ref_seq_logprob"]
        return self.reference_model_logprobs(shard, step)

    def pair_losses(
        self, shard: TensorBatch, policy: torch.Tensor, ref: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-pair losses ``[P]`` of the shard's pairs from the rows' policy sequence log-probs
        ``policy`` ``[2P]`` (differentiable in it) and the reference's ``ref`` (``None`` for the
        reference-free losses), and the per-pair values to report."""
        cfg = self.loop_config
        mine = shard.batch_size // 2
        if ref is not None:
            logratio = policy - ref
            chosen, rejected = logratio[:mine], logratio[mine:]
            losses = preference_loss(
                chosen,
                rejected,
                loss_type=cfg.loss_type,
                beta=cfg.beta,
                label_smoothing=cfg.label_smoothing,
                discopop_tau=cfg.discopop_tau,
            )
            return losses, preference_metrics(chosen, rejected, policy[:mine], policy[mine:], beta=cfg.beta)
        mean = mean_token_logprob(policy, shard["loss_mask"].sum(dim=-1))
        chosen, rejected = mean[:mine], mean[mine:]
        if cfg.loss_type == "simpo":
            losses = simpo_loss(
                chosen, rejected, beta=cfg.beta, gamma=cfg.simpo_gamma, label_smoothing=cfg.label_smoothing
            )
            scale, extra = cfg.beta, {}
        else:
            losses = orpo_loss(chosen, rejected, lam=cfg.orpo_lambda)
            odds_ratio = (log_odds(chosen) - log_odds(rejected)).detach()
            scale, extra = cfg.orpo_lambda, {"nll": -chosen.detach(), "log_odds/margin": odds_ratio}
        values = preference_metrics(chosen, rejected, policy[:mine], policy[mine:], beta=scale)
        values.update({"logps_mean/chosen": chosen.detach(), "logps_mean/rejected": rejected.detach(), **extra})
        return losses, values

    def train_batch(self, batch: TensorBatch, step: int) -> dict[str, float]:
        num_pairs = batch.batch_size // 2
        shard = self.shard_rows(batch)
        ref = None if self.loop_config.reference_free else self._reference_logprobs(shard, step)
        policy = self.policy_logprobs(shard, step)
        losses, values = self.pair_losses(shard, policy, ref)
        loss, loss_sum = losses.sum() / num_pairs, losses.detach().sum()
        alpha = self.loop_config.rpo_alpha
        if alpha > 0:
            nll = chosen_nll_share(policy, shard["loss_mask"])
            loss = loss + alpha * nll
            loss_sum = loss_sum + alpha * nll.detach() * num_pairs
            values["rpo_nll"] = nll.detach().reshape(1) * num_pairs  # summed over ranks, / P below
        metrics = self.train_on_loss(shard, loss, policy, step)
        names = ["loss", *values]
        sums = torch.stack([loss_sum, *(v.sum() for v in values.values())]).float()
        sums = global_sum(sums) / num_pairs
        metrics.update({f"dpo/{name}": float(v) for name, v in zip(names, sums)})
        metrics["actor/loss"] = metrics["dpo/loss"]  # the engine's is the surrogate's value
        return metrics


def chosen_nll_share(policy: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """This rank's share of the step's token-mean NLL of the chosen responses (the first half of
    the rows): ``-sum_{chosen i here} policy_i / N`` with ``N`` the chosen tokens of the step on all
    ranks, so the shares add up to ``-sum_{chosen i} log pi(y_i|x_i) / N`` (differentiable in
    ``policy``, the rows' sequence log-probs ``[2P]``)."""
    mine = policy.shape[0] // 2
    n_tokens = global_sum(loss_mask[:mine].sum().float().reshape(1)).clamp(min=1.0)
    return -policy[:mine].sum() / n_tokens[0]
