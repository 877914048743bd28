"""What the ``dpo`` and ``kto`` loops share: a loss of whole-sequence log-probs trained through the
engine's per-token ``train_step``, and the frozen reference model.

How such a loss trains: the loss of a step is a non-linear function of sequence log-probs
``log pi(y_i|x_i)`` (summed over the response tokens) that may land in different micro-batches, so
the loop first computes every row's sequence log-prob with the current weights
(``compute_logprobs``, no gradient), then the derivative ``c_i = dL/d log pi(y_i|x_i)`` of the step's
loss for every row (autograd through the loss), and trains on the per-token loss
``c_i * log pi(y_i[t] | ...)`` over the response tokens. Its gradient is
``sum_i c_i * grad log pi(y_i|x_i) = grad L`` exactly (chain rule), whatever the split into
micro-batches or ranks. (Exact for models without dropout; with dropout the coefficients come from
the model in eval mode.) The price is one forward pass without gradient per step.
"""

from __future__ import annotations

import torch
from core_rl.interfaces import LossOutput, TrainEngine
from core_rl.launch import rank_and_world, waiting_for
from core_rl.loops import ReferenceReset
from core_rl.loops.supervised import PairwiseLoop
from core_rl.ops import sequence_logprob
from core_rl.plugins import RegistryEntry
from core_rl.protocol import TensorBatch
from core_rl.roles import build_engine


def surrogate_loss(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    """``pair_coef[b] * logprobs[b, t]``: with ``loss_weight`` = the response mask, its gradient is
    the sequence loss's (see the module docstring)."""
    return LossOutput(per_token_loss=batch["pair_coef"].unsqueeze(1) * logprobs)


surrogate_loss.entropy_grad = False  # type: ignore[attr-defined]  # the entropy is a metric only


class SequenceLossLoop(PairwiseLoop):
    """A :class:`~core_rl.loops.supervised.pairwise.PairwiseLoop` whose loss reads sequence log-probs (see
    the module docstring), with a frozen reference model where :attr:`uses_reference_model`."""

    ref_engine: TrainEngine | None = None

    @property
    def uses_reference_model(self) -> bool:
        """Whether the loop builds a frozen reference model (default: yes)."""
        return True

    def build_models(self, engine_entry: RegistryEntry) -> None:
        """The frozen reference, where :attr:`uses_reference_model`: the run's ``ref:`` role when the
        config has one, else the actor's starting model, built by its train engine with
        ``trainable=False`` (:func:`core_rl.roles.build.build_engine`); with
        ``algorithm.reference_reset_every_n_steps`` it is reset (or, with
        ``algorithm.reference_reset_alpha`` < 1, mixed with the policy: TR-DPO) after every such step,
        as the rl loop's (:mod:`core_rl.loops.rl.reference_reset`)."""
        if self.uses_reference_model:
            self.ref_engine = build_engine(
                self.host, self.cfg.ref or self.cfg.actor, trainable=False, built=self.built_engines, role="ref"
            )
        self.ref = self.ref_engine  # what the trainer hands reference_reset (closed here, in close())
        if self.cfg.algorithm.reference_reset_every_n_steps:  # the dpo loop's config allows it (TR-DPO)
            is_main = rank_and_world()[0] == 0
            self.reference_reset = ReferenceReset.of_run(self.cfg, self.host, self.ref_engine, is_main, self.engine)

    def _use_reference(self, ref: TrainEngine | None) -> None:
        """The reference engine a reset built (:mod:`core_rl.loops.rl.reference_reset`)."""
        self.ref = self.ref_engine = ref

    def reference_model_logprobs(self, shard: TensorBatch, step: int) -> torch.Tensor:
        """The reference model's sequence log-probs ``[B]`` of ``shard``'s rows over ``loss_mask``."""
        assert self.ref_engine is not None
        with waiting_for(f"the other ranks in the reference log-probs of step {step}"):
            return sequence_logprob(self.ref_engine.compute_logprobs(shard), shard["loss_mask"])

    def policy_logprobs(self, shard: TensorBatch, step: int) -> torch.Tensor:
        """The policy's sequence log-probs ``[B]`` of ``shard``'s rows over ``loss_mask`` with the
        current weights, as a leaf that requires grad (the loss is differentiated in it)."""
        with waiting_for(f"the other ranks in the policy log-probs of step {step}"):
            policy = sequence_logprob(self.engine.compute_logprobs(shard), shard["loss_mask"])
        return policy.detach().requires_grad_(True)

    def train_on_loss(
        self, shard: TensorBatch, loss: torch.Tensor, policy: torch.Tensor, step: int
    ) -> dict[str, float]:
        """One optimiser step whose gradient is ``loss``'s: ``loss`` (this rank's share of the step's
        loss, a scalar) is differentiated in ``policy`` (:meth:`policy_logprobs` of ``shard``'s rows)
        for the coefficients of :func:`surrogate_loss`, trained over ``shard``'s ``loss_weight``."""
        (coef,) = torch.autograd.grad(loss, policy)
        shard["pair_coef"] = coef.detach()
        return self.optimizer_step(shard, surrogate_loss, step)

    def close(self) -> None:
        if self.ref_engine is not None:
            self.ref_engine.close()
            self.ref_engine = None
        super().close()
