"""Prompt data: rows read from JSON Lines, JSON or Parquet files with their 1-based position,
checked (the prompt column, the columns rewards read, the prompt's tokens), and drawn in shuffled
epochs with a resumable position.

Formats, by extension:

- ``.jsonl``: JSON Lines, one object per line (blank lines are skipped);
- ``.json``: JSON Lines too, or one array of objects (when the file starts with ``[``);
- ``.parquet``: one row per Parquet row (null cells count as absent).

Files must be UTF-8 (a UTF-8 byte-order mark is accepted). Every problem names the file and the
1-based line (``train.jsonl:7``) or Parquet row (``train.parquet row 7``).
"""

from __future__ import annotations

import codecs
import json
import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from core_rl.config.schema import DataConfig, RunConfig
from core_rl.errors import DataError

FORMATS = {".json": "json", ".jsonl": "jsonl", ".parquet": "parquet"}
#: row-level problems listed per file before the rest are only counted
MAX_PROBLEMS_PER_FILE = 10
_BETWEEN_ITEMS = re.compile(r"\s*,?\s*")


@attrs.frozen
class DataRow:
    """One row of a data file: its columns, the file, and its 1-based ``line`` (JSON) or Parquet
    ``row`` number (``unit``)."""

    file: str
    line: int
    row: Mapping[str, Any]
    unit: str = "line"

    @property
    def where(self) -> str:
        """``train.jsonl:7`` or ``train.parquet row 7``."""
        return f"{self.file}:{self.line}" if self.unit == "line" else f"{self.file} row {self.line}"


@attrs.define
class PromptItem:
    """One prompt: its data row (every column), its text and its token ids."""

    row: Mapping[str, Any]
    text: str
    prompt_ids: list[int]


class _Problems:
    """Problems in file order, at most :data:`MAX_PROBLEMS_PER_FILE` listed per file."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.per_file: Counter[str] = Counter()

    def add(self, file: str, message: str) -> None:
        self.per_file[file] += 1
        if self.per_file[file] <= MAX_PROBLEMS_PER_FILE:
            self.lines.append(message)

    def result(self) -> list[str]:
        hidden = [
            f"{file}: {count - MAX_PROBLEMS_PER_FILE} more problem(s) like these"
            for file, count in self.per_file.items()
            if count > MAX_PROBLEMS_PER_FILE
        ]
        return self.lines + hidden


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{names.get(type(value), type(value).__name__)} ({shown})"


def _decode(name: str, data: bytes) -> tuple[str | None, str | None]:
    """The file's text, or a problem naming the encoding and where decoding failed."""
    if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        return None, f"{name}: is UTF-32 encoded; save it as UTF-8"
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return None, f"{name}: is UTF-16 encoded; save it as UTF-8"
    nul = data.find(b"\x00")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        return None, f"{name}:{line}: contains NUL bytes (a UTF-16 or binary file?); save it as UTF-8 text"
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        return None, (
            f"{name}:{line}: not valid UTF-8 (byte 0x{data[exc.start]:02x} at column {column}); save the file as UTF-8"
        )


def _not_an_object(where: str, value: Any) -> str:
    return f'{where}: holds {_kind(value)}, not a JSON object; each row must be an object such as {{"prompt": "..."}}'


def _json_lines(name: str, text: str, problems: _Problems) -> list[DataRow]:
    rows = []
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line:
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == 1 and _whole_file_is_one_object(text):
                problems.add(
                    name,
                    f"{name}: holds one JSON object spread over several lines; write one object per line "
                    "(JSON Lines) or an array of objects",
                )
                return []
            start = line[:30] + ("..." if len(line) > 30 else "")
            problems.add(
                name,
                f"{name}:{number}: not valid JSON ({exc.msg} at column {exc.colno}) in {start!r}; "
                "each line must be one JSON object",
            )
            continue
        if not isinstance(value, dict):
            problems.add(name, _not_an_object(f"{name}:{number}", value))
            continue
        rows.append(DataRow(name, number, value))
    return rows


def _whole_file_is_one_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _json_array(name: str, text: str, problems: _Problems) -> list[DataRow]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        problems.add(name, f"{name}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})")
        return []
    if not isinstance(items, list):
        problems.add(name, _not_an_object(name, items))
        return []
    decoder = json.JSONDecoder()
    rows = []
    pos = text.index("[") + 1
    line, counted = 1, 0
    for value in items:
        pos = _BETWEEN_ITEMS.match(text, pos).end()  # type: ignore[union-attr]
        line += text.count("\n", counted, pos)
        counted = pos
        _, pos = decoder.raw_decode(text, pos)
        if isinstance(value, dict):
            rows.append(DataRow(name, line, value))
        else:
            problems.add(name, _not_an_object(f"{name}:{line}", value))
    return rows


