"""``data.max_length`` and ``data.truncation`` (:mod:`core_rl.loops.supervised.length_bound`,
:func:`core_rl.loops.supervised.sequences.fit_to_length`): the cut keeps the start, the problems name the file and
line, ``drop`` says how many it dropped, and the keys are checked against each other and the loop."""

from __future__ import annotations

import pytest
import yaml
from core_rl import cli
from core_rl.config.data_config import DataConfig
from core_rl.data import prompts as data_module
from core_rl.data.prompts import PromptItem
from core_rl.loops.supervised.length_bound import bound_items
from core_rl.loops.supervised.sequences import TrainSequence, fit_to_length
from hypothesis import given
from hypothesis import strategies as st


@given(
    prompt=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    response=st.lists(st.integers(0, 9), max_size=12),
    suffix=st.integers(0, 1),
    with_mask=st.booleans(),
    max_length=st.integers(2, 24),
)
def test_fit_cuts_the_response_at_the_end_and_never_the_prompt(prompt, response, suffix, with_mask, max_length):
    trained = [i % 3 == 0 for i in range(len(prompt) + len(response))] if with_mask else None
    whole = TrainSequence(prompt, response, suffix, trained)
    got = fit_to_length(whole, max_length)
    if whole.length <= max_length:
        assert got == whole
        return
    room = max(max_length - suffix - len(prompt), 0)
    assert got.prompt == prompt and got.suffix == suffix
    assert got.response == response[:room]
    assert got.length == max(max_length, len(prompt) + suffix)
    assert got.trained == (None if trained is None else trained[: len(prompt) + room])
    assert fit_to_length(whole, None) == whole


def item(where: str, prompt: int, *responses: int) -> tuple[PromptItem, list[TrainSequence]]:
    """A row at ``where`` and its sequences: a ``prompt``-token prompt with each response length."""
    row = PromptItem(row={}, text=where, prompt_ids=[1] * prompt, where=where)
    return row, [TrainSequence([1] * prompt, [5] * r) for r in responses]


def bound(rows: list[tuple[PromptItem, list[TrainSequence]]], **data: object) -> tuple[list[str], list[str]]:
    """The ``where`` of the rows kept, and the problems."""
    sequences = {id(i): s for i, s in rows}
    kept, problems = bound_items([i for i, _ in rows], lambda i: sequences[id(i)], DataConfig(**data))
    return [i.where for i in kept], problems


def test_error_lists_ten_rows_a_file_then_a_count_and_what_to_do():
    rows = [item(f"a.jsonl:{n}", 3, 4 if n % 2 else 9) for n in range(1, 30)]  # 14 rows of 12 tokens
    rows.append(item("b.jsonl:2", 2, 3, 7))  # a pair: its rejected response is too long
    kept, problems = bound(rows, max_length=8)
    assert kept == [f"a.jsonl:{n}" for n in range(1, 30, 2)]
    assert problems[:10] == [f"a.jsonl:{n}: 12 tokens > data.max_length=8" for n in range(2, 21, 2)]
    assert problems[10:] == [
        "b.jsonl:2: 9 tokens > data.max_length=8",
        "a.jsonl: 4 more problem(s) like these",
        "data.max_length: the rows of data.train_files above are longer than 8 tokens (prompt and response, with "
        "the EOS the loop appends); raise it, or set data.truncation: drop (leave them out) or truncate (cut "
        "their responses)",
    ]
    assert bound(rows, max_length=12) == ([f"a.jsonl:{n}" for n in range(1, 30)] + ["b.jsonl:2"], [])
    assert bound(rows) == bound(rows, max_length=None) == ([r.where for r, _ in rows], [])


def test_drop_leaves_out_whole_pairs_and_says_how_many(monkeypatch, capsys):
    monkeypatch.setattr(data_module, "_ANNOUNCED", set())
    rows = [item("a.jsonl:1", 3, 2, 2), item("a.jsonl:2", 3, 2, 6), item("a.jsonl:3", 5, 4, 1)]
    assert bound(rows, max_length=8, truncation="drop") == (["a.jsonl:1"], [])
    assert capsys.readouterr().err.splitlines() == [
        "core-rl: data: dropped 2 of 3 rows longer than data.max_length=8 tokens (data.truncation: drop)"
    ]
    kept, problems = bound(rows, max_length=4, truncation="drop")
    assert kept == [] and problems == [
        "data.truncation: drop, but all 3 rows of data.train_files are longer than data.max_length=4 tokens "
        "(the shortest has 5); raise data.max_length"
    ]


def test_truncate_keeps_long_rows_unless_the_prompt_leaves_no_room():
    rows = [item("a.jsonl:1", 3, 9), item("a.jsonl:2", 7, 1, 3), item("a.jsonl:3", 8, 2), item("a.jsonl:4", 9, 1)]
    kept, problems = bound(rows, max_length=8, truncation="truncate")
    assert kept == ["a.jsonl:1", "a.jsonl:2"]
    assert problems == [
        "a.jsonl:3: 10 tokens > data.max_length=8, and its prompt alone has 8 tokens, which data.truncation: "
        "truncate never cuts",
        "a.jsonl:4: 10 tokens > data.max_length=8, and its prompt alone has 9 tokens, which data.truncation: "
        "truncate never cuts",
        "data.max_length: 8 leaves no room for a response after the prompts of the rows of data.train_files above; "
        "raise it, shorten those prompts, or set data.truncation: drop",
    ]
    # the rm loop's score slot counts: a 7-token prompt and its slot leave no room in 8
    slot = PromptItem(row={}, text="s", prompt_ids=[1] * 7, where="a.jsonl:5")
    config = DataConfig(max_length=8, truncation="truncate")
    _, problems = bound_items([slot], lambda _: [TrainSequence([1] * 7, [5, 5], 1)], config)
    assert problems[0].startswith("a.jsonl:5: 10 tokens > data.max_length=8, and its prompt alone has 8 tokens")


CONFIG = {
    "experiment": {"name": "run"},
    "data": {"train_files": ["train.jsonl"]},
    "actor": {"model_path": "model"},
    "algorithm": {"name": "sft"},
    "trainer": {"total_steps": 1},
}


@pytest.mark.parametrize(
    ("algorithm", "overrides", "message"),
    [
        (
            "sft",
            ["data.truncation=drop"],
            "data.truncation: drop says what to do with rows longer than data.max_length, which is unset; set "
            "data.max_length, or remove data.truncation",
        ),
        ("sft", ["data.max_length=1"], "data.max_length: must be in [2, 16777216], got 1"),
        ("sft", ["data.max_length=8", "data.truncation=cut"], "data.truncation: must be one of 'error', 'drop'"),
        (
            "grpo",
            ["data.max_length=8"],
            "data.max_length: bounds the sequences of the supervised loops (sft, dpo, kto, rm), not the 'rl' loop",
        ),
    ],
)
def test_config_mistakes_name_the_keys(tmp_path, capsys, algorithm, overrides, message):
    pytest.importorskip(f"core_rl_{algorithm}")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "algorithm": {"name": algorithm}}))
    assert cli.main(["config", "validate", str(path), *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert cli.main(["config", "validate", str(path), "data.max_length=8", "data.truncation=truncate"]) == (
        2 if algorithm == "grpo" else 0
    )
