"""The ``dpo`` loop: preference optimisation on (prompt, chosen, rejected) rows.

Each step's ``data.batch_size`` pairs become ``2 * P`` rows (the chosen responses, then the rejected
ones in the same order). The per-pair loss is averaged over the ``P`` pairs of the step: either
:func:`core_rl.ops.preference_loss` of the chosen and rejected log-ratios
``log pi(y|x) - log pi_ref(y|x)`` (sequence log-probs summed over the response tokens), or, with
``reference: none``, a reference-free loss (:func:`core_rl.ops.simpo_loss`,
:func:`core_rl.ops.orpo_loss`) of the policy's length-normalised log-probs ``log pi(y|x) / |y|``
(:func:`core_rl.ops.mean_token_logprob`).

How it trains through the engine's per-token ``train_step``: the loss of a pair is a non-linear
function of two sequence log-probs that may land in different micro-batches, so the loop first
computes every row's sequence log-prob with the current weights (``compute_logprobs``, no gradient),
then the derivative ``c_i = dL/d log pi(y_i|x_i)`` of the step's loss for every row (autograd through
the same loss; through the division by ``|y|`` too for the reference-free ones), and trains on
the per-token loss ``c_i * log pi(y_i[t] | ...)`` over the response tokens. Its gradient is
``sum_i c_i * grad log pi(y_i|x_i) = grad L`` exactly (chain rule), whatever the split into
micro-batches or ranks; the reported ``dpo/loss`` is ``L`` itself. (Exact for models without
dropout; with dropout the coefficients come from the model in eval mode.) The price is one forward
pass without gradient per step.

Under ``torchrun`` rank ``r`` trains pairs ``r, r + W, ...`` (both rows of a pair on one rank;
:class:`core_rl.trainer.preference.PairwiseLoop`).
"""

from __future__ import annotations

import torch
from core_rl.interfaces import LossOutput, TrainEngine
from core_rl.ops import (
    log_odds,
    mean_token_logprob,
    orpo_loss,
    preference_loss,
    preference_metrics,
    sequence_logprob,
    simpo_loss,
)
from core_rl.protocol import TensorBatch
from core_rl.registry import RegistryEntry
from core_rl.roles import build_engine
from core_rl.trainer.data import PromptItem
from core_rl.trainer.preference import PairwiseLoop, number_in_row
from core_rl.trainer.ranks import waiting_for
from core_rl.trainer.supervised import global_sum, prompt_response_batch

from core_rl_dpo.config import DPOConfig


def surrogate_loss(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    """``pair_coef[b] * logprobs[b, t]``: with ``loss_weight`` = the response mask, its gradient is
    the preference loss's (see the module docstring)."""
    return LossOutput(per_token_loss=batch["pair_coef"].unsqueeze(1) * logprobs)


surrogate_loss.entropy_grad = False  # type: ignore[attr-defined]  # the entropy is a metric only


def reference_value(item: PromptItem, key: str) -> float:
    """The precomputed reference log-prob in column ``key`` of ``item``'s row; a
    :class:`~core_rl.errors.DataError` naming the column when it holds no number."""
    return number_in_row(
        item,
        key,
        setting="trainer.loop.reference is 'precomputed'",
        remedy="add the reference's sequence log-probs or use reference: model",
    )


class DPOLoop(PairwiseLoop):
    loop_config: DPOConfig
    ref_engine: TrainEngine | None = None

    def build_models(self, engine_entry: RegistryEntry) -> None:
        """The frozen reference (none with ``reference: precomputed`` or ``none``): the run's ``ref:`` role
        when the config has one, else the actor's starting model, built by its train engine with
        ``trainable=False`` (:func:`core_rl.roles.build_engine`)."""
        if self.loop_config.reference == "model":
            self.ref_engine = build_engine(
                self.host, self.cfg.ref or self.cfg.actor, trainable=False, built=self.built_engines, role="ref"
            )

    def make_batch(self, items: list[PromptItem]) -> TensorBatch:
        cfg = self.loop_config
        prompts, chosen, rejected = self.pair_ids(items)
        batch = prompt_response_batch(prompts + prompts, chosen + rejected, self.pad_token_id)
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
        assert self.ref_engine is not None
        with waiting_for(f"the other ranks in the reference log-probs of step {step}"):
            return sequence_logprob(self.ref_engine.compute_logprobs(shard), shard["loss_mask"])

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
                chosen, rejected, loss_type=cfg.loss_type, beta=cfg.beta, label_smoothing=cfg.label_smoothing
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
        with waiting_for(f"the other ranks in the policy log-probs of step {step}"):
            policy = sequence_logprob(self.engine.compute_logprobs(shard), shard["loss_mask"])
        policy = policy.detach().requires_grad_(True)
        losses, values = self.pair_losses(shard, policy, ref)
        (coef,) = torch.autograd.grad(losses.sum() / num_pairs, policy)
        shard["pair_coef"] = coef.detach()
        metrics = self.optimizer_step(shard, surrogate_loss, step)
        names = ["loss", *values]
        sums = torch.stack([losses.detach().sum(), *(v.sum() for v in values.values())]).float()
        sums = global_sum(sums) / num_pairs
        metrics.update({f"dpo/{name}": float(v) for name, v in zip(names, sums)})
        metrics["actor/loss"] = metrics["dpo/loss"]  # the engine's is the surrogate's value
        return metrics

    def close(self) -> None:
        if self.ref_engine is not None:
            self.ref_engine.close()
            self.ref_engine = None
        super().close()
