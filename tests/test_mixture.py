"""Weighted mixtures of ``data.train_files`` (core_rl.data.mixture): each epoch's draws per
source in proportion to the weights, every prompt of a source drawn evenly, deterministic given the
seed, resumable from the data position, rows still naming their file; the weights' validation; a
real ``core-rl train`` run of a mixture, and its resume equal to the uninterrupted run."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import yaml
from core_rl.config.schema import DataConfig, TrainFile
from core_rl.data.files import DataRow
from core_rl.data.mixture import apportion
from core_rl.data.prompts import PromptItem, PromptSource, TokenisedRows, tokenisation_key
from core_rl.testing import preloaded
from core_rl.testing.faults import build_task, merged, run_dir, same_run
from fault_helpers import cli_command, cli_env, cli_train
from hypothesis import given, settings
from hypothesis import strategies as st

TOKENIZER = SimpleNamespace(name_or_path="test-tokenizer")  # items come tokenised: never called


def _source(sizes: list[int], weights: list[float] | None, *, batch: int = 2, seed: int = 0) -> PromptSource:
    """A prompt source over ``len(sizes)`` files of ``sizes[i]`` prompts, weighted or not."""
    paths = [f"s{i}.jsonl" for i in range(len(sizes))]
    files = paths if weights is None else [TrainFile(p, w) for p, w in zip(paths, weights)]
    config = DataConfig(train_files=files, batch_size=batch)
    rows = [
        DataRow(p, j + 1, {"prompt": f"{p}#{j}"}, entry=k)
        for k, (p, n) in enumerate(zip(paths, sizes))
        for j in range(n)
    ]
    items = [PromptItem(row=r.row, text=r.row["prompt"], prompt_ids=[1], where=r.where, entry=r.entry) for r in rows]
    return PromptSource(
        config, TOKENIZER, seed=seed, rows=TokenisedRows(rows, items, tokenisation_key(config, TOKENIZER))
    )


def _draw(source: PromptSource, batches: int) -> list[str]:
    return [item.where for _ in range(batches) for item in source.next_batch()]


@given(total=st.integers(0, 10_000), weights=st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=6))
def test_apportion_sums_to_the_total_within_one_of_each_share(total: int, weights: list[float]) -> None:
    counts = apportion(total, weights)
    assert sum(counts) == total
    for count, weight in zip(counts, weights):
        assert abs(count - total * weight / sum(weights)) < 1 + 1e-9


def test_apportion_by_hand() -> None:
    assert apportion(10, [0.7, 0.3]) == [7, 3]
    assert apportion(6, [3, 1]) == [5, 1]  # 4.5 and 1.5: the tie goes to the earlier source
    assert apportion(7, [1, 1, 1]) == [3, 2, 2]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=4),
    raw_weights=st.lists(st.floats(0.05, 20.0), min_size=4, max_size=4),
    batch=st.integers(1, 5),
    epochs=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_epochs_draw_each_source_in_proportion_and_its_prompts_evenly(
    sizes: list[int], raw_weights: list[float], batch: int, epochs: int, seed: int
) -> None:
    weights = raw_weights[: len(sizes)]
    total = sum(sizes)
    source = _source(sizes, weights, batch=batch, seed=seed)
    draws = _draw(source, -(-epochs * total // batch))[: epochs * total]
    per_source = Counter(where.split(":")[0] for where in draws)
    for i, (size, weight) in enumerate(zip(sizes, weights)):
        share = per_source[f"s{i}.jsonl"] / (epochs * total)
        assert abs(share - weight / sum(weights)) < 1 / total + 1e-9  # each epoch's count within 1 of its share
        per_prompt = Counter(where for where in draws if where.startswith(f"s{i}.jsonl:"))
        counts = [per_prompt[f"s{i}.jsonl:{j + 1}"] for j in range(size)]
        assert max(counts) - min(counts) <= 1, counts  # a source's prompts drawn evenly


def test_a_mixture_is_deterministic_given_the_seed_and_rows_keep_their_file() -> None:
    a, b = _source([3, 5], [0.8, 0.2], seed=7), _source([3, 5], [0.8, 0.2], seed=7)
    assert _draw(a, 40) == _draw(b, 40)
    assert _draw(_source([3, 5], [0.8, 0.2], seed=8), 40) != _draw(_source([3, 5], [0.8, 0.2], seed=7), 40)
    for item in _source([3, 5], [0.8, 0.2]).next_batch():
        file, index = item.row["prompt"].split("#")
        assert (item.entry, item.where) == (int(file[1:].split(".")[0]), f"{file}:{int(index) + 1}")


def test_sources_are_the_entries_whatever_label_their_rows_carry(tmp_path: Path) -> None:
    """A saved DatasetDict written without its split reads as ``dir@train``, and the same file may
    be listed twice: each entry is a source of its own."""
    import datasets
    from core_rl.data.files import read_data_files
    from core_rl.data.prompts import mixture_sources, tokenise_rows
    from core_rl.testing.tiny import build_char_tokenizer

    saved, jsonl = tmp_path / "saved", tmp_path / "a.jsonl"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "ab"}, {"prompt": "cd"}])}).save_to_disk(
        str(saved)
    )
    jsonl.write_text('{"prompt": "ef"}\n')
    files = [TrainFile(str(saved), 1.0), TrainFile(str(jsonl), 1.0), TrainFile(str(jsonl), 2.0)]
    config = DataConfig(train_files=files, batch_size=2, shuffle=False)
    rows, problems = read_data_files(config.train_paths)
    assert not problems and rows[0].file == f"{saved}@train" and [r.entry for r in rows] == [0, 0, 1, 2]
    tokenizer = build_char_tokenizer()
    items, _ = tokenise_rows(rows, config, tokenizer)
    assert mixture_sources(items, config) == ([[0, 1], [2], [3]], [])
    source = PromptSource(config, tokenizer, seed=0, rows=rows)
    assert len(source.sources) == 3 and sum(len(s) for s in source.sources) == 4


@settings(max_examples=40, deadline=None)
@given(before=st.integers(0, 30), after=st.integers(1, 20), seed=st.integers(0, 1000))
def test_a_resumed_mixture_draws_what_the_uninterrupted_one_would(before: int, after: int, seed: int) -> None:
    whole = _source([2, 4, 3], [1.0, 0.5, 2.5], batch=3, seed=seed)
    expected = _draw(whole, before + after)[3 * before :]
    first = _source([2, 4, 3], [1.0, 0.5, 2.5], batch=3, seed=seed)
    _draw(first, before)
    resumed = _source([2, 4, 3], [1.0, 0.5, 2.5], batch=3, seed=seed)
    resumed.load_state_dict(first.state_dict())
    assert _draw(resumed, after) == expected


def test_unweighted_files_keep_their_concatenated_order() -> None:
    """Plain paths are one list shuffled per epoch, as before weights existed."""
    source = _source([2, 3], None, batch=5, seed=4)
    import random

    order = list(range(5))
    random.Random(4).shuffle(order)
    wheres = ["s0.jsonl:1", "s0.jsonl:2", "s1.jsonl:1", "s1.jsonl:2", "s1.jsonl:3"]
    assert _draw(source, 1) == [wheres[i] for i in order]


def test_weight_problems_name_the_key_path_and_exit_2(tmp_path: Path) -> None:
    config = {
        "actor": {"model_path": "/m"},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "exact_match"},
        "data": {"train_files": [{"path": "a.jsonl", "weight": 0.7}, {"path": "b.jsonl", "weight": -1}]},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    cases = {
        (): "  - data.train_files[1].weight: must be in (0, 1000000000000.0], got -1.0",
        ("data.train_files[1].weight=.inf",): "  - data.train_files[1].weight: expected a finite number, got inf",
        ("data.train_files[1]=b.jsonl",): "  - data.train_files[1]: must be {path: ..., weight: ...} like "
        "train_files[0]: with weights every entry needs one, got 'b.jsonl'",
        ("data.train_files[1]={path: b.jsonl, wieght: 2}",): "  - data.train_files[1].wieght: unknown key; did you "
        "mean 'weight'?",
    }
    for overrides, line in cases.items():
        proc = preloaded.run(
            cli_command("config", "validate", str(path), *overrides), capture_output=True, text=True, env=cli_env()
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert [ln for ln in proc.stderr.splitlines() if ln.startswith("  - ")] == [line], proc.stderr


def _mixture_task(root: Path, epochs: int) -> dict:
    """The tiny task's prompts in two files, weighted 3:1 (6 prompts: 5 draws of the first file
    and 1 of the second per epoch), every sample in samples.jsonl."""
    base = build_task(root)
    lines = Path(base["data"]["train_files"][0]).read_text().splitlines(keepends=True)
    a, b = root / "a.jsonl", root / "b.jsonl"
    a.write_text("".join(lines[:2]))
    b.write_text("".join(lines[2:]))
    data = {**base["data"], "train_files": [{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}]}
    config = merged(base, data=data, loggers=[{"name": "jsonl"}], sample_log={"every_n_steps": 1, "num_samples": 8})
    config["trainer"] = {"total_epochs": epochs, "torch_threads": 1}
    return config


def test_a_mixture_run_draws_by_weight_and_resumes_bitwise(tmp_path: Path) -> None:
    whole = _mixture_task(tmp_path / "whole", 2)
    proc = cli_train(whole)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer.total_steps: 6 = ceil(2 epoch(s) x 6 prompts / 2 per step)" in proc.stderr
    samples = [json.loads(line)["prompt"] for line in (run_dir(whole) / "samples.jsonl").read_text().splitlines()]
    first = {json.loads(line)["prompt"] for line in (tmp_path / "whole" / "a.jsonl").read_text().splitlines()}
    draws = Counter("a" if prompt in first else "b" for prompt in samples)
    assert (draws["a"] // 4, draws["b"] // 4) == (10, 2)  # 2 epochs x (5, 1)

    part = _mixture_task(tmp_path / "part", 1)
    assert cli_train(part).returncode == 0
    resumed = cli_train(part, "trainer.total_epochs=2", "recover.mode=resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert same_run(run_dir(whole), run_dir(part), 6)
