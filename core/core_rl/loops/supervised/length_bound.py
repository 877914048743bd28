"""``data.max_length``: the bound on the sequences a supervised loop trains on (no torch import).

Each row's sequences (its config class's ``row_sequences``: :mod:`core_rl.loops.supervised.sequences`) are
measured as the loop builds them, ``prompt + response + suffix`` tokens with the EOS the loop
appends. A row with a sequence over ``data.max_length`` is, by ``data.truncation``:

- ``error`` (the default): a problem ``train.jsonl:7: 812 tokens > data.max_length=512`` (at most
  :data:`~core_rl.data.files.MAX_PROBLEMS_PER_FILE` a file, then a count), with one line
  saying what to do; found by preflight before the model loads;
- ``drop``: left out, a preference pair as a whole; one line on stderr says how many
  (:func:`~core_rl.data.prompts.announce_once`); all of them left out is a problem;
- ``truncate``: kept, and cut at the end when its batch is built
(:func:`~core_rl.loops.supervised.sequences.fit_to_length`);
  a row whose prompt (and suffix) leaves no room for one response token is a problem, since the
  prompt is never cut.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core_rl.config.data_config import DataConfig
from core_rl.config.schema import RunConfig
from core_rl.data.files import Problems
from core_rl.data.prompts import PromptItem, Select, announce_once
from core_rl.errors import DataError
from core_rl.loops.supervised.sequences import BuildsSequences, TrainSequence

#: a row's sequences as the loop builds them (uncut)
SequencesOf = Callable[[PromptItem], list[TrainSequence]]


def _file_of(item: PromptItem) -> str:
    """The file part of ``item.where`` (``train.jsonl`` of ``train.jsonl:7``), to count problems per file."""
    return item.where.rsplit(":", 1)[0]


def _where(item: PromptItem) -> str:
    return item.where or f"data row {item.text[:40]!r}"


def _too_long(item: PromptItem, sequences: list[TrainSequence], config: DataConfig) -> str | None:
    """The problem of a row ``error`` or ``truncate`` cannot keep, else ``None``."""
    limit = config.max_length
    assert limit is not None
    longest = max(s.length for s in sequences)
    if config.truncation_mode == "error":
        return f"{_where(item)}: {longest} tokens > data.max_length={limit}"
    crowded = [s for s in sequences if s.length > limit and len(s.prompt) + s.suffix >= limit]
    if not crowded:
        return None
    prompt = max(len(s.prompt) + s.suffix for s in crowded)
    return (
        f"{_where(item)}: {longest} tokens > data.max_length={limit}, and its prompt alone has {prompt} tokens, "
        "which data.truncation: truncate never cuts"
    )


def bound_items(
    items: list[PromptItem], sequences_of: SequencesOf, config: DataConfig, *, files_key: str = "data.train_files"
) -> tuple[list[PromptItem], list[str]]:
    """The items to train on of ``items`` (those of ``files_key``) under ``config.max_length`` and
    ``config.truncation`` (see the module docstring), and the problems. ``None`` bounds nothing."""
    limit = config.max_length
    if limit is None:
        return items, []
    kept, dropped, problems, refused = [], [], Problems(), 0
    for item in items:
        try:
            sequences = sequences_of(item)
        except DataError as exc:
            for line in exc.problems:
                problems.add(_file_of(item), line)
            continue
        if all(s.length <= limit for s in sequences):
            kept.append(item)
        elif config.truncation_mode == "drop":
            dropped.append(max(s.length for s in sequences))
        else:
            problem = _too_long(item, sequences, config)
            if problem is None:
                kept.append(item)
            else:
                problems.add(_file_of(item), problem)
                refused += 1
    lines = problems.result()
    if refused:
        lines.append(_remedy(config, files_key))
    if dropped and not kept:
        lines.append(
            f"data.truncation: drop, but all {len(dropped)} rows of {files_key} are longer than "
            f"data.max_length={limit} tokens (the shortest has {min(dropped)}); raise data.max_length"
        )
    elif dropped:
        of = "" if files_key == "data.train_files" else f" of {files_key}"
        announce_once(
            f"core-rl: data: dropped {len(dropped)} of {len(items)} rows{of} longer than data.max_length={limit} "
            "tokens (data.truncation: drop)"
        )
    return kept, lines


def _remedy(config: DataConfig, files_key: str) -> str:
    """The line after the rows ``error`` or ``truncate`` refused: what to do."""
    if config.truncation_mode == "truncate":
        return (
            f"data.max_length: {config.max_length} leaves no room for a response after the prompts of the rows of "
            f"{files_key} above; raise it, shorten those prompts, or set data.truncation: drop"
        )
    return (
        f"data.max_length: the rows of {files_key} above are longer than {config.max_length} tokens (prompt and "
        "response, with the EOS the loop appends); raise it, or set data.truncation: drop (leave them out) or "
        "truncate (cut their responses)"
    )


def run_bound(cfg: RunConfig, tokenizer: Any, *, files_key: str = "data.train_files") -> Select | None:
    """:func:`bound_items` for the run's selected loop (its config's ``row_sequences``), as a
    :data:`~core_rl.data.prompts.Select`; ``None`` without ``data.max_length`` (or a loop that says
    no sequences: the configuration check refuses that)."""
    loop, data = cfg.trainer.loop.config, cfg.data
    if data.max_length is None or not isinstance(loop, BuildsSequences):
        return None

    def select(items: list[PromptItem]) -> tuple[list[PromptItem], list[str]]:
        return bound_items(items, lambda item: loop.row_sequences(item, tokenizer, data), data, files_key=files_key)

    return select
