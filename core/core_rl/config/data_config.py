"""The ``data`` section: training prompts (:class:`DataConfig`), and the weighted sources of a
mixture (:class:`TrainFile`, drawn by :mod:`core_rl.trainer.mixture`)."""

from __future__ import annotations

from typing import Any

import attrs

from core_rl.config.validators import (
    MAX_COUNT,
    MAX_TOKENS,
    FieldValueError,
    in_range,
    not_empty,
    one_of,
    positive,
)

#: what ``data.truncation`` may say of a row longer than ``data.max_length`` (unset: the first)
TRUNCATION_MODES = ("error", "drop", "truncate")


@attrs.define
class TrainFile:
    """One source of a weighted mixture of training data (``data.train_files: [{path: a.jsonl,
    weight: 0.7}, ...]``): an entry as a plain ``train_files`` string names one, and its share of
    the prompts drawn (:mod:`core_rl.trainer.mixture`)."""

    path: str = attrs.field(validator=not_empty())
    weight: float = attrs.field(default=1.0, validator=positive(1e12))


def _train_entries(_inst: Any, _attribute: attrs.Attribute[Any], files: list[str | TrainFile]) -> None:
    """Non-empty paths; either every entry a path (read in order) or every one a weighted source."""
    for i, entry in enumerate(files):
        if entry == "":
            raise FieldValueError(f"train_files[{i}]", entry, "must not be empty")
    weighted = [isinstance(f, TrainFile) for f in files]
    if any(weighted) and not all(weighted):
        i, j = weighted.index(False), weighted.index(True)
        raise FieldValueError(
            f"train_files[{i}]",
            files[i],
            f"must be {{path: ..., weight: ...}} like train_files[{j}]: with weights every entry needs one",
        )


@attrs.define
class DataConfig:
    """Training prompts: rows that hold ``prompt_key`` plus any columns rewards read (e.g.
    ``answer``). ``batch_size`` prompts are drawn per step.

    ``train_files`` entries: JSON/JSONL/Parquet files, directories written by ``datasets``'
    ``save_to_disk`` (``dir``, or ``dir@split`` for a ``DatasetDict``; default split ``train``) and
    Hugging Face hub datasets ``hf:<repo_id>[:<config_name>][@<split>]`` (from the local cache where
    they are there; :mod:`core_rl.trainer.data_files`).

    The prompt column holds text, or a conversation: a list of ``{"role": ..., "content": ...}``
    messages (system, user, earlier assistant turns), which needs ``apply_chat_template``.
    ``apply_chat_template``: render each prompt with the tokenizer's chat template (text becomes
    one user turn), ending with the template's generation prompt. ``system_prompt``: a system
    message put first in every prompt that has none (``""`` is an empty one, which keeps a template
    from adding its own default). ``chat_template_kwargs``: variables the template reads (e.g.
    ``enable_thinking: false`` for a template that has thinking turns). ``chat_template``: a Jinja
    template (or the path of a file holding one) used instead of the tokenizer's own, by every part
    of the run and carried by its exports (:mod:`core_rl.chat_template_override`).

    ``train_files`` entries may instead all be ``{path: ..., weight: ...}`` (:class:`TrainFile`): a
    weighted mixture, each source's share of every epoch's draws in proportion to its weight
    (:mod:`core_rl.trainer.mixture`).

    ``filter_overlong_prompts``: drop prompts longer than ``max_prompt_tokens`` tokens (one line on
    stderr says how many) instead of refusing the run; all of them too long is still an error. It
    applies to ``eval.files`` too.

    ``max_length`` (supervised loops: ``sft``, ``dpo`` and its variants, ``kto``, ``rm``; default
    ``None``: no bound): the most tokens of one sequence a loop trains on, ``prompt + response``
    including what the loop appends (the EOS after a response; the ``rm`` loop's score slot), for
    every sequence of a row (a preference pair's chosen and rejected ones each). A row longer than
    that is handled as ``truncation`` says (unset: ``error``): ``error`` refuses the run before the
    model loads, listing the rows; ``drop`` leaves the row out (a pair as a whole; one line on stderr
    says how many; all of them is an error); ``truncate`` keeps its first ``max_length`` tokens: the
    response is cut at the end (a cut response gets no EOS, and the loss reads exactly the kept
    tokens), the prompt never (a row whose prompt leaves no room for a response token is an error).
    A ``conversations`` row of the ``sft`` loop is cut at the end like one sequence: the assistant
    tokens kept stay trained, the rest is gone (:mod:`core_rl.trainer.length_bound`)."""

    train_files: list[str | TrainFile] = attrs.field(factory=list, validator=_train_entries)
    prompt_key: str = attrs.field(default="prompt", validator=not_empty())
    batch_size: int = attrs.field(default=8, validator=in_range(1, MAX_COUNT))
    shuffle: bool = True
    max_prompt_tokens: int = attrs.field(default=1024, validator=in_range(1, MAX_TOKENS))
    apply_chat_template: bool = False
    system_prompt: str | None = None
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    chat_template: str = ""
    filter_overlong_prompts: bool = False
    max_length: int | None = attrs.field(default=None, validator=in_range(2, MAX_TOKENS))
    truncation: str | None = attrs.field(default=None, validator=one_of(TRUNCATION_MODES))

    @property
    def truncation_mode(self) -> str:
        """``truncation``, or ``error`` where it is unset."""
        return self.truncation or TRUNCATION_MODES[0]

    @property
    def train_paths(self) -> list[str]:
        """The entries of ``train_files``, weighted or not, as paths."""
        return [f.path if isinstance(f, TrainFile) else f for f in self.train_files]

    @property
    def train_weights(self) -> list[float] | None:
        """Each entry's weight, or ``None`` for plain paths (read in order, no mixture)."""
        if not self.train_files or not isinstance(self.train_files[0], TrainFile):
            return None
        return [f.weight for f in self.train_files if isinstance(f, TrainFile)]
