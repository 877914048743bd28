"""The ``trainer.loop`` section of the ``dpo`` loop (no torch import)."""

from __future__ import annotations

from typing import ClassVar

import attrs
from core_rl.config.validators import in_range, not_empty, one_of, positive
from core_rl.ops.names import PREFERENCE_LOSSES


@attrs.define
class DPOConfig:
    """See the package README.

    - ``loss_type``: ``sigmoid`` (DPO), ``ipo`` or ``hinge``; ``beta``: the strength of the implicit
      KL constraint; ``label_smoothing``: the assumed fraction of flipped labels (sigmoid only).
    - ``chosen_key`` / ``rejected_key``: the data columns of the two responses (text or token ids;
      the prompt is ``data.prompt_key``).
    - ``reference``: ``model`` (the run's ``ref:`` role if it has one, else a frozen copy of the
      actor's starting model, built by the actor's train engine) or ``precomputed`` (the sequence log-probs of the
      reference are in the columns ``ref_chosen_key`` / ``ref_rejected_key``).
    """

    rl_sections: ClassVar[bool] = False
    roles: ClassVar[tuple[str, ...]] = ("ref",)  # the role sections it reads

    loss_type: str = attrs.field(default="sigmoid", validator=one_of(PREFERENCE_LOSSES))
    beta: float = attrs.field(default=0.1, validator=positive(1e6))
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5, high_open=True))
    chosen_key: str = attrs.field(default="chosen", validator=not_empty())
    rejected_key: str = attrs.field(default="rejected", validator=not_empty())
    reference: str = attrs.field(default="model", validator=one_of(("model", "precomputed")))
    ref_chosen_key: str = attrs.field(default="ref_chosen_logp", validator=not_empty())
    ref_rejected_key: str = attrs.field(default="ref_rejected_logp", validator=not_empty())
