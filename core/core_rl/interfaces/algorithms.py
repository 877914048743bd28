"""The algorithm components' contracts: advantage estimators, policy losses, rejection samplers, sample
filters, and named algorithm recipes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:  # torch is imported by the components themselves, not by their registration
    import torch

    from core_rl.protocol import TensorBatch


from core_rl.interfaces.engines import LossOutput


class AdvantageEstimator(ABC):
    """Turns rewards (and whatever else the batch holds) into per-token advantages.

    An estimator with ``requires_values`` (e.g. GAE) needs a critic, one with ``requires_reference``
    (e.g. a KL penalty in its reward, :mod:`core_rl.ops.kl_reward`) a reference model: the trainer calls
    either on every rank in the update, once the critic's ``values`` and the ``ref_logprobs`` are in
    the batch, instead of on the main rank before the update (every rank then calls it with the
    same global batch, so its state stays the same on each). With values it may also set
    ``batch["returns"]`` (the value targets). Its :meth:`state_dict` is saved in checkpoints."""

    #: whether the batch must carry ``values`` from a critic (a ``critic:`` section is then required)
    requires_values: bool = False
    #: whether the batch must carry ``ref_logprobs`` (a reference model is then built)
    requires_reference: bool = False

    def state_dict(self) -> dict[str, Any]:
        """State a resumed run needs (e.g. an adaptive coefficient). Default: none."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. Default: nothing."""

    @abstractmethod
    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        """Advantages [B, T], zero off the response mask. Reads ``rewards``, ``group_index`` and
        ``response_mask`` at least."""


class PolicyLoss(ABC):
    """The per-token policy objective and how it is aggregated over the batch."""

    #: whether the batch must carry ``ref_logprobs`` (a reference model is then built)
    requires_reference: bool = False
    #: whether the trainer must recompute ``old_logprobs`` with the train engine before the first
    #: update of each step (e.g. the proximal policy of a decoupled loss); see also
    #: ``algorithm.recompute_logprob``. Read at every step: a loss may make it a property that
    #: changes with :meth:`set_rejection_sampler` (a correction turned on mid-run)
    requires_recompute: bool = False
    #: whether the loss differentiates through the entropy it is given (an entropy bonus). When
    #: ``False``, engines compute the entropy (still a metric) without gradient, so its
    #: ``[tokens, vocabulary]`` probabilities are freed at once instead of kept for backward. A
    #: plain loss function may carry the attribute too; absent, engines assume ``True``.
    entropy_grad: bool = True

    @abstractmethod
    def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:
        """Aggregation weights [B, T] for the *global* batch (of one optimiser step) from the mask of
        the tokens that train (the batch's ``loss_mask``; see :func:`core_rl.ops.aggregation_weights`)."""

    def prepare(self, batch: TensorBatch) -> dict[str, float]:
        """Called once per RL step on the whole global batch (identical on every rank), after
        ``old_logprobs`` are final and before the batch is split into optimiser steps. It may
        update ``batch["loss_mask"]`` in place (e.g. M2PO drops tokens by a batch-wide statistic)
        and returns metrics. Default: nothing."""
        return {}

    def has_gradient(self, batch: TensorBatch) -> bool:
        """Whether the loss of one optimiser step may move the weights: ``batch`` holds the step's
        rows of the global batch (after :meth:`prepare`, with their ``loss_weight``). ``False``
        promises that, whatever the current policy's log-probs and entropy, the gradient of
        ``sum(per_token_loss * loss_weight)`` over these rows is exactly zero (e.g. every advantage 0
        and no term without one). The update then skips the step's forward and backward passes and
        takes the optimiser step a zero gradient gives (:mod:`core_rl.loops.rl.update`):
        neither :meth:`__call__` nor :meth:`observe_step` sees that step, so a loss whose
        :meth:`observe_step` must see every step answers ``True``. A function of ``batch`` and the
        loss's state (every rank decides alike). Default: ``True`` (every step runs)."""
        return True

    def observe_step(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """Called on every rank after each optimiser step with the engine's metrics of that step
        (global means, the same on every rank: ``entropy``, the token metrics); returns metrics to
        log. A loss with state that follows training (an adaptive coefficient) updates it here and
        keeps it in :meth:`state_dict`, which checkpoints save. Default: nothing."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """State a resumed run needs (see :meth:`observe_step`). Default: none."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. Default: nothing."""

    def set_rejection_sampler(self, sampler: RejectionSampler | None) -> None:
        """Receive the configured ``algorithm.rejection_sampling`` component (called by the trainer
        before training, and again when ``algorithm.mismatch_budget``'s ``correct`` turns one on).
        A loss that does not apply one must refuse a sampler (the default raises
        :class:`core_rl.errors.ConfigError`)."""
        if sampler is not None:
            from core_rl.errors import ConfigError

            raise ConfigError(
                [f"algorithm.rejection_sampling: policy loss {type(self).__name__} does not apply rejection sampling"]
            )

    @abstractmethod
    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        """Per-token loss for one micro-batch, given current log-probs and entropy [b, T]."""


@attrs.define
class ImportanceCorrection:
    """What a :class:`RejectionSampler` decides for each token of a micro-batch.

    ``weight`` [b, T]: the importance weight of the token's loss against the behaviour policy
    (``pi_prox / pi_behave``, possibly aggregated over the sequence or clamped; no gradient);
    ``keep`` [b, T] bool: False where the token (or its whole sequence) is rejected: its loss is 0;
    ``clamped`` [b, T] bool (optional): True where the weight was truncated. All are 0 / False off
    the response.
    """

    weight: torch.Tensor
    keep: torch.Tensor
    clamped: torch.Tensor | None = None


class RejectionSampler(ABC):
    """Judges each response token (or sequence) by how far the proximal policy has moved from the
    behaviour policy that generated it, and masks or clamps its importance weight
    (``algorithm.rejection_sampling``; the decoupled loss applies it micro-batch by micro-batch)."""

    @abstractmethod
    def __call__(
        self, proximal_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> ImportanceCorrection:
        """Weights and keep-mask for ``[b, T]`` proximal and behaviour log-probs over the response
        ``mask``. Row-local: a row's result depends on that row only (so micro-batching and data
        parallelism do not change it)."""


class SampleFilter(ABC):
    """Decides which scored samples go on to training (rejection / dynamic sampling), whole prompt
    groups at a time: what it sees and when it runs is in :mod:`core_rl.loops.rl.filtering`."""

    @abstractmethod
    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        """A bool [B] mask of rows to keep, the same for every row of a group (equal
        ``group_index``). Reads at least ``rewards`` (raw scores) and ``group_index``."""


@attrs.define
class AlgorithmRecipe:
    """A named algorithm: configuration defaults merged under the user's YAML.

    ``defaults`` is a partial configuration, e.g.
    ``{"algorithm": {"advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"}}}``.
    """

    defaults: Mapping[str, Any]
    description: str = ""
    #: values of ``defaults`` chosen for the recipe's own values of other keys, as dotted key paths
    #: ``{dependent: (keys it depends on, ...)}``, e.g. ``{"algorithm.loss.eps_clip_higher":
    #: ("algorithm.loss.eps_clip",)}``: where the user sets a key it depends on to a value other
    #: than the recipe's, and leaves the dependent key unset, the recipe's value of the dependent key
    #: is not applied (its section's own default is), with a note naming both, so a recipe's value
    #: never contradicts one the user chose
    depends_on: Mapping[str, Sequence[str]] = attrs.field(factory=dict)
