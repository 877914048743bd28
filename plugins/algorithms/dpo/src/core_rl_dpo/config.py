"""The ``trainer.loop`` section of the ``dpo`` loop (no torch import)."""

from __future__ import annotations

from typing import ClassVar

import attrs
from core_rl.config.checks import SectionContext
from core_rl.config.validators import in_range, non_negative, not_empty, one_of, positive
from core_rl.ops.names import PREFERENCE_LOSSES, REFERENCE_FREE_LOSSES

#: every ``loss_type``: those on log-ratios against a reference, then the reference-free ones
LOSS_TYPES = PREFERENCE_LOSSES + REFERENCE_FREE_LOSSES
#: where the reference's log-probs come from; ``none`` for the reference-free losses
REFERENCES = ("model", "precomputed", "none")
#: the losses that read ``label_smoothing``
SMOOTHED_LOSSES = ("sigmoid", "simpo")


@attrs.define
class DPOConfig:
    """See the package README.

    - ``loss_type``: ``sigmoid`` (DPO), ``ipo`` or ``hinge`` on log-ratios against a reference, or
      the reference-free ``simpo`` / ``orpo`` on the policy's length-normalised log-probs;
      ``beta``: the strength of the implicit KL constraint (SimPO: the scale of the implicit
      reward ``beta * a``; ORPO does not read it); ``label_smoothing``: the assumed fraction of
      flipped labels (sigmoid and simpo only).
    - ``simpo_gamma``: SimPO's target margin ``gamma`` in reward units (``beta * (a_w - a_l)`` must
      exceed it); ``orpo_lambda``: the weight of ORPO's odds-ratio term next to the chosen NLL.
    - ``chosen_key`` / ``rejected_key``: the data columns of the two responses (text or token ids;
      the prompt is ``data.prompt_key``).
    - ``reference``: ``model`` (the run's ``ref:`` role if it has one, else a frozen copy of the
      actor's starting model, built by the actor's train engine), ``precomputed`` (the sequence
      log-probs of the reference are in the columns ``ref_chosen_key`` / ``ref_rejected_key``) or
      ``none`` (no reference at all: the reference-free losses, which require it).
    """

    rl_sections: ClassVar[bool] = False
    roles: ClassVar[tuple[str, ...]] = ("ref",)  # the role sections it reads

    loss_type: str = attrs.field(default="sigmoid", validator=one_of(LOSS_TYPES))
    beta: float = attrs.field(default=0.1, validator=positive(1e6))
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5, high_open=True))
    simpo_gamma: float = attrs.field(default=0.5, validator=non_negative(1e6))
    orpo_lambda: float = attrs.field(default=0.1, validator=non_negative(1e6))
    chosen_key: str = attrs.field(default="chosen", validator=not_empty())
    rejected_key: str = attrs.field(default="rejected", validator=not_empty())
    reference: str = attrs.field(default="model", validator=one_of(REFERENCES))
    ref_chosen_key: str = attrs.field(default="ref_chosen_logp", validator=not_empty())
    ref_rejected_key: str = attrs.field(default="ref_rejected_logp", validator=not_empty())

    @property
    def reference_free(self) -> bool:
        """Whether the loss reads no reference (``simpo``, ``orpo``)."""
        return self.loss_type in REFERENCE_FREE_LOSSES

    def check_config(self, context: SectionContext) -> list[str]:
        """A reference the loss would not read (or a missing one it would), a ``ref:`` section the
        loop would not build, and a ``label_smoothing`` the loss ignores."""
        problems = []
        if self.reference_free and self.reference != "none":
            problems.append(
                f"{context.key('reference')}: {self.reference}, but loss_type {self.loss_type} reads no reference "
                f"(it compares the policy's own length-normalised log-probs); set reference: none "
                f"(algorithm: {self.loss_type} sets both)"
            )
        elif not self.reference_free and self.reference == "none":
            problems.append(
                f"{context.key('reference')}: none, but loss_type {self.loss_type} compares log-ratios against a "
                f"reference; set reference: model or precomputed, or a reference-free loss_type "
                f"({', '.join(REFERENCE_FREE_LOSSES)})"
            )
        if self.reference != "model" and context.run.ref is not None:
            problems.append(
                f"ref: the dpo loop builds no reference model with {context.key('reference')}: {self.reference}; "
                "remove the ref: section, or set reference: model"
            )
        if self.label_smoothing and self.loss_type not in SMOOTHED_LOSSES:
            problems.append(
                f"{context.key('label_smoothing')}: loss_type {self.loss_type} does not read it (only "
                f"{' and '.join(SMOOTHED_LOSSES)} do); remove it"
            )
        return problems
