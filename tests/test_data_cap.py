"""``data.max_samples``: at most that many training prompts, the first ones without ``shuffle``
and a seeded subset with it, in file order either way; ``trainer.total_epochs`` counts passes over
them; refused with weighted ``train_files``; and a real run that draws only the kept prompts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from core_rl.config.loader import structure
from core_rl.config.schema import DataConfig
from core_rl.data import prompts as data_module
from core_rl.data.files import DataRow
from core_rl.data.prompts import PromptItem, PromptSource, TokenisedRows, prompt_count, tokenisation_key
from core_rl.errors import ConfigError

TOKENIZER = SimpleNamespace(name_or_path="test-tokenizer")  # items come tokenised: never called


def _source(count: int, *, cap: int | None, shuffle: bool, seed: int = 0) -> tuple[PromptSource, TokenisedRows]:
    config = DataConfig(train_files=["d.jsonl"], batch_size=2, shuffle=shuffle, max_samples=cap)
    rows = [DataRow("d.jsonl", j + 1, {"prompt": f"p{j}"}) for j in range(count)]
    items = [PromptItem(row=r.row, text=r.row["prompt"], prompt_ids=[1], where=r.where) for r in rows]
    tokenised = TokenisedRows(rows, items, tokenisation_key(config, TOKENIZER))
    return PromptSource(config, TOKENIZER, seed=seed, rows=tokenised), tokenised


def _texts(source: PromptSource) -> list[str]:
    return [item.text for item in source.items]


@pytest.fixture(autouse=True)
def _announce_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_module, "_ANNOUNCED", set())


def test_without_shuffle_the_first_prompts_are_kept(capsys: pytest.CaptureFixture[str]) -> None:
    source, rows = _source(10, cap=4, shuffle=False)
    assert _texts(source) == ["p0", "p1", "p2", "p3"]
    assert [item.index for item in source.items] == [0, 1, 2, 3]
    drawn = {item.text for _ in range(6) for item in source.next_batch()}  # three epochs
    assert drawn == {"p0", "p1", "p2", "p3"}
    assert prompt_count(rows, source.config, TOKENIZER) == 4
    assert "data.max_samples: training on 4 of 10 prompts (the first ones)" in capsys.readouterr().err


def test_with_shuffle_a_seeded_subset_in_file_order() -> None:
    subsets = {seed: _texts(_source(10, cap=4, shuffle=True, seed=seed)[0]) for seed in range(6)}
    for seed, texts in subsets.items():
        assert len(texts) == 4 and texts == sorted(texts, key=lambda t: int(t[1:]))
        assert _texts(_source(10, cap=4, shuffle=True, seed=seed)[0]) == texts  # the same seed, the same subset
    assert len({tuple(t) for t in subsets.values()}) > 1  # the seed chooses
    assert subsets[0] != ["p0", "p1", "p2", "p3"] or subsets[1] != ["p0", "p1", "p2", "p3"]


def test_a_cap_above_the_rows_keeps_them_all_and_the_default_is_unchanged() -> None:
    capped, rows = _source(5, cap=50, shuffle=True)
    plain, _ = _source(5, cap=None, shuffle=True)
    assert _texts(capped) == _texts(plain) == [f"p{j}" for j in range(5)]
    assert [i.text for i in capped.next_batch()] == [i.text for i in plain.next_batch()]
    assert prompt_count(rows, capped.config, TOKENIZER) == 5


def test_fewer_prompts_than_a_batch_are_said_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Data smaller than ``data.batch_size`` trains (every batch repeats prompts), with one note on
    stderr saying so; data of a batch or more says nothing."""
    source, _ = _source(1, cap=None, shuffle=False)  # batch_size 2
    assert [item.text for item in source.next_batch()] == ["p0", "p0"]
    _source(1, cap=None, shuffle=False)  # once per process
    err = capsys.readouterr().err
    line = "core-rl: note: data.batch_size is 2 but the training data holds 1 prompt(s) (after filtering)"
    assert err.count(line) == 1, err
    _source(2, cap=None, shuffle=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"train_files": [{"path": "a.jsonl", "weight": 1.0}], "max_samples": 30},
            r"data.max_samples: .*with weighted entries each source's share of an epoch is its weight",
        ),
        ({"train_files": ["a.jsonl"], "max_samples": 0}, r"data.max_samples"),
        (
            {"train_files": ["a.jsonl"], "batch_size": 8, "max_samples": 4},
            r"data.max_samples: .*fewer than data.batch_size \(8\): every step would draw some prompts twice",
        ),
    ],
)
def test_configuration_mistakes(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        structure(data, DataConfig, path="data")


def test_a_cap_may_exceed_the_count_limits_of_other_keys() -> None:
    """A cap on a corpus of millions of rows (OpenRLHF's default is 1e8) is a valid value."""
    assert structure({"train_files": ["a.jsonl"], "max_samples": 20_000_000}, DataConfig, path="data").max_samples


def test_a_real_run_trains_an_epoch_of_the_kept_prompts(tmp_path: Path, host) -> None:
    """``core-rl train`` (fsdp + hf, in this process) on 6 prompts capped to the first 2, one epoch
    of batch 2: the run is 1 step long and draws only those 2 (an uncapped epoch would be 3 steps)."""
    for dist in ("core_rl_fsdp", "core_rl_hf"):
        pytest.importorskip(dist)
    from core_rl.testing.tiny import build_tiny_model
    from fault_helpers import train_here

    model = build_tiny_model(tmp_path / "model", alphabet="abc=", hidden_size=16, num_heads=2, seed=0)
    data = tmp_path / "train.jsonl"
    prompts = ["ab=", "ba=", "ca=", "ac=", "bc=", "cb="]
    data.write_text("".join(json.dumps({"prompt": p, "answer": p[:2]}) + "\n" for p in prompts))
    config = {
        "experiment": {"name": "capped", "output_dir": str(tmp_path / "runs")},
        "data": {"train_files": [str(data)], "batch_size": 2, "shuffle": False, "max_samples": 2},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 2, "max_new_tokens": 2}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "exact_match"},
        "trainer": {"total_epochs": 1, "torch_threads": 1},
        "saver": {"every_n_steps": 0, "export_hf": False},
        "loggers": [{"name": "jsonl"}],
        "sample_log": {"every_n_steps": 1, "num_samples": 4},
    }
    train_here(config, host)
    rows = [json.loads(line) for line in (tmp_path / "runs" / "capped" / "samples.jsonl").read_text().splitlines()]
    assert {row["step"] for row in rows} == {1}
    assert sorted({row["prompt"] for row in rows}) == ["ab=", "ba="]
