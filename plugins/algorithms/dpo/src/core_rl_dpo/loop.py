"""The ``dpo`` loop: preference optimisation on (prompt, chosen, rejected) rows.

Each step's ``data.batch_size`` pairs become ``2 * P`` rows (the chosen responses, then the rejected
ones in the same order). The per-pair loss :func:`core_rl.ops.preference_loss` of the chosen and
rejected log-ratios ``log pi(y|x) - log pi_ref(y|x)`` (sequence log-probs summed over the response
tokens) is averaged over the ``P`` pairs of the step.

How it trains through the engine's per-token ``train_step``: the loss of a pair is a non-linear
function of two sequence log-probs that may land in different micro-batches, so the loop first
computes every row's sequence log-prob with the current weights (``compute_logprobs``, no gradient),
then the derivative ``c_i = dL/d log pi(y_i|x_i)`` of the step's loss for every row (autograd through
the same :func:`~core_rl.ops.preference_loss`), and trains on the per-token loss
``c_i * log pi(y_i[t] | ...)`` over the response tokens. Its gradient is
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
from core_rl.ops import preference_loss, preference_metrics, sequence_logprob
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
        """The frozen reference (none with ``reference: precomputed``): the run's ``ref:`` role
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

    def train_batch(self, batch: TensorBatch, step: int) -> dict[str, float]:
        cfg = self.loop_config
        num_pairs = batch.batch_size // 2
        shard = self.shard_rows(batch)
        mine = shard.batch_size // 2
        ref = self._reference_logprobs(shard, step)
        with waiting_for(f"the other ranks in the policy log-probs of step {step}"):
            policy = sequence_logprob(self.engine.compute_logprobs(shard), shard["loss_mask"])
        policy = policy.detach().requires_grad_(True)
        logratio = policy - ref
        losses = preference_loss(
            logratio[:mine],
            logratio[mine:],
            loss_type=cfg.loss_type,
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
        )
        (coef,) = torch.autograd.grad(losses.sum() / num_pairs, policy)
        shard["pair_coef"] = coef.detach()
        metrics = self.optimizer_step(shard, surrogate_loss, step)
        values = preference_metrics(logratio[:mine], logratio[mine:], policy[:mine], policy[mine:], beta=cfg.beta)
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
