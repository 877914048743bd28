"""Prompt data: rows of the data files (:mod:`core_rl.data.files`) checked (the prompt
column, the columns rewards read, the prompt's tokens), tokenised, and drawn in shuffled epochs
with a resumable position.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from core_rl.config.schema import DataConfig, RunConfig
from core_rl.data.files import MAX_PROBLEMS_PER_FILE, DataRow, Problems, kind_of, read_data_files
from core_rl.data.mixture import mixture_order
from core_rl.errors import DataError, stderr_line
from core_rl.loops.rl.difficulty import EASY, HARD, DifficultyRecords
from core_rl.rollout.chat_template import conversation_problem, ends_turns_with_eos, prompt_messages, render_prompt
from core_rl.vision.images import ImageError


@attrs.define
class PromptItem:
    """One prompt: its data row (every column), its text and its token ids; ``where`` the row's
    file and line (:attr:`~core_rl.data.files.DataRow.where`) where it came from a file."""

    row: Mapping[str, Any]
    text: str
    prompt_ids: list[int]
    where: str = ""
    #: the index of the ``data.train_files`` entry (or eval file) the row came from
    entry: int = 0
    #: the item's index in :attr:`PromptSource.items` (set there; -1 for items of no source), naming
    #: the prompt in ``data.difficulty_filter``'s records (:mod:`core_rl.loops.rl.difficulty`)
    index: int = -1
    #: the pixel inputs of the prompt's images (:mod:`core_rl.vision.prompts`); ``None``: text only
    media: dict[str, Any] | None = None


#: which of the tokenised items a :class:`PromptSource` draws, and the problems (see there)
Select = Callable[[list[PromptItem]], tuple[list[PromptItem], list[str]]]


def check_rows(
    rows: Sequence[DataRow],
    prompt_key: str,
    required: Mapping[str, str],
    *,
    key_path: str = "data.prompt_key",
    chat_template: bool = False,
) -> list[str]:
    """Problems with the columns of ``rows``: the prompt column (present, a non-empty string, or a
    conversation (:mod:`core_rl.rollout.chat_template`) where ``chat_template`` renders it; set by the
    config key ``key_path``) and each column of ``required`` (present and not null; the value
    names who reads it, e.g. ``"reward 'char_match'"``). A column missing from several rows of a
    file is one problem, at its first row, listing the others (a misnamed key is one line, not one
    per row)."""
    problems = Problems()
    # per file, the rows without the prompt column: one problem, in the place of the first of them
    lacking: dict[str, list[DataRow]] = {}
    for r in rows:
        if prompt_key not in r.row:
            lacking.setdefault(r.file, []).append(r)
    for r in rows:
        prompt = r.row.get(prompt_key)
        if prompt_key not in r.row:
            where = lacking[r.file]
            if r is where[0]:
                columns = ", ".join(map(str, r.row)) or "none"
                problems.add(
                    r.file,
                    f"{r.where}: no column {prompt_key!r} (columns: {columns}){_also(where)}; set {key_path} to "
                    "the column holding the prompt text",
                )
        elif isinstance(prompt, (list, tuple)):
            why = conversation_problem(prompt)
            if why is not None:
                problems.add(r.file, f"{r.where}: column {prompt_key!r}: {why}")
            elif not chat_template:
                problems.add(
                    r.file,
                    f"{r.where}: column {prompt_key!r} holds a conversation (a list of messages), which only the "
                    "chat template can render; set data.apply_chat_template: true",
                )
        elif not isinstance(prompt, str):
            problems.add(
                r.file,
                f"{r.where}: column {prompt_key!r} holds {kind_of(prompt)}; prompts are text or a list of messages",
            )
        elif not prompt:
            problems.add(r.file, f"{r.where}: column {prompt_key!r} is an empty string")
    missing_column_problems(
        rows, required, problems, remedy="add it to every row, or point the reward at the column that holds it"
    )
    return problems.result()


def missing_column_problems(
    rows: Sequence[DataRow], readers: Mapping[str, str], problems: Problems, *, remedy: str
) -> None:
    """Add to ``problems`` one problem per file and column of ``readers`` that some of its ``rows``
    lack (or hold null in): the first such row's place, the others' line numbers (at most
    :data:`MAX_PROBLEMS_PER_FILE` shown), who reads the column (``readers[column]``, e.g.
    ``"reward 'char_match'"``) and the ``remedy``."""
    lacking: dict[tuple[str, str], list[DataRow]] = {}
    for r in rows:
        for column in readers:
            if r.row.get(column) is None:
                lacking.setdefault((r.file, column), []).append(r)
    for (_file, column), where in lacking.items():
        problems.add(
            where[0].file,
            f"{where[0].where}: no column {column!r} (or it is null){_also(where)}, which {readers[column]} reads; "
            f"{remedy}",
        )


def _also(where: Sequence[DataRow]) -> str:
    """`` (also lines 2, 3 and 9 more)``: the places of the rows of one file after the first that
    share its problem (at most :data:`MAX_PROBLEMS_PER_FILE` shown); nothing for one row."""
    rest = where[1:]
    if not rest:
        return ""
    shown = ", ".join(str(r.line) for r in rest[:MAX_PROBLEMS_PER_FILE])
    more = f" and {len(rest) - MAX_PROBLEMS_PER_FILE} more" if len(rest) > MAX_PROBLEMS_PER_FILE else ""
    return f" (also {where[0].unit}s {shown}{more})"


def encode_prompt(
    prompt: str | Sequence[Mapping[str, Any]], config: DataConfig, tokenizer: Any
) -> tuple[list[int], str]:
    """Token ids and text of a prompt: rendered by the chat template (``data.apply_chat_template``;
    text as the user turn, a conversation as it is, ``data.system_prompt`` first, the template
    variables ``data.chat_template_kwargs``), or text with the tokenizer's special tokens. The
    text of a conversation is its rendering; of text, the text itself."""
    if not config.apply_chat_template:
        assert isinstance(prompt, str), "a conversation needs the chat template (check_rows says so)"
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"]), prompt
    messages = prompt_messages(prompt, config.system_prompt)
    ids, rendered = render_prompt(tokenizer, messages, config.chat_template_kwargs)
    return ids, prompt if isinstance(prompt, str) else rendered


def encode_row_prompt(
    r: DataRow, prompt: str | Sequence[Mapping[str, Any]], config: DataConfig, tokenizer: Any
) -> tuple[list[int], str, dict[str, Any] | None]:
    """:func:`encode_prompt` of a row's prompt, or with its images (:mod:`core_rl.vision`; they need
    ``data.apply_chat_template``) the ids, text and pixel inputs of
    :func:`~core_rl.vision.prompts.encode_vision_prompt`. Raises
    :class:`~core_rl.vision.images.ImageError` for an image that cannot be used."""
    from core_rl.vision.images import ImageError, has_images

    if not has_images(r.row, prompt, config.image_key):
        return (*encode_prompt(prompt, config, tokenizer), None)
    if not config.apply_chat_template:
        raise ImageError(
            "the row has images, which only the chat template can place; set data.apply_chat_template: true"
        )
    from core_rl.vision.prompts import encode_vision_prompt

    base = Path(r.file).parent if r.unit == "line" and Path(r.file).is_file() else None
    return encode_vision_prompt(
        r.row,
        prompt,
        tokenizer,
        image_key=config.image_key,
        max_images=config.max_images_per_prompt,
        system_prompt=config.system_prompt,
        template_kwargs=config.chat_template_kwargs,
        base_dir=base,
    )


def is_prompt(value: Any) -> bool:
    """Whether a prompt cell holds what :func:`encode_prompt` takes (text, or a conversation;
    :func:`check_rows` reports the rest)."""
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and conversation_problem(value) is None)


def _prompt_problem(where: str, ids: list[int], config: DataConfig, vocab_size: int | None) -> str | None:
    if not ids:
        return f"{where}: the prompt tokenises to nothing"
    if len(ids) > config.max_prompt_tokens:
        return (
            f"{where}: the prompt has {len(ids)} tokens, more than data.max_prompt_tokens={config.max_prompt_tokens}; "
            "shorten it or raise data.max_prompt_tokens"
        )
    if vocab_size is not None and max(ids) >= vocab_size:
        return (
            f"{where}: the prompt has token id {max(ids)}, outside the model's vocabulary (vocab_size {vocab_size}); "
            "the tokenizer does not match the model"
        )
    return None


#: the lines :func:`announce_once` printed in this process (each once, however often the data is read)
_ANNOUNCED: set[str] = set()


def announce_once(line: str) -> None:
    """Print ``line`` on stderr (rank 0 of a ``torchrun`` job), once in this process: what
    filtering dropped, said when the run starts (preflight and the loop both filter)."""
    if line not in _ANNOUNCED and os.environ.get("RANK", "0") == "0":
        _ANNOUNCED.add(line)
        stderr_line(line)


#: how many text prompts :func:`raw_chat_prompts_warning` looks through for special tokens
RENDERED_PROMPTS_SEEN = 256


def raw_chat_prompts_warning(rows: Sequence[DataRow], config: DataConfig, tokenizer: Any) -> str | None:
    """The warning for text prompts that would reach a chat model raw, else ``None``.

    A chat (instruct) model has been trained on conversations rendered by its chat template, and
    given a bare question it tends to continue the text instead of answering it: a run learns
    little, and nothing fails. Warned when ``data.apply_chat_template`` is false, the tokenizer is
    a chat model's (:func:`~core_rl.rollout.chat_template.ends_turns_with_eos`), and no prompt
    holds one of its special tokens (prompts rendered beforehand hold them; the first
    :data:`RENDERED_PROMPTS_SEEN` text prompts are looked at)."""
    if config.apply_chat_template or not ends_turns_with_eos(tokenizer):
        return None
    texts = (r.row[config.prompt_key] for r in rows if isinstance(r.row.get(config.prompt_key), str))
    prompts = list(itertools.islice(texts, RENDERED_PROMPTS_SEEN))
    special = [token for token in getattr(tokenizer, "all_special_tokens", ()) if token]
    if not prompts or any(token in prompt for prompt in prompts for token in special):
        return None
    return (
        "core-rl: warning: data.apply_chat_template is false, so the prompts reach the model as raw text, but "
        f"its tokenizer's chat template ends each turn with its end-of-sequence token {tokenizer.eos_token!r}: "
        "a chat model, which answers prompts rendered as a user turn; set data.apply_chat_template: true "
        "(leave it false only for a model trained on raw text)"
    )


def _announce_dropped(dropped: int, total: int, config: DataConfig, files_key: str) -> None:
    """One line on stderr saying how many prompts ``data.filter_overlong_prompts`` dropped."""
    of = "" if files_key == "data.train_files" else f" of {files_key}"
    announce_once(
        f"core-rl: data: dropped {dropped} of {total} prompts{of} longer than "
        f"data.max_prompt_tokens={config.max_prompt_tokens} (data.filter_overlong_prompts)"
    )


def tokenise_rows(
    rows: Sequence[DataRow],
    config: DataConfig,
    tokenizer: Any,
    *,
    vocab_size: int | None = None,
    files_key: str = "data.train_files",
) -> tuple[list[PromptItem], list[str]]:
    """Tokenise the prompt of every row; return the items and the problems (prompts that
    tokenise to nothing, exceed ``data.max_prompt_tokens``, or hold ids outside ``vocab_size``).
    Rows whose prompt is neither text nor a conversation are skipped (:func:`check_rows` reports
    them). With ``data.filter_overlong_prompts`` a prompt over ``data.max_prompt_tokens`` is dropped
    instead, and the number dropped printed once; all of the rows of ``files_key`` dropped is a problem."""
    items, problems = [], Problems()
    total, dropped = 0, []
    for r in rows:
        prompt = r.row.get(config.prompt_key)
        if not is_prompt(prompt) or (not isinstance(prompt, str) and not config.apply_chat_template):
            continue
        total += 1
        try:
            ids, text, media = encode_row_prompt(r, prompt, config, tokenizer)
        except ImageError as exc:
            problems.add(r.file, f"{r.where}: {exc}")
            continue
        except Exception as exc:  # the tokenizer or its chat template refusing this text
            problems.add(r.file, f"{r.where}: the tokenizer cannot encode the prompt: {type(exc).__name__}: {exc}")
            continue
        if config.filter_overlong_prompts and len(ids) > config.max_prompt_tokens:
            dropped.append(len(ids))
            continue
        problem = _prompt_problem(r.where, ids, config, vocab_size)
        if problem is not None:
            problems.add(r.file, problem)
            continue
        items.append(PromptItem(row=r.row, text=text, prompt_ids=ids, where=r.where, entry=r.entry, media=media))
    if dropped and not items:
        return items, [
            *problems.result(),
            f"data.filter_overlong_prompts: all {len(dropped)} prompts of {files_key} are longer than "
            f"data.max_prompt_tokens={config.max_prompt_tokens} tokens (the shortest has {min(dropped)}); "
            "raise data.max_prompt_tokens",
        ]
    if dropped:
        _announce_dropped(len(dropped), total, config, files_key)
    return items, problems.result()


def tokenisation_key(config: DataConfig, tokenizer: Any) -> tuple[Any, ...] | None:
    """What decides the prompt items :func:`tokenise_rows` makes of the same rows: the prompt
    column, the chat-template settings, the image settings, the length bounds (and whether they filter: preflight keeps
    the items ``data.max_length`` leaves, :mod:`core_rl.loops.supervised.length_bound`) and the tokenizer's
    source (``None``, so nothing is reused, for a tokenizer that does not say where it came from)."""
    source = getattr(tokenizer, "name_or_path", None)
    if not source:
        return None
    variables = json.dumps(config.chat_template_kwargs, sort_keys=True, default=str)
    chat = (config.apply_chat_template, config.system_prompt, variables)
    bounds = (config.max_prompt_tokens, config.filter_overlong_prompts, config.max_length, config.truncation)
    images = (config.image_key, config.max_images_per_prompt)
    return (config.prompt_key, *chat, *bounds, *images, str(source))


class TokenisedRows(list):  # list[DataRow]
    """Rows that :func:`core_rl.loops.preflight.preflight` read, checked and tokenised without a
    problem: still the list of :class:`DataRow` a training loop receives, plus the prompt items
    that tokenising gave (``key``: :func:`tokenisation_key`), so that :class:`PromptSource` under
    the same settings takes them instead of tokenising every prompt a second time."""

    def __init__(self, rows: Sequence[DataRow], items: Sequence[PromptItem], key: tuple[Any, ...]) -> None:
        super().__init__(rows)
        self.items = list(items)
        self.key = key


def mixture_sources(items: Sequence[PromptItem], config: DataConfig) -> tuple[list[list[int]], list[str]]:
    """The indices of ``items`` drawn from each entry of a weighted ``data.train_files`` (by the entry
    each row was read from, whatever label the reader gave it), and a problem for each entry left
    with no prompt (all of them filtered out as too long)."""
    paths = config.train_paths
    sources: list[list[int]] = [[] for _ in paths]
    for i, item in enumerate(items):
        sources[item.entry].append(i)
    problems = [
        f"data.train_files[{k}]: {paths[k]!r} has no prompts to draw (data.filter_overlong_prompts or "
        "data.truncation: drop dropped them all); remove it, or raise data.max_prompt_tokens or data.max_length"
        for k, members in enumerate(sources)
        if not members
    ]
    return sources, problems


def prompt_count(rows: Sequence[DataRow], config: DataConfig, tokenizer: Any) -> int:
    """How many prompts :class:`PromptSource` draws from ``rows`` (checked rows): those tokenising
    keeps (``data.filter_overlong_prompts`` drops the long ones), taken from :class:`TokenisedRows`
    of the same settings when preflight made them, at most ``data.max_samples``."""
    if isinstance(rows, TokenisedRows) and rows.key == tokenisation_key(config, tokenizer):
        count = len(rows.items)
    else:
        count = len(tokenise_rows(rows, config, tokenizer)[0])
    return count if config.max_samples is None else min(count, config.max_samples)


def capped_items(items: list[PromptItem], config: DataConfig, *, seed: int) -> list[PromptItem]:
    """At most ``data.max_samples`` of ``items``: with ``data.shuffle`` a subset drawn once with
    ``random.Random(seed)``, otherwise the first ones; in their original order either way. One line
    on stderr says how many of how many are kept."""
    cap = config.max_samples
    if cap is None or cap >= len(items):
        return items
    chosen = sorted(random.Random(seed).sample(range(len(items)), cap)) if config.shuffle else range(cap)
    how = f"a subset drawn with seed {seed}" if config.shuffle else "the first ones"
    announce_once(f"core-rl: data.max_samples: training on {cap} of {len(items)} prompts ({how})")
    return [items[i] for i in chosen]


def eval_data_config(cfg: RunConfig) -> DataConfig:
    """The data section evaluation reads its files with: ``data``'s prompt settings, the eval
    files and prompt column, in file order (the batch size: :meth:`EvalConfig.prompts_per_batch
    <core_rl.config.eval_config.EvalConfig.prompts_per_batch>`)."""
    assert cfg.eval is not None
    return attrs.evolve(
        cfg.data,
        train_files=list(cfg.eval.files),
        prompt_key=cfg.eval.prompt_key or cfg.data.prompt_key,
        shuffle=False,
        max_samples=None,
    )


def check_eval_data(cfg: RunConfig, required: Mapping[str, str]) -> tuple[list[DataRow], list[str]]:
    """Read ``eval.files`` (the first ``eval.max_prompts`` rows when set) and check their columns:
    the prompt column, the ``required`` ones (column -> who reads it) and ``eval.group_by``."""
    assert cfg.eval is not None
    rows, problems = read_data_files(cfg.eval.files, "eval.files", sources=cfg.data.sources)
    if cfg.eval.max_prompts:
        rows = rows[: cfg.eval.max_prompts]
    columns = dict(required)
    if cfg.eval.group_by is not None:
        columns[cfg.eval.group_by] = "eval.group_by"
    key_path = "eval.prompt_key" if cfg.eval.prompt_key else "data.prompt_key (or eval.prompt_key)"
    problems += check_rows(
        rows, eval_data_config(cfg).prompt_key, columns, key_path=key_path, chat_template=cfg.data.apply_chat_template
    )
    if not rows and not problems:
        problems.append("eval.files: the files hold no rows")
    return rows, problems


class PromptSource:
    """Draws ``batch_size`` prompts per call, reshuffling (seeded by ``seed + epoch``) at each epoch;
    an epoch of weighted ``data.train_files`` draws each source in proportion to its weight
    (:mod:`core_rl.data.mixture`).

    ``rows``: rows already read and checked (by :mod:`core_rl.loops.preflight`; tokenised there too when
    they are :class:`TokenisedRows` of the same settings); ``None`` reads ``config.train_files``
    here. ``select``: the items to draw of those tokenised, and the problems (a supervised loop's
    ``data.max_length``: :mod:`core_rl.loops.supervised.length_bound`). Raises :class:`DataError` listing
    every problem.

    ``state_dict()`` / ``load_state_dict()`` capture the position so a resumed run sees the same
    prompts it would have seen without interruption.

    With ``data.difficulty_filter`` (:attr:`difficulty`, :mod:`core_rl.loops.rl.difficulty`) a drawn
    prompt whose record is easy or hard may be skipped, the next of the epoch's order drawn in its
    place; its records are state of their own (not in ``state_dict()``, which stays the position).
    """

    def __init__(
        self,
        config: DataConfig,
        tokenizer: Any,
        *,
        seed: int,
        rows: Sequence[DataRow] | None = None,
        select: Select | None = None,
    ) -> None:
        self.config = config
        self.seed = seed
        problems: list[str] = []
        if rows is None:
            rows, problems = read_data_files(config.train_paths, sources=config.sources)
            problems += check_rows(rows, config.prompt_key, {}, chat_template=config.apply_chat_template)
        if not problems and not rows:
            problems.append(f"data.train_files: {config.train_paths} hold no rows")
        if not problems and isinstance(rows, TokenisedRows) and rows.key == tokenisation_key(config, tokenizer):
            self.items = list(rows.items)
        elif not problems:
            self.items, problems = tokenise_rows(rows, config, tokenizer)
        if not problems and select is not None:
            self.items, problems = select(self.items)
        if not problems:
            self.items = capped_items(self.items, config, seed=seed)
        self.sources = self._sources(problems)
        if problems:
            raise DataError(problems)
        if len(self.items) < config.batch_size:
            announce_once(
                f"core-rl: note: data.batch_size is {config.batch_size} but the training data holds "
                f"{len(self.items)} prompt(s) (after filtering): every batch draws some prompts more than once"
            )
        for i, item in enumerate(self.items):
            item.index = i
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)
        filter_config = config.difficulty_filter
        #: ``data.difficulty_filter``'s records (``None``: every prompt is drawn)
        self.difficulty = (
            DifficultyRecords(filter_config, seed=seed, prompts=len(self.items)) if filter_config is not None else None
        )
        self._skipped = {EASY: 0, HARD: 0}  # by the last next_batch()

    def _sources(self, problems: list[str]) -> list[list[int]]:
        """With weighted ``data.train_files``: each entry's item indices (:func:`mixture_sources`);
        else none."""
        if self.config.train_weights is None or problems:
            return []
        sources, empty = mixture_sources(self.items, self.config)
        problems.extend(empty)
        return sources

    def _permutation(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s item order: a seeded shuffle (``seed + epoch``) of every item, or the
        weighted mixture's draws (:func:`core_rl.data.mixture.mixture_order`)."""
        weights = self.config.train_weights
        if weights is not None:
            return mixture_order(self.sources, weights, seed=self.seed, epoch=epoch, shuffle=self.config.shuffle)
        order = list(range(len(self.items)))
        if self.config.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[PromptItem]:
        """The next ``data.batch_size`` prompts; an epoch boundary continues into the next epoch.
        With ``data.difficulty_filter``, prompts it skips are passed over (counted by
        :meth:`draw_metrics`); an epoch whose every draw it skipped raises
        :class:`~core_rl.loops.rl.difficulty.DifficultyFilterError`."""
        out: list[PromptItem] = []
        skipped = {EASY: 0, HARD: 0}
        in_a_row = 0
        while len(out) < self.config.batch_size:
            if self.position >= len(self._order):
                if in_a_row >= len(self._order):  # this epoch's every draw skipped
                    assert self.difficulty is not None
                    raise self.difficulty.nothing_left(in_a_row, self.epoch)
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            index = self._order[self.position]
            why = None if self.difficulty is None else self.difficulty.skip_reason(index, self.epoch, self.position)
            self.position += 1
            if why is None:
                out.append(self.items[index])
                in_a_row = 0
                continue
            skipped[why] += 1
            in_a_row += 1
        self._skipped = skipped
        return out

    def draw_metrics(self) -> dict[str, float]:
        """With ``data.difficulty_filter``: ``data/skipped_easy`` and ``data/skipped_hard``, the
        prompts the last :meth:`next_batch` skipped (none without)."""
        if self.difficulty is None:
            return {}
        return {"data/skipped_easy": float(self._skipped[EASY]), "data/skipped_hard": float(self._skipped[HARD])}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)