def _parquet(name: str, path: Path, problems: _Problems) -> list[DataRow]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        records = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        problems.add(name, f"{name}: not a readable Parquet file ({reason}); it may be truncated or not Parquet")
        return []
    if not records:
        problems.add(name, f"{name}: holds no rows")
    # null cells (a column missing from some rows) count as absent
    return [
        DataRow(name, i, {k: v for k, v in record.items() if v is not None}, unit="row")
        for i, record in enumerate(records, start=1)
    ]


def _read_file(name: str, problems: _Problems, key: str) -> list[DataRow]:
    path = Path(name)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        problems.add(name, f"{key}: {name!r} has an unsupported extension; use .json, .jsonl or .parquet")
        return []
    if not path.exists():
        problems.add(name, f"{key}: {name!r} does not exist")
        return []
    if not path.is_file():
        problems.add(name, f"{key}: {name!r} is not a file")
        return []
    if fmt == "parquet":
        return _parquet(name, path, problems)
    try:
        data = path.read_bytes()
    except OSError as exc:
        problems.add(name, f"{key}: cannot read {name!r}: {exc.strerror or exc}")
        return []
    text, problem = _decode(name, data)
    if problem is not None:
        problems.add(name, problem)
        return []
    assert text is not None
    if not text.strip():
        problems.add(name, f"{name}: is empty; it holds no rows")
        return []
    if fmt == "json" and text.lstrip().startswith("["):
        return _json_array(name, text, problems)
    return _json_lines(name, text, problems)


def read_data_files(files: Sequence[str], key: str = "data.train_files") -> tuple[list[DataRow], list[str]]:
    """Read every row of ``files`` (the config key ``key``) in order. Returns the rows and the
    problems found (each naming the file, and the line or row where there is one); rows of a file
    with problems may be missing, so use the rows only when there are none."""
    problems = _Problems()
    rows: list[DataRow] = []
    for name in files:
        rows.extend(_read_file(name, problems, key))
    return rows, problems.result()


def check_rows(
    rows: Sequence[DataRow], prompt_key: str, required: Mapping[str, str], *, key_path: str = "data.prompt_key"
) -> list[str]:
    """Problems with the columns of ``rows``: the prompt column (present, a non-empty string; set
    by the config key ``key_path``) and each column of ``required`` (present and not null; the
    value names who reads it, e.g. ``"reward 'char_match'"``)."""
    problems = _Problems()
    lacking: dict[tuple[str, str], list[DataRow]] = {}
    for r in rows:
        prompt = r.row.get(prompt_key)
        if prompt_key not in r.row:
            columns = ", ".join(map(str, r.row)) or "none"
            problems.add(
                r.file,
                f"{r.where}: no column {prompt_key!r} (columns: {columns}); set {key_path} to the column "
                "holding the prompt text",
            )
        elif not isinstance(prompt, str):
            problems.add(
                r.file, f"{r.where}: column {prompt_key!r} holds {_kind(prompt)}, not text; prompts must be strings"
            )
        elif not prompt:
            problems.add(r.file, f"{r.where}: column {prompt_key!r} is an empty string")
        for column in required:
            if r.row.get(column) is None:
                lacking.setdefault((r.file, column), []).append(r)
    for (_file, column), where in lacking.items():
        first, rest = where[0], where[1:]
        also = ""
        if rest:
            shown = ", ".join(str(r.line) for r in rest[:MAX_PROBLEMS_PER_FILE])
            more = f" and {len(rest) - MAX_PROBLEMS_PER_FILE} more" if len(rest) > MAX_PROBLEMS_PER_FILE else ""
            also = f" (also {first.unit}s {shown}{more})"
        problems.add(
            first.file,
            f"{first.where}: no column {column!r} (or it is null){also}, which {required[column]} reads; add it to "
            "every row, or point the reward at the column that holds it",
        )
    return problems.result()


def encode_prompt(text: str, config: DataConfig, tokenizer: Any) -> list[int]:
    """Token ids of a prompt: the user turn of the chat template (``data.apply_chat_template``)
    or the text with the tokenizer's special tokens."""
    if config.apply_chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


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


