"""Data files: rows read from JSON Lines, JSON or Parquet files, or from Hugging Face datasets, with
their 1-based position, and every problem found naming the file (or dataset) and the line or row.

An entry of ``data.train_files`` / ``eval.files`` is one of:

- a ``.jsonl`` file: JSON Lines, one object per line (blank lines are skipped);
- a ``.json`` file: JSON Lines too, or one array of objects (when the file starts with ``[``);
- a ``.parquet`` file: one row per Parquet row (null cells count as absent);
- a directory written by ``datasets``' ``Dataset.save_to_disk`` (it holds ``state.json`` and
  ``dataset_info.json``) or ``DatasetDict.save_to_disk`` (``dataset_dict.json``; the split is
  named by an ``@split`` suffix, ``path/to/dir@test``, default ``train``), read with
  ``datasets.load_from_disk``;
- ``hf:<repo_id>[:<config_name>][@<split>]``: a Hugging Face hub dataset (split ``train`` by
  default), e.g. ``hf:openai/gsm8k:main@train``, read with
  ``datasets.load_dataset(repo_id, config_name, split=split)``: from the local Hugging Face cache
  where it is there (``HF_HUB_OFFLINE=1`` reads only the cache), else downloaded into it. The repo
  id may also be a local directory of data files, as ``load_dataset`` accepts;
- ``source:<key>``: the rows a data-source plugin makes in memory (:mod:`core_rl.data.sources`;
  ``<key>`` a key of ``data.sources``, or a registered source's name), kept as the Python values it
  made (no JSON round trip), numbered as rows: ``source:gen row 7``.

Rows of a dataset are plain dicts (Arrow values as Python ones, null cells absent, as in Parquet).
``datasets`` is imported only when an entry is a dataset.

Files must be UTF-8 (a UTF-8 byte-order mark is accepted). Every problem names the file and the
1-based line (``train.jsonl:7``) or row (``train.parquet row 7``, ``hf:openai/gsm8k:main@train row 7``,
``data/saved@test row 7``).
"""

from __future__ import annotations

import codecs
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from core_rl.config.plugin_spec import PluginSpec
from core_rl.data.sources import source_key, source_rows

FORMATS = {".json": "json", ".jsonl": "jsonl", ".parquet": "parquet"}
#: the prefix of a Hugging Face hub dataset entry, ``hf:<repo_id>[:<config_name>][@<split>]``
HUB_PREFIX = "hf:"
#: the split read where an entry names none
DEFAULT_SPLIT = "train"
#: files of which a directory written by ``save_to_disk`` holds at least one
SAVED_DATASET_FILES = ("dataset_dict.json", "state.json", "dataset_info.json")
#: row-level problems listed per file before the rest are only counted
MAX_PROBLEMS_PER_FILE = 10
#: what a data source's rows must be, for its problems
ROWS_RULE = "DataSource.rows returns mappings such as {'prompt': ...}"
_BETWEEN_ITEMS = re.compile(r"\s*,?\s*")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@attrs.frozen
class DataRow:
    """One row of a data file: its columns, the file, and its 1-based ``line`` (JSON) or ``row``
    number (``unit``: Parquet files and datasets, whose ``file`` is e.g. ``hf:openai/gsm8k:main@train``)."""

    file: str
    line: int
    row: Mapping[str, Any]
    unit: str = "line"
    #: the index of the entry of ``data.train_files`` (or ``eval.files``) the row came from
    entry: int = 0

    @property
    def where(self) -> str:
        """``train.jsonl:7`` or ``train.parquet row 7``."""
        return f"{self.file}:{self.line}" if self.unit == "line" else f"{self.file} row {self.line}"


class Problems:
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


def kind_of(value: Any) -> str:
    """``a string ('abc')``: what a cell holds, for messages (type name and a short repr)."""
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
    return f'{where}: holds {kind_of(value)}, not a JSON object; each row must be an object such as {{"prompt": "..."}}'


def _json_lines(name: str, text: str, problems: Problems) -> list[DataRow]:
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


def _json_array(name: str, text: str, problems: Problems) -> list[DataRow]:
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


