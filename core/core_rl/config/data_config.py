"""The ``data`` section: training prompts (:class:`DataConfig`), and the weighted sources of a
mixture (:class:`TrainFile`, drawn by :mod:`core_rl.data.mixture`)."""

from __future__ import annotations

from typing import Any

import attrs

from core_rl.config.plugin_spec import PluginSpec
from core_rl.config.validators import (
    MAX_COUNT,
    MAX_STEPS,
    MAX_TOKENS,
    FieldValueError,
    finite,
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
    the prompts drawn (:mod:`core_rl.data.mixture`)."""

    path: str = attrs.field(validator=not_empty())
    weight: float = attrs.field(default=1.0, validator=positive(1e12))


@attrs.define
class DifficultyFilterConfig:
    """``data.difficulty_filter``: skip training prompts the policy already always solves (or
    never does) instead of generating for them again (Polaris / Skywork-OR1's online filtering;
    :mod:`core_rl.loops.rl.difficulty`).

    After each generation batch is scored, every prompt's *record* becomes the mean of its group's
    rule rewards (the ``reward:`` function's scores, before ``algorithm.reward_shaping`` and
    advantage normalisation; samples the reward runner dropped left out). A prompt whose record is
    ``>= easy_threshold`` is *easy*, ``<= hard_threshold`` *hard* (null: that side never).
    Drawn again later, an easy or hard prompt is kept with probability ``keep_probability``
    (default 0: always skipped; the draw is seeded by the experiment seed, the epoch and the
    position in the epoch's order, so a resume repeats it), else skipped and the next prompt of
    the epoch's order drawn instead: a batch keeps ``batch_size`` prompts. At least one threshold;
    ``hard_threshold < easy_threshold`` when both are set."""

    easy_threshold: float | None = attrs.field(default=None, validator=finite())
    hard_threshold: float | None = attrs.field(default=None, validator=finite())
    keep_probability: float = attrs.field(default=0.0, validator=in_range(0, 1))

    def __attrs_post_init__(self) -> None:
        if self.easy_threshold is None and self.hard_threshold is None:
            raise FieldValueError(
                "easy_threshold",
                None,
                "must be set, or hard_threshold: a prompt whose mean reward is >= easy_threshold (or <= "
                "hard_threshold) is skipped; remove data.difficulty_filter to draw every prompt",
            )
        if self.easy_threshold is not None and self.hard_threshold is not None:
            if self.hard_threshold >= self.easy_threshold:
                raise FieldValueError(
                    "hard_threshold", self.hard_threshold, f"must be below easy_threshold ({self.easy_threshold})"
                )


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
    they are there; :mod:`core_rl.data.files`).

    The prompt column holds text, or a conversation: a list of ``{"role": ..., "content": ...}``
    messages (system, user, earlier assistant turns), which needs ``apply_chat_template``.
    ``apply_chat_template``: render each prompt with the tokenizer's chat template (text becomes
    one user turn), ending with the template's generation prompt. ``system_prompt``: a system
    message put first in every prompt that has none (``""`` is an empty one, which keeps a template
    from adding its own default). ``chat_template_kwargs``: variables the template reads (e.g.
    ``enable_thinking: false`` for a template that has thinking turns). ``chat_template``: a Jinja
    template (or the path of a file holding one) used instead of the tokenizer's own, by every part
    of the run and carried by its exports (:mod:`core_rl.rollout.chat_template_override`).

    ``train_files`` entries may instead all be ``{path: ..., weight: ...}`` (:class:`TrainFile`): a
    weighted mixture, each source's share of every epoch's draws in proportion to its weight
    (:mod:`core_rl.data.mixture`).

    ``sources`` (default none): data sources, rows a plugin makes in memory
    (:mod:`core_rl.data.sources`), each key a name an entry ``source:<key>`` of ``train_files`` or
    ``eval.files`` selects, each value the source's section ``{name: <registered name>,
    ...options}``; an entry ``source:<name>`` whose name is no key here is that registered source
    with its default options.

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
    tokens kept stay trained, the rest is gone (:mod:`core_rl.loops.supervised.length_bound`).

    ``difficulty_filter`` (default null: every prompt drawn): skip prompts whose last group-mean
    reward says they are already solved, or hopeless (:class:`DifficultyFilterConfig`); RL loops only.

    ``max_samples`` (default null: every row): train on at most this many of the rows kept after
    reading and filtering (every loop): with ``shuffle`` a subset drawn once, seeded by
    ``experiment.seed``, otherwise the first ones in file order; kept in file order either way, and
    ``trainer.total_epochs`` counts passes over them. Not with weighted ``train_files`` (their weights
    set each source's share; :func:`core_rl.data.prompts.capped_items`).

    Images (vision-language models, :mod:`core_rl.vision`): a row's ``image_key`` column (default
    ``images``) holds a list of images (paths, relative ones to the data file's folder; ``data:``
    URIs; bytes; a ``datasets`` Image cell), or the prompt's messages hold image content parts; a
    row with more than ``max_images_per_prompt`` images (default 4) is refused with its file:line."""

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
    image_key: str = attrs.field(default="images", validator=not_empty())
    max_images_per_prompt: int = attrs.field(default=4, validator=in_range(1, 1024))

    @property
    def truncation_mode(self) -> str:
        """``truncation``, or ``error`` where it is unset."""
        return self.truncation or TRUNCATION_MODES[0]

    difficulty_filter: DifficultyFilterConfig | None = None
    max_samples: int | None = attrs.field(default=None, validator=in_range(1, MAX_STEPS))
    sources: dict[str, PluginSpec] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.max_samples is not None and self.max_samples < self.batch_size:
            raise FieldValueError(
                "max_samples",
                self.max_samples,
                f"is fewer than data.batch_size ({self.batch_size}): every step would draw some prompts twice; "
                "raise it, or lower data.batch_size",
            )
        if self.max_samples is not None and self.train_weights is not None:
            raise FieldValueError(
                "max_samples",
                self.max_samples,
                "caps a plain list of train_files; with weighted entries each source's share of an epoch is its "
                "weight: remove max_samples, or the weights",
            )

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