def tokenise_rows(
    rows: Sequence[DataRow], config: DataConfig, tokenizer: Any, *, vocab_size: int | None = None
) -> tuple[list[PromptItem], list[str]]:
    """Tokenise the prompt of every row; return the items and the problems (prompts that
    tokenise to nothing, exceed ``data.max_prompt_tokens``, or hold ids outside ``vocab_size``).
    Rows whose prompt is not a string are skipped (:func:`check_rows` reports them)."""
    items, problems = [], _Problems()
    for r in rows:
        text = r.row.get(config.prompt_key)
        if not isinstance(text, str):
            continue
        try:
            ids = encode_prompt(text, config, tokenizer)
        except Exception as exc:  # the tokenizer or its chat template refusing this text
            problems.add(r.file, f"{r.where}: the tokenizer cannot encode the prompt: {type(exc).__name__}: {exc}")
            continue
        problem = _prompt_problem(r.where, ids, config, vocab_size)
        if problem is not None:
            problems.add(r.file, problem)
            continue
        items.append(PromptItem(row=r.row, text=text, prompt_ids=ids))
    return items, problems.result()


def tokenisation_key(config: DataConfig, tokenizer: Any) -> tuple[Any, ...] | None:
    """What decides the prompt items :func:`tokenise_rows` makes of the same rows: the prompt
    column, the chat-template setting, the length bound and the tokenizer's source (``None``, so
    nothing is reused, for a tokenizer that does not say where it came from)."""
    source = getattr(tokenizer, "name_or_path", None)
    if not source:
        return None
    return (config.prompt_key, config.apply_chat_template, config.max_prompt_tokens, str(source))


class TokenisedRows(list):  # list[DataRow]
    """Rows that :func:`core_rl.preflight.preflight` read, checked and tokenised without a
    problem: still the list of :class:`DataRow` a training loop receives, plus the prompt items
    that tokenising gave (``key``: :func:`tokenisation_key`), so that :class:`PromptSource` under
    the same settings takes them instead of tokenising every prompt a second time."""

    def __init__(self, rows: Sequence[DataRow], items: Sequence[PromptItem], key: tuple[Any, ...]) -> None:
        super().__init__(rows)
        self.items = list(items)
        self.key = key


def eval_data_config(cfg: RunConfig) -> DataConfig:
    """The data section evaluation reads its files with: ``data``'s prompt settings, the eval
    files, prompt column and batch size, in file order."""
    assert cfg.eval is not None
    return attrs.evolve(
        cfg.data,
        train_files=list(cfg.eval.files),
        prompt_key=cfg.eval.prompt_key or cfg.data.prompt_key,
        batch_size=cfg.eval.batch_size or cfg.data.batch_size,
        shuffle=False,
    )


def check_eval_data(cfg: RunConfig, required: Mapping[str, str]) -> tuple[list[DataRow], list[str]]:
    """Read ``eval.files`` (the first ``eval.max_prompts`` rows when set) and check their columns:
    the prompt column, the ``required`` ones (column -> who reads it) and ``eval.group_by``."""
    assert cfg.eval is not None
    rows, problems = read_data_files(cfg.eval.files, "eval.files")
    if cfg.eval.max_prompts:
        rows = rows[: cfg.eval.max_prompts]
    columns = dict(required)
    if cfg.eval.group_by is not None:
        columns[cfg.eval.group_by] = "eval.group_by"
    key_path = "eval.prompt_key" if cfg.eval.prompt_key else "data.prompt_key (or eval.prompt_key)"
    problems += check_rows(rows, eval_data_config(cfg).prompt_key, columns, key_path=key_path)
    if not rows and not problems:
        problems.append("eval.files: the files hold no rows")
    return rows, problems


class PromptSource:
    """Draws ``batch_size`` prompts per call, reshuffling (seeded by ``seed + epoch``) at each epoch.

    ``rows``: rows already read and checked (by :mod:`core_rl.preflight`; tokenised there too when
    they are :class:`TokenisedRows` of the same settings); ``None`` reads ``config.train_files``
    here. Raises :class:`DataError` listing every problem.

    ``state_dict()`` / ``load_state_dict()`` capture the position so a resumed run sees the same
    prompts it would have seen without interruption.
    """

    def __init__(self, config: DataConfig, tokenizer: Any, *, seed: int, rows: Sequence[DataRow] | None = None) -> None:
        self.config = config
        self.seed = seed
        problems: list[str] = []
        if rows is None:
            rows, problems = read_data_files(config.train_files)
            problems += check_rows(rows, config.prompt_key, {})
        if not problems and not rows:
            problems.append(f"data.train_files: {list(config.train_files)} hold no rows")
        if not problems and isinstance(rows, TokenisedRows) and rows.key == tokenisation_key(config, tokenizer):
            self.items = list(rows.items)
        elif not problems:
            self.items, problems = tokenise_rows(rows, config, tokenizer)
        if problems:
            raise DataError(problems)
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.config.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[PromptItem]:
        """The next ``data.batch_size`` prompts; an epoch boundary continues into the next epoch."""
        out: list[PromptItem] = []
        while len(out) < self.config.batch_size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            out.append(self.items[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)
