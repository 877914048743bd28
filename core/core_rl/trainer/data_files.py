"""Data files: rows read from JSON Lines, JSON or Parquet files with their 1-based position, and
every problem found naming the file and the line or row.

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
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

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
    if not records:
        problems.add(name, f"{name}: holds no rows")
    # null cells (a column missing from some rows) count as absent
    return [
        DataRow(name, i, {k: v for k, v in record.items() if v is not None}, unit="row")
        for i, record in enumerate(records, start=1)
    ]


def _read_file(name: str, problems: Problems, key: str) -> list[DataRow]:
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
    problems = Problems()
    rows: list[DataRow] = []
    for name in files:
        rows.extend(_read_file(name, problems, key))
    return rows, problems.result()