def _parquet(name: str, path: Path, problems: Problems) -> list[DataRow]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        records = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        problems.add(name, f"{name}: not a readable Parquet file ({reason}); it may be truncated or not Parquet")
        return []
    return _records(name, records, problems)


def _records(name: str, records: list[dict[str, Any]], problems: Problems) -> list[DataRow]:
    """Rows of a table (Parquet, a dataset) numbered from 1."""
    if not records:
        problems.add(name, f"{name}: holds no rows")
    # null cells (a column missing from some rows) count as absent
    return [
        DataRow(name, i, {k: v for k, v in record.items() if v is not None}, unit="row")
        for i, record in enumerate(records, start=1)
    ]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _dataset_rows(name: str, dataset: Any, problems: Problems) -> list[DataRow]:
    """Rows of a ``datasets.Dataset`` as plain dicts: its Arrow table (no image or audio decoding)
    turned into Python values, as a Parquet file's."""
    return _records(name, dataset.with_format("arrow")[:].to_pylist(), problems)


class _QuietDatasets:
    """``datasets`` imported, with its progress bars off while it loads (as they were after)."""

    def __enter__(self) -> Any:
        import datasets

        self.datasets, self.were_off = datasets, datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        return datasets

    def __exit__(self, *exc: object) -> None:
        if not self.were_off:
            self.datasets.enable_progress_bars()


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory that ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote."""
    return path.is_dir() and any((path / name).is_file() for name in SAVED_DATASET_FILES)


def _saved_dataset_entry(name: str) -> tuple[str, str | None] | None:
    """``(directory, split)`` where ``name`` names a saved dataset, ``dir`` or ``dir@split`` (a
    path with ``@`` in it that exists is taken whole); ``None`` for any other entry."""
    if is_saved_dataset(Path(name)):
        return name, None
    base, at, split = name.rpartition("@")
    if at and base and "/" not in split and not Path(name).exists() and Path(base).is_dir():
        return base, split
    return None


def _saved_dataset(name: str, directory: str, split: str | None, problems: Problems, key: str) -> list[DataRow]:
    if not is_saved_dataset(Path(directory)):
        problems.add(name, _not_a_saved_dataset(name, directory, key))
        return []
    with _QuietDatasets() as datasets:
        try:
            loaded = datasets.load_from_disk(directory)
        except Exception as exc:  # a truncated or foreign directory, however datasets refuses it
            problems.add(name, f"{key}: {name!r}: datasets cannot load the saved dataset: {_first_line(exc)}")
            return []
        if isinstance(loaded, datasets.DatasetDict):
            split = split or DEFAULT_SPLIT
            if split not in loaded:
                problems.add(
                    name,
                    f"{key}: {name!r}: the saved DatasetDict has no split {split!r} (splits: {', '.join(loaded)}); "
                    f"name one as {directory}@SPLIT",
                )
                return []
            return _dataset_rows(f"{directory}@{split}", loaded[split], problems)
        if split is not None:
            problems.add(
                name,
                f"{key}: {name!r}: {directory!r} holds one dataset (Dataset.save_to_disk), which has no splits; "
                f"drop '@{split}'",
            )
            return []
        return _dataset_rows(name, loaded, problems)


def _not_a_saved_dataset(name: str, directory: str, key: str) -> str:
    return (
        f"{key}: {directory!r} is a directory, but not one that datasets' save_to_disk wrote (it holds none of "
        f"{', '.join(SAVED_DATASET_FILES)}); list its .json, .jsonl or .parquet files, or use hf:{name} for a "
        "directory of data files that datasets.load_dataset reads"
    )


def parse_hub_entry(name: str) -> tuple[str, str | None, str]:
    """``(repo_id, config_name, split)`` of ``hf:<repo_id>[:<config_name>][@<split>]``; raises
    ``ValueError`` saying what is wrong."""
    rest = name[len(HUB_PREFIX) :]
    rest, at, split = rest.rpartition("@") if "@" in rest else (rest, "", DEFAULT_SPLIT)
    repo, colon, config = rest.partition(":")
    if not repo.strip():
        raise ValueError("names no dataset")
    if colon and not config.strip():
        raise ValueError("has an empty config name after ':'")
    if at and not split.strip():
        raise ValueError("has an empty split after '@'")
    return repo, config or None, split


_UNKNOWN_SPLIT = re.compile(r"Unknown split \"(?P<split>.*)\"\. Should be one of \[(?P<splits>.*)\]")


def _hub_dataset(name: str, problems: Problems, key: str) -> list[DataRow]:
    form = "hf:<repo_id>[:<config_name>][@<split>], e.g. hf:openai/gsm8k:main@train"
    try:
        repo, config, split = parse_hub_entry(name)
    except ValueError as exc:
        problems.add(name, f"{key}: {name!r} {exc}; write {form}")
        return []
    label = f"{HUB_PREFIX}{repo}{f':{config}' if config else ''}@{split}"
    with _QuietDatasets() as datasets:
        try:
            dataset = datasets.load_dataset(repo, config, split=split)
        except Exception as exc:  # not found, offline, unknown config or split: all the user's to fix
            unknown = _UNKNOWN_SPLIT.match(str(exc))
            if unknown:
                splits = unknown["splits"].replace("'", "")
                problems.add(name, f"{key}: {name!r}: the dataset has no split {split!r} (splits: {splits})")
                return []
            hint = ""
            if not Path(repo).exists():
                hint = (
                    "; a machine without access to the Hugging Face hub needs the dataset in its local cache "
                    "(HF_HOME; load it once where the hub is reachable) or saved with save_to_disk and listed as "
                    "that directory"
                )
            problems.add(name, f"{key}: cannot load {name!r}: {_first_line(exc)}{hint}")
            return []
        return _dataset_rows(label, dataset, problems)


def _source(name: str, problems: Problems, key: str, sources: Mapping[str, PluginSpec]) -> list[DataRow]:
    """The rows of a data source, numbered from 1; a row that is not a mapping is a problem."""
    made, problem = source_rows(name, sources, key)
    if problem is not None:
        problems.add(name, problem)
    rows = []
    for i, row in enumerate(made, start=1):
        if isinstance(row, Mapping):
            rows.append(DataRow(name, i, row, unit="row"))
        else:
            problems.add(
                name, f"{name} row {i}: the source made {kind_of(row)}, not a mapping of column to value; {ROWS_RULE}"
            )
    return rows


def _read_entry(name: str, problems: Problems, key: str, sources: Mapping[str, PluginSpec]) -> list[DataRow]:
    """The rows of one entry of ``key``: a data source, a hub dataset, a saved dataset or a file."""
    if source_key(name) is not None:
        return _source(name, problems, key, sources)
    if name.startswith(HUB_PREFIX):
        return _hub_dataset(name, problems, key)
    saved = _saved_dataset_entry(name)
    if saved is not None:
        return _saved_dataset(name, *saved, problems, key)
    return _read_file(name, problems, key)


def _read_file(name: str, problems: Problems, key: str) -> list[DataRow]:
    path = Path(name)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None and path.is_dir():
        problems.add(name, _not_a_saved_dataset(name, name, key))
        return []
    if fmt is None and not path.suffix and not path.exists():
        hint = f"; for a Hugging Face hub dataset write hf:{name}" if _HUB_ID.fullmatch(name) else ""
        problems.add(name, f"{key}: {name!r} does not exist{hint}")
        return []
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


def read_data_files(
    files: Sequence[str], key: str = "data.train_files", *, sources: Mapping[str, PluginSpec] | None = None
) -> tuple[list[DataRow], list[str]]:
    """Read every row of ``files`` (the config key ``key``: files, saved datasets, ``hf:`` and
    ``source:`` entries, see the module docstring; ``sources``: ``data.sources``) in order.
    Returns the rows and the problems found (each naming the entry, and the line or row where
    there is one); rows of an entry with problems may be missing, so use the rows only when there
    are none."""
    problems = Problems()
    rows: list[DataRow] = []
    for index, name in enumerate(files):
        read = _read_entry(name, problems, key, sources or {})
        rows.extend(read if index == 0 else (attrs.evolve(r, entry=index) for r in read))
    return rows, problems.result()
