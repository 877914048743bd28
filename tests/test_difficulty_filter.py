"""``data.difficulty_filter`` (core_rl.loops.rl.difficulty): group-mean records by hand, prompts
with an easy or hard record skipped when drawn again (plain epochs and weighted mixtures, against
the unfiltered order), the seeded keep draw, the records' round trip through a resume, an epoch
with nothing left to draw, the configuration checks, and real ``core-rl train`` runs: a prompt
the reward always solves is never drawn again, and a run resumed halfway draws what the
uninterrupted run drew."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from core_rl.config.data_config import DifficultyFilterConfig
from core_rl.config.loader import structure
from core_rl.config.schema import DataConfig, TrainFile
from core_rl.data.files import DataRow
from core_rl.data.prompts import PromptItem, PromptSource, TokenisedRows, tokenisation_key
from core_rl.errors import ConfigError
from core_rl.loops.rl.difficulty import DifficultyFilterError, group_means, keeps_anyway
from hypothesis import given, settings
from hypothesis import strategies as st

TOKENIZER = SimpleNamespace(name_or_path="test-tokenizer")  # items come tokenised: never called


def _source(
    sizes: list[int],
    *,
    weights: list[float] | None = None,
    batch: int = 2,
    seed: int = 0,
    shuffle: bool = True,
    **filter_options: float,
) -> PromptSource:
    """A prompt source over files of ``sizes[i]`` prompts (weighted with ``weights``), filtered by
    ``data.difficulty_filter`` with ``filter_options`` (none: no filter)."""
    paths = [f"s{i}.jsonl" for i in range(len(sizes))]
    files = paths if weights is None else [TrainFile(p, w) for p, w in zip(paths, weights)]
    difficulty = DifficultyFilterConfig(**filter_options) if filter_options else None
    config = DataConfig(train_files=files, batch_size=batch, shuffle=shuffle, difficulty_filter=difficulty)
    rows = [
        DataRow(p, j + 1, {"prompt": f"{p}#{j}"}, entry=k)
        for k, (p, n) in enumerate(zip(paths, sizes))
        for j in range(n)
    ]
    items = [PromptItem(row=r.row, text=r.row["prompt"], prompt_ids=[1], where=r.where, entry=r.entry) for r in rows]
    key = tokenisation_key(config, TOKENIZER)
    return PromptSource(config, TOKENIZER, seed=seed, rows=TokenisedRows(rows, items, key))


def _indices(source: PromptSource, batches: int) -> list[int]:
    return [item.index for _ in range(batches) for item in source.next_batch()]


def test_group_means_by_hand() -> None:
    # prompt 5 twice (groups 0 and 2: the later one is its record), prompt 7 with a NaN left out,
    # prompt 9 with no finite reward (no record)
    means = group_means(
        prompts=[5, 5, 7, 7, 5, 9],
        groups=[0, 0, 1, 1, 2, 3],
        rewards=[1.0, 0.0, 1.0, float("nan"), 0.25, float("inf")],
    )
    assert means == {5: 0.25, 7: 1.0}


def test_items_know_their_index_and_the_default_draws_as_before() -> None:
    plain = _source([3, 2])
    assert [item.index for item in plain.items] == [0, 1, 2, 3, 4]
    assert plain.difficulty is None and plain.draw_metrics() == {}
    filtered = _source([3, 2], easy_threshold=1.0)  # no record yet: every prompt is drawn
    assert _indices(filtered, 7) == _indices(plain, 7)
    assert filtered.draw_metrics() == {"data/skipped_easy": 0.0, "data/skipped_hard": 0.0}


def test_easy_and_hard_prompts_are_skipped_by_hand() -> None:
    source = _source([4], shuffle=False, easy_threshold=0.9, hard_threshold=0.1)
    assert _indices(source, 2) == [0, 1, 2, 3]  # epoch 0: no records yet
    assert source.difficulty is not None
    source.difficulty.observe({0: 1.0, 1: 0.0, 2: 0.5, 3: 0.9})  # easy, hard, neither, easy (at the bound)
    assert source.difficulty.metrics() == {
        "data/known_easy_fraction": 0.5,
        "data/known_hard_fraction": 0.25,
        "data/known_prompts": 4.0,
    }
    # epoch 1: 0 (easy) and 1 (hard) skipped, 2 drawn, 3 (easy) skipped; epoch 2: 0 and 1 skipped, 2 drawn
    assert [item.index for item in source.next_batch()] == [2, 2]
    assert source.draw_metrics() == {"data/skipped_easy": 3.0, "data/skipped_hard": 2.0}
    assert source.state_dict() == {"epoch": 2, "position": 3}
    source.difficulty.observe({3: 0.5})  # no longer easy: drawn again
    assert [item.index for item in source.next_batch()] == [3, 2]
    assert source.draw_metrics() == {"data/skipped_easy": 1.0, "data/skipped_hard": 1.0}


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    weighted=st.booleans(),
    batch=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_skipping_removes_exactly_the_known_prompts_from_the_unfiltered_order(
    sizes: list[int], weighted: bool, batch: int, seed: int, data: st.DataObject
) -> None:
    """Plain epochs and weighted mixtures: with every easy prompt recorded from the start, the
    filtered draws are the unfiltered source's draws with those prompts taken out (the epoch order
    is not changed, only passed over), and the skip counts are the prompts taken out; nothing left
    to draw is an error only for an epoch whose every draw is easy."""
    total = sum(sizes)
    weights = data.draw(st.lists(st.floats(0.1, 10), min_size=len(sizes), max_size=len(sizes))) if weighted else None
    easy = data.draw(st.sets(st.integers(0, total - 1), max_size=total - 1))
    plain = _source(sizes, weights=weights, batch=1, seed=seed)
    filtered = _source(sizes, weights=weights, batch=batch, seed=seed, easy_threshold=1.0)
    assert filtered.difficulty is not None
    filtered.difficulty.observe({i: 1.0 if i in easy else 0.0 for i in range(total)})
    drawn, skipped = [], 0
    for _ in range(3):
        try:
            drawn += [item.index for item in filtered.next_batch()]
        except DifficultyFilterError:  # only where an epoch's every draw is easy (a mixture may never draw the rest)
            assert set(filtered._permutation(filtered.epoch)) <= easy
            return
        skipped += int(filtered.draw_metrics()["data/skipped_easy"])
    # the unfiltered draws, one at a time, up to the filtered source's position
    unfiltered: list[int] = []
    while (plain.epoch, plain.position) != (filtered.epoch, filtered.position):
        unfiltered += _indices(plain, 1)
    assert drawn == [i for i in unfiltered if i not in easy]
    assert skipped == sum(i in easy for i in unfiltered)


def test_the_keep_draw_is_seeded_by_the_draws_place() -> None:
    """keep_probability 0.5: a skip depends on (seed, epoch, position) alone, by the documented
    formula; two sources of the same seed draw alike, another seed differently; about half the
    easy draws are kept."""

    def run(seed: int) -> tuple[list[int], int]:
        source = _source([5], batch=1, seed=seed, shuffle=False, easy_threshold=0.5, keep_probability=0.5)
        assert source.difficulty is not None
        source.difficulty.observe({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 0.0})  # only 4 is not easy
        drawn, skipped = [], 0
        for _ in range(200):
            drawn += [item.index for item in source.next_batch()]
            skipped += int(source.draw_metrics()["data/skipped_easy"])
        return drawn, skipped

    drawn, skipped = run(7)
    assert run(7) == (drawn, skipped)
    assert run(8)[0] != drawn
    # by the formula: walk the same (unshuffled) order, keeping what the formula keeps
    expected, epoch, position = [], 0, 0
    while len(expected) < len(drawn):
        if position == 5:
            epoch, position = epoch + 1, 0
        if position == 4 or random.Random(f"core-rl-difficulty:7:{epoch}:{position}").random() < 0.5:
            expected.append(position)
        position += 1
    assert drawn == expected
    kept_easy = sum(i != 4 for i in drawn)
    assert 0.35 < kept_easy / (kept_easy + skipped) < 0.65
    assert not keeps_anyway(7, 0, 0, 0.0) and keeps_anyway(7, 0, 0, 1.0)


@settings(max_examples=20, deadline=None)
@given(before=st.integers(0, 6), seed=st.integers(0, 100), keep=st.sampled_from([0.0, 0.3]))
def test_a_resumed_source_draws_what_the_uninterrupted_one_would(before: int, seed: int, keep: float) -> None:
    """The data position and the records (each through JSON, as checkpoints keep them) give a new
    source the draws of the one that went on; records observed along the way included."""

    def observe(source: PromptSource, batch: list[PromptItem]) -> None:
        assert source.difficulty is not None
        source.difficulty.observe({item.index: float(item.index % 3 == 0) for item in batch})

    options = {"easy_threshold": 1.0, "keep_probability": keep}
    whole = _source([4, 3], seed=seed, batch=2, **options)
    for _ in range(before):
        observe(whole, whole.next_batch())
    assert whole.difficulty is not None
    position, records = (
        json.loads(json.dumps(whole.state_dict())),
        json.loads(json.dumps(whole.difficulty.state_dict())),
    )
    resumed = _source([4, 3], seed=seed, batch=2, **options)
    resumed.load_state_dict(position)
    assert resumed.difficulty is not None and resumed.difficulty.load_state_dict(records) is None
    for _ in range(6):
        a, b = whole.next_batch(), resumed.next_batch()
        assert [i.index for i in a] == [i.index for i in b]
        assert whole.draw_metrics() == resumed.draw_metrics()
        observe(whole, a)
        observe(resumed, b)


def test_records_of_other_data_are_dropped_with_a_warning() -> None:
    saved = _source([4], easy_threshold=1.0)
    assert saved.difficulty is not None
    saved.difficulty.observe({0: 1.0})
    other = _source([5], easy_threshold=1.0)
    assert other.difficulty is not None
    note = other.difficulty.load_state_dict(saved.difficulty.state_dict())
    assert note is not None and "records are of 4 training prompts and the data now holds 5" in note
    assert other.difficulty.metrics()["data/known_prompts"] == 0.0


def test_an_epoch_with_nothing_left_to_draw_is_an_error() -> None:
    source = _source([3], batch=3, shuffle=False, easy_threshold=0.9, hard_threshold=0.1)
    assert _indices(source, 1) == [0, 1, 2]  # epoch 0, to its end
    assert source.difficulty is not None
    source.difficulty.observe({0: 1.0, 1: 0.0})
    assert _indices(source, 1) == [2, 2, 2]  # 2 is still drawn, from epochs 1 to 3
    assert source.state_dict() == {"epoch": 3, "position": 3}
    source.difficulty.observe({2: 0.95})
    with pytest.raises(DifficultyFilterError) as err:
        source.next_batch()
    assert str(err.value).startswith("data.difficulty_filter: skipped every prompt of epoch 4 (3 in a row)")
    assert "keep_probability > 0" in str(err.value) and err.value.exit_code == 2
    # the draw looked no further than the end of the first epoch it skipped whole
    assert source.state_dict() == {"epoch": 4, "position": 3}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"data\.difficulty_filter\.easy_threshold: must be set, or hard_threshold"),
        ({"easy_threshold": 0.5, "hard_threshold": 0.5}, r"hard_threshold: must be below easy_threshold \(0\.5\)"),
        ({"easy_threshold": 1.0, "keep_probability": 1.5}, r"keep_probability: must be in \[0, 1\]"),
    ],
)
def test_configuration_mistakes(options: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        structure({"train_files": ["a.jsonl"], "difficulty_filter": options}, DataConfig, path="data")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"trainer": {"loop": {"name": "sft"}}}, "data.difficulty_filter: the 'sft' loop scores no rollouts"),
        ({"rollout": {"engine": {"name": "gen"}, "replay_from": "x"}}, "a replay run (rollout.replay_from)"),
        ({"reward": None}, "prompts are measured by the rule reward (the reward: section) and this run has none"),
    ],
)
def test_the_filter_is_refused_where_it_would_do_nothing(
    tmp_path: Path, host, minimal_config: dict, change: dict, message: str
) -> None:
    pytest.importorskip("core_rl_sft")
    from core_rl.config import load_config

    minimal_config["data"]["difficulty_filter"] = {"easy_threshold": 1.0}
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(minimal_config))
    assert load_config(path, [], host=host).data.difficulty_filter == DifficultyFilterConfig(easy_threshold=1.0)
    path.write_text(json.dumps({**minimal_config, **change}))
    with pytest.raises(ConfigError) as err:
        load_config(path, [], host=host)
    assert any(p.startswith("data.difficulty_filter: ") and message in p for p in err.value.problems), err.value


def _steps(run: Path) -> tuple[dict[int, list[str]], dict[int, dict[str, float]]]:
    """The prompts each step drew (every sample of the step in ``samples.jsonl``) and each step's
    ``data/`` metrics."""
    from core_rl.builtin.loggers import read_metrics

    drawn: dict[int, list[str]] = {}
    for line in (run / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        drawn.setdefault(row["step"], []).append(row["prompt"])
    metrics = {
        r["step"]: {k: v for k, v in r.items() if k.startswith("data/")} for r in read_metrics(run / "metrics.jsonl")
    }
    return drawn, metrics


def _solved_prompt_run(tmp_path: Path, name: str, steps: int) -> dict:
    """A ``core-rl train`` config (fsdp + hf) on 2 prompts, "ab=" always solved and "ba=" never,
    with ``data.difficulty_filter: {easy_threshold: 1.0}``, a checkpoint each step and every
    sample logged; the tiny model and the data are written under ``tmp_path`` once."""
    import reward_functions
    from core_rl.testing.tiny import build_tiny_model

    model, data = tmp_path / "model", tmp_path / "train.jsonl"
    if not model.exists():
        build_tiny_model(model, alphabet="ab=", hidden_size=16, num_heads=2, seed=0)
        data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s}) + "\n" for s in ("ab", "ba")))
    return {
        "experiment": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 5},
        "data": {"train_files": [str(data)], "batch_size": 2, "difficulty_filter": {"easy_threshold": 1.0}},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 2, "max_new_tokens": 2}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "function", "path": f"{reward_functions.__file__}:solves_ab"},
        "trainer": {"total_steps": steps, "torch_threads": 1},
        "saver": {"every_n_steps": 1, "export_hf": False},
        "loggers": [{"name": "jsonl"}],
        "sample_log": {"every_n_steps": 1, "num_samples": 4},
    }


def test_a_real_run_stops_drawing_the_solved_prompt_and_resumes_exactly(tmp_path: Path, host) -> None:
    """``core-rl train`` (fsdp + hf, in this process) on 2 prompts, one of which the reward always
    solves: step 1 draws both (nothing measured yet), later steps draw only the other, skipping the
    solved one each time (the metrics count it); a run of 2 steps with a checkpoint each step,
    extended to 3 by a resume, draws and logs exactly what the uninterrupted 3-step run did (a
    resume that lost the records would draw the solved prompt at step 3). With the other prompt
    hard too, the second step finds nothing to draw and the run stops with the filter's error."""
    for dist in ("core_rl_fsdp", "core_rl_hf"):
        pytest.importorskip(dist)
    from core_rl.testing.faults import merged
    from fault_helpers import train_here

    def config(name: str, steps: int) -> dict:
        return _solved_prompt_run(tmp_path, name, steps)

    whole = config("whole", 3)
    train_here(whole, host)
    drawn, metrics = _steps(tmp_path / "runs" / "whole")
    assert sorted(drawn[1]) == ["ab=", "ab=", "ba=", "ba="]
    assert drawn[2] == drawn[3] == ["ba="] * 4
    assert metrics[1]["data/skipped_easy"] == 0.0 and metrics[1]["data/known_easy_fraction"] == 0.5
    # steps 2 and 3 take "ba" from epochs 1 to 4, passing over each epoch's "ab" (the last one's
    # only when it comes first): 3 or 4 skips, at least one a step
    assert metrics[2]["data/skipped_easy"] + metrics[3]["data/skipped_easy"] in (3.0, 4.0)
    assert metrics[2]["data/skipped_easy"] >= 1 and metrics[3]["data/skipped_easy"] >= 1
    assert all(m["data/skipped_hard"] == 0.0 and m["data/known_prompts"] == 2.0 for m in metrics.values())

    part = config("part", 2)
    train_here(part, host)
    train_here(merged(part, trainer={"total_steps": 3, "torch_threads": 1}, recover={"mode": "auto"}), host)
    assert _steps(tmp_path / "runs" / "part") == (drawn, metrics)

    # "ba" (always 0) is hard as well: step 2 has nothing left to draw, and the run says so
    dry = config("dry", 3)
    dry["data"]["difficulty_filter"]["hard_threshold"] = 0.0
    with pytest.raises(DifficultyFilterError, match=r"skipped every prompt of epoch 1 \(2 in a row\)"):
        train_here(dry, host)
    assert sorted(_steps(tmp_path / "runs" / "dry")[0]) == [1]


def test_an_asynchronous_run_skips_the_solved_prompt_too(tmp_path: Path, host) -> None:
    """The same filter with the rollout controller drawing ahead of the trainer (one version of
    staleness, in its own thread): the solved prompt is drawn before its first record (step 1, and
    the draws made ahead while step 1 trains), never after, and the skips are counted."""
    for dist in ("core_rl_fsdp", "core_rl_hf"):
        pytest.importorskip(dist)
    from fault_helpers import train_here

    steps = 5
    config = _solved_prompt_run(tmp_path, "async", steps)
    config["rollout"]["controller"] = {"max_head_offpolicyness": 1}
    config["saver"]["every_n_steps"] = 0
    train_here(config, host)
    drawn, metrics = _steps(tmp_path / "runs" / "async")
    assert sorted(drawn) == list(range(1, steps + 1))
    assert "ab=" in drawn[1]
    # drawn ahead at most one version: from step 3 on every draw knows the record of step 1
    assert all(drawn[s] == ["ba="] * 4 for s in range(3, steps + 1)), drawn
    assert sum(m["data/skipped_easy"] for m in metrics.values()) >= steps - 2
