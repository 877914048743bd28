"""The ``trainer.loop`` sections of the ``dpo`` and ``kto`` loops (no torch import)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from core_rl.config.checks import SectionContext
from core_rl.config.validators import in_range, non_negative, not_empty, one_of, positive
from core_rl.ops.names import (
    NOISE_PREFERENCE_LOSSES,
    PREFERENCE_LOSSES,
    REFERENCE_FREE_LOSSES,
    SMOOTHED_PREFERENCE_LOSSES,
)

if TYPE_CHECKING:
    from core_rl.config.data_config import DataConfig
    from core_rl.data import DataRow, PromptItem
    from core_rl.loops.supervised import TrainSequence

#: every ``loss_type``: those on log-ratios against a reference, then the reference-free ones
LOSS_TYPES = PREFERENCE_LOSSES + REFERENCE_FREE_LOSSES
#: where the reference's log-probs come from; ``none`` for the reference-free losses
REFERENCES = ("model", "precomputed", "none")
#: the losses that read ``label_smoothing``
SMOOTHED_LOSSES = (*SMOOTHED_PREFERENCE_LOSSES, "simpo")


@attrs.define
class DPOConfig:
    """See the package README.

    - ``loss_type``: ``sigmoid`` (DPO), ``ipo``, ``hinge``, ``robust``, ``exo_pair``,
      ``nca_pair``, ``bco_pair``, ``sppo_hard``, ``apo_zero``, ``apo_down`` or ``discopop`` on
      log-ratios against a reference (formulas: :mod:`core_rl.ops.preference`), or the
      reference-free ``simpo`` / ``orpo`` on the policy's length-normalised log-probs;
      ``beta``: the strength of the implicit KL constraint (SimPO: the scale of the implicit
      reward ``beta * a``; ORPO does not read it); ``label_smoothing``: the assumed fraction of
      flipped labels (sigmoid, simpo, and robust and exo_pair, which need it above 0);
      ``discopop_tau``: DiscoPOP's temperature (discopop only).
    - ``simpo_gamma``: SimPO's target margin ``gamma`` in reward units (``beta * (a_w - a_l)`` must
      exceed it); ``orpo_lambda``: the weight of ORPO's odds-ratio term next to the chosen NLL.
    - ``chosen_key`` / ``rejected_key``: the data columns of the two responses (text or token ids;
      the prompt is ``data.prompt_key``).
    - ``reference``: ``model`` (the run's ``ref:`` role if it has one, else a frozen copy of the
      actor's starting model, built by the actor's train engine), ``precomputed`` (the sequence
      log-probs of the reference are in the columns ``ref_chosen_key`` / ``ref_rejected_key``) or
      ``none`` (no reference at all: the reference-free losses, which require it).
    - ``rpo_alpha`` (0: off): RPO's NLL of the chosen responses added to the loss,
      ``alpha * (-sum of log pi over every chosen token of the step) / (number of those tokens)``
      (a token mean over the step's chosen tokens, not a mean of per-pair means); not with ``orpo``,
      whose loss already holds a chosen NLL.

    With ``reference: model`` the loop resets its reference as the rl loop does
    (``algorithm.reference_reset_every_n_steps``; with ``algorithm.reference_reset_alpha`` < 1 a
    soft update: TR-DPO's ``alpha * policy + (1 - alpha) * reference``).

    ``data.max_length`` bounds the chosen and the rejected sequence each (``prompt + response +
    EOS``); ``data.truncation: drop`` drops the pair, ``truncate`` cuts the longer one's response.
    """

    rl_sections: ClassVar[bool] = False
    roles: ClassVar[tuple[str, ...]] = ("ref",)  # the role sections it reads
    resets_reference: ClassVar[bool] = True  # algorithm.reference_reset_every_n_steps (reference: model)

    loss_type: str = attrs.field(default="sigmoid", validator=one_of(LOSS_TYPES))
    beta: float = attrs.field(default=0.1, validator=positive(1e6))
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5, high_open=True))
    discopop_tau: float = attrs.field(default=0.05, validator=positive(1e6))
    simpo_gamma: float = attrs.field(default=0.5, validator=non_negative(1e6))
    orpo_lambda: float = attrs.field(default=0.1, validator=non_negative(1e6))
    chosen_key: str = attrs.field(default="chosen", validator=not_empty())
    rejected_key: str = attrs.field(default="rejected", validator=not_empty())
    reference: str = attrs.field(default="model", validator=one_of(REFERENCES))
    ref_chosen_key: str = attrs.field(default="ref_chosen_logp", validator=not_empty())
    ref_rejected_key: str = attrs.field(default="ref_rejected_logp", validator=not_empty())
    rpo_alpha: float = attrs.field(default=0.0, validator=non_negative(1e6))

    def row_sequences(self, item: PromptItem, tokenizer: Any, data: DataConfig) -> list[TrainSequence]:
        """The prompt with the chosen response, then with the rejected one (each with EOS)."""
        from core_rl.loops.supervised import pair_sequences

        return pair_sequences(item, tokenizer, (self.chosen_key, self.rejected_key))

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
        if self.reference != "model" and context.run.algorithm.reference_reset_every_n_steps:
            problems.append(
                f"algorithm.reference_reset_every_n_steps: the dpo loop resets only a reference model, and "
                f"{context.key('reference')} is {self.reference}; remove it, or set reference: model"
            )
        if self.label_smoothing and self.loss_type not in SMOOTHED_LOSSES:
            problems.append(
                f"{context.key('label_smoothing')}: loss_type {self.loss_type} does not read it (only "
                f"{', '.join(SMOOTHED_LOSSES)} do); remove it"
            )
        data = context.run.data
        if self.reference == "precomputed" and data.max_length is not None and data.truncation_mode == "truncate":
            problems.append(
                f"data.truncation: truncate cuts responses, but {context.key('reference')}: precomputed reads the "
                "reference's log-probs of the whole responses from the data, so a cut response's log-ratio would "
                "compare a part with the whole; set data.truncation: drop or error, or reference: model"
            )
        if self.loss_type in NOISE_PREFERENCE_LOSSES and not self.label_smoothing:
            problems.append(
                f"{context.key('label_smoothing')}: loss_type {self.loss_type} models label noise and needs it "
                "in (0, 0.5), e.g. 0.001"
            )
        if self.discopop_tau != 0.05 and self.loss_type != "discopop":
            problems.append(f"{context.key('discopop_tau')}: only loss_type discopop reads it; remove it")
        if self.rpo_alpha and self.loss_type == "orpo":
            problems.append(
                f"{context.key('rpo_alpha')}: loss_type orpo already has a chosen NLL term (orpo_lambda weighs "
                "the odds ratio next to it); remove rpo_alpha"
            )
        return problems


#: the range of ``w_D * n_D / (w_U * n_U)`` the KTO paper recommends (Ethayarajh et al. 2024)
KTO_BALANCE_RANGE = (1.0, 4.0 / 3.0)


def kto_label(value: Any) -> bool | None:
    """A KTO label as a bool: ``true`` / ``1`` is desirable, ``false`` / ``0`` undesirable; ``None``
    for anything else (other numbers, text, null)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    return None


def kto_balance_warning(
    desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float
) -> str | None:
    """A warning when the data and weights are outside what KTO was tuned for, else ``None``: one
    class only (allowed: each completion still moves against the KL baseline), or the weighted
    ratio ``w_D * n_D / (w_U * n_U)`` outside :data:`KTO_BALANCE_RANGE` (then the ``desirable_weight``
    that would put it at the range's ends)."""
    if not desirable or not undesirable:
        kind, other = ("desirable", "undesirable") if desirable else ("undesirable", "desirable")
        return (
            f"every row of data.train_files is {kind} (no {other} completion); the kto loop trains on them "
            "against the KL baseline alone"
        )
    low, high = KTO_BALANCE_RANGE
    ratio = desirable_weight * desirable / (undesirable_weight * undesirable)
    if low <= ratio <= high:
        return None
    base = undesirable_weight * undesirable / desirable
    return (
        f"trainer.loop.desirable_weight * {desirable} desirable rows / (trainer.loop.undesirable_weight * "
        f"{undesirable} undesirable rows) is {ratio:.3g}, outside the [1, 4/3] KTO recommends; set "
        f"desirable_weight between {low * base:.3g} and {high * base:.3g} (or undesirable_weight to match)"
    )


@attrs.define
class KTOConfig:
    """See the package README.

    - ``beta``: the scale of the implicit reward ``beta * (log pi(y|x) - log pi_ref(y|x))``;
      ``desirable_weight`` / ``undesirable_weight``: ``w_D`` / ``w_U``, the weights of the two
      classes' losses.
    - ``completion_key`` / ``label_key``: the data columns of the completion (text or token ids; the
      prompt is ``data.prompt_key``) and of its label (``true`` / ``1`` desirable, ``false`` / ``0``
      undesirable).

    The reference is a model: the run's ``ref:`` role if it has one, else a frozen copy of the
    actor's starting model (no precomputed log-probs: the KL baseline's mismatched pairs change
    with each epoch's order, so their reference log-probs cannot sit in the data).

    ``data.max_length`` bounds ``prompt + completion + EOS``; a mismatched row of the KL baseline
    (a prompt with another row's completion) is cut to it at the end whatever ``data.truncation``.
    """

    rl_sections: ClassVar[bool] = False
    roles: ClassVar[tuple[str, ...]] = ("ref",)

    beta: float = attrs.field(default=0.1, validator=positive(1e6))
    desirable_weight: float = attrs.field(default=1.0, validator=positive(1e6))
    undesirable_weight: float = attrs.field(default=1.0, validator=positive(1e6))
    completion_key: str = attrs.field(default="completion", validator=not_empty())
    label_key: str = attrs.field(default="label", validator=not_empty())

    def row_sequences(self, item: PromptItem, tokenizer: Any, data: DataConfig) -> list[TrainSequence]:
        """The prompt with the completion (with EOS)."""
        from core_rl.loops.supervised import pair_sequences

        return pair_sequences(item, tokenizer, (self.completion_key,))

    def check_config(self, context: SectionContext) -> list[str]:
        """A step of one row: its KL baseline needs another row's completion."""
        size = context.run.data.batch_size
        if size >= 2:
            return []
        return [
            f"data.batch_size: {size}, but the kto loop pairs each prompt of a step with the next row's completion "
            "for its KL baseline; set data.batch_size to 2 or more"
        ]

    def check_data(self, rows: Sequence[DataRow], context: SectionContext) -> list[str]:
        """Every row holds a completion and a label that :func:`kto_label` reads, each problem with
        its file and line."""
        from core_rl.data import Problems, kind_of, missing_column_problems

        problems = Problems()
        readers = {key: context.key(f"{key}_key") for key in ("completion", "label")}
        columns = {self.completion_key: readers["completion"], self.label_key: readers["label"]}
        missing_column_problems(rows, columns, problems, remedy="add it to every row, or set that key to its column")
        for r in rows:
            value = r.row.get(self.label_key)
            if value is not None and kto_label(value) is None:
                problems.add(
                    r.file,
                    f"{r.where}: column {self.label_key!r} ({readers['label']}) holds {kind_of(value)}; a label is "
                    "true or 1 (a desirable completion), false or 0 (an undesirable one)",
                )
        return problems.result()
