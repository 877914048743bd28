"""``algorithm.ptx``: a supervised loss on a dataset of its own mixed into every policy update
(InstructGPT's PPO-ptx, OpenRLHF's ``--pretrain_data``/``--ptx_coef``), importable without torch.
The loss and the rows: :mod:`core_rl.loops.rl.ptx`."""

from __future__ import annotations

import attrs

from core_rl.config.validators import MAX_COUNT, MAX_TOKENS, FieldValueError, in_range, not_empty, positive


def _files(_inst: object, attribute: attrs.Attribute, value: list[str]) -> None:
    if not value or not all(isinstance(v, str) and v for v in value):
        raise FieldValueError(attribute.name, value, "must list the files of the supervised rows (as data.train_files)")


@attrs.define
class PTXConfig:
    """Every optimiser step of the policy also trains on ``rows`` rows of ``files`` (read like
    ``data.train_files``; a row's ``prompt_key`` column is its prompt, tokenised as the training
    prompts are, and its ``response_key`` column the completion, text or token ids, followed by EOS),
    drawn in a seeded order that reshuffles each epoch and resumes where it was:

        loss = policy loss + coef * (sum of -log pi over the rows' completion tokens) / (their number)

    Each row is cut to ``max_length`` tokens (its completion at the end). The completion tokens'
    mean NLL is logged as ``actor/ptx_nll`` (over every rank's rows)."""

    files: list[str] = attrs.field(validator=_files)
    coef: float = attrs.field(default=0.05, validator=positive(1e6))
    rows: int = attrs.field(default=8, validator=in_range(1, MAX_COUNT))
    prompt_key: str = attrs.field(default="prompt", validator=not_empty())
    response_key: str = attrs.field(default="response", validator=not_empty())
    max_length: int = attrs.field(default=1024, validator=in_range(2, MAX_TOKENS))
