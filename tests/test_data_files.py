"""Reading and checking prompt data files: every problem names the file and the 1-based line (or
Parquet row), never a traceback from the parsing layer."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from core_rl.data.prompts import MAX_PROBLEMS_PER_FILE, check_rows, read_data_files

EACH_ROW = 'each row must be an object such as {"prompt": "..."}'


def _read(path: Path) -> tuple[list, list[str]]:
    return read_data_files([str(path)])


def _only_problem(path: Path) -> str:
    _, problems = _read(path)
    assert len(problems) == 1, problems
    return problems[0]


def test_json_lines_rows_keep_their_1_based_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "answer": 2}\r\n')
    rows, problems = _read(path)
    assert problems == []
    assert [(r.line, r.row) for r in rows] == [(1, {"prompt": "a"}), (3, {"prompt": "b", "answer": 2})]
    assert rows[1].where == f"{path}:3"


def test_malformed_and_plain_text_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b",}\nhello world\n[1, 2]\n"text"\n{"prompt": "c"}\n')
    rows, problems = _read(path)
    assert [r.line for r in rows] == [1, 6]
    assert problems == [
        f"{path}:2: not valid JSON (Expecting property name enclosed in double quotes at column 16) in "
        '\'{"prompt": "b",}\'; each line must be one JSON object',
        f"{path}:3: not valid JSON (Expecting value at column 1) in 'hello world'; each line must be one JSON object",
        f"{path}:4: holds a list ([1, 2]), not a JSON object; {EACH_ROW}",
        f"{path}:5: holds a string ('text'), not a JSON object; {EACH_ROW}",
    ]


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ('{"prompt": "é"}\n'.encode("utf-16"), "is UTF-16 encoded; save it as UTF-8"),
        ('{"prompt": "é"}\n'.encode("utf-16-le"), "1: contains NUL bytes (a UTF-16 or binary file?)"),
        ('{"prompt": "a"}\n{"prompt": "café"}\n'.encode("latin-1"), "2: not valid UTF-8 (byte 0xe9 at column 16)"),
        ("{}\n".encode("utf-32"), "is UTF-32 encoded"),
        (b"", "is empty; it holds no rows"),
        (b"\n  \n", "is empty; it holds no rows"),
    ],
)
def test_encodings_and_empty_files(tmp_path, data, problem):
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    assert _only_problem(path).startswith(f"{path}:" if problem[0].isdigit() else f"{path}: ")
    assert problem in _only_problem(path)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes('{"prompt": "a"}\n'.encode("utf-8-sig"))
    rows, problems = _read(path)
    assert problems == [] and rows[0].row == {"prompt": "a"}


def test_json_array_rows_get_the_line_of_their_object(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"prompt": "a"},\n\n  {"prompt": "b"}, 7,\n  {"prompt": "c"}\n]\n')
    rows, problems = _read(path)
    assert [(r.line, r.row["prompt"]) for r in rows] == [(2, "a"), (4, "b"), (5, "c")]
    assert problems == [f"{path}:4: holds a number (7), not a JSON object; {EACH_ROW}"]
    path.write_text('[\n  {"prompt": "a"},\n  {"prompt": }\n]')
    assert _only_problem(path) == f"{path}:3:14: not valid JSON (Expecting value)"
    # a .json file may hold JSON Lines too; one pretty-printed object is neither
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [r.line for r in _read(path)[0]] == [1, 2]
    path.write_text('{\n  "prompt": "a"\n}\n')
    assert "holds one JSON object spread over several lines" in _only_problem(path)


def test_parquet_rows_nulls_and_truncation(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", None], "answer": [None, "x", "y"]}), path)
    rows, problems = _read(path)
    assert problems == []
    assert [(r.where, dict(r.row)) for r in rows] == [
        (f"{path} row 1", {"prompt": "a"}),
        (f"{path} row 2", {"prompt": "b", "answer": "x"}),
        (f"{path} row 3", {"answer": "y"}),
    ]
    data = path.read_bytes()
    for cut in (len(data) - 3, len(data) // 2, 4, 0):
        path.write_bytes(data[:cut])
        problem = _only_problem(path)
        assert problem.startswith(f"{path}: not a readable Parquet file (") and problem.endswith(
            "it may be truncated or not Parquet"
        )
    path.write_text('{"prompt": "a"}\n')  # JSON with a .parquet name
    assert "not a readable Parquet file" in _only_problem(path)


def test_file_problems_name_the_key(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    _, problems = read_data_files([str(tmp_path / "none.jsonl"), str(tmp_path / "d.csv"), str(tmp_path / "dir.jsonl")])
    assert problems == [
        f"data.train_files: {str(tmp_path / 'none.jsonl')!r} does not exist",
        f"data.train_files: {str(tmp_path / 'd.csv')!r} has an unsupported extension; use .json, .jsonl or .parquet",
        f"data.train_files: {str(tmp_path / 'dir.jsonl')!r} is not a file",
    ]


def test_row_checks_prompt_and_required_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [
        {"prompt": "ok", "answer": "1"},
        {"question": "q", "answer": "2"},
        {"prompt": 42, "answer": "3"},
        {"prompt": "", "answer": "4"},
        {"prompt": "ok"},
        {"prompt": "ok", "answer": None},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows, problems = _read(path)
    assert problems == []
    assert check_rows(rows, "prompt", {"answer": "reward 'exact_match'"}) == [
        f"{path}:2: no column 'prompt' (columns: question, answer); set data.prompt_key to the column holding the "
        "prompt text",
        f"{path}:3: column 'prompt' holds a number (42); prompts are text or a list of messages",
        f"{path}:4: column 'prompt' is an empty string",
        f"{path}:5: no column 'answer' (or it is null) (also lines 6), which reward 'exact_match' reads; add it to "
        "every row, or point the reward at the column that holds it",
    ]


def test_many_problems_are_capped_per_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("not json\n" * 25)
    rows, problems = _read(path)
    assert rows == [] and len(problems) == MAX_PROBLEMS_PER_FILE + 1
    assert problems[-1] == f"{path}: 15 more problem(s) like these"
    path.write_text('{"prompt": "p"}\n' * 25)
    rows, _ = _read(path)
    (problem,) = check_rows(rows, "prompt", {"answer": "reward 'r'"})
    assert "(also lines 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 and 14 more)" in problem


def test_a_misnamed_prompt_key_is_one_problem_per_file_in_its_place(tmp_path):
    """Every row of a file lacking the prompt column (``data.prompt_key`` misspelt) is one line, at
    the first such row, among the file's other problems in file order; past the file's cap of
    listed problems it is counted, not listed."""
    path = tmp_path / "d.jsonl"
    lines = [{"prompt": "", "answer": "0"}] + [{"question": f"q{i}", "answer": str(i)} for i in range(1, 25)]
    lines[3] = {"prompt": 7, "answer": "3"}
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows, _ = _read(path)
    assert check_rows(rows, "prompt", {}) == [
        f"{path}:1: column 'prompt' is an empty string",
        f"{path}:2: no column 'prompt' (columns: question, answer) (also lines 3, 5, 6, 7, 8, 9, 10, 11, 12, 13 and "
        "12 more); set data.prompt_key to the column holding the prompt text",
        f"{path}:4: column 'prompt' holds a number (7); prompts are text or a list of messages",
    ]
    other = tmp_path / "e.jsonl"
    other.write_text("".join(json.dumps({"prompt": ""}) + "\n" for _ in range(MAX_PROBLEMS_PER_FILE)) + '{"q": 1}\n')
    more, _ = _read(other)
    problems = check_rows(more, "prompt", {})
    assert len(problems) == MAX_PROBLEMS_PER_FILE + 1 and problems[-1] == f"{other}: 1 more problem(s) like these"
    assert all(p.endswith("is an empty string") for p in problems[:-1])
