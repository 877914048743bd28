"""Data sources beyond local files, on real datasets on disk: directories written by ``datasets``'
``save_to_disk`` (``dir``, ``dir@split``), ``hf:`` entries read by ``datasets.load_dataset`` (a
local directory of data files stands in for a hub id: the same code path), every mistake one
problem line naming the entry; and ``data.filter_overlong_prompts``."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest
from core_rl.config.schema import DataConfig
from core_rl.data import prompts as data_module
from core_rl.data.files import parse_hub_entry, read_data_files
from core_rl.data.prompts import PromptSource, check_rows, tokenisation_key, tokenise_rows
from core_rl.errors import DataError
from core_rl.testing.launch import write_grpo_config
from core_rl.testing.tiny import build_char_tokenizer, build_tiny_model

ROWS = [  # every column in every row (from_list takes the first row's): null stands for absent
    {"prompt": "ab=", "answer": 1, "tags": None},
    {"prompt": None, "answer": 2, "tags": ["x", "y"]},
    {"prompt": "c=", "answer": 3, "tags": None},
]
OFFLINE_HINT = "a machine without access to the Hugging Face hub needs the dataset in its local cache"


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_dataset`` caches what it prepares: here, in the test's own directory; and it never
    asks the hub (this machine has no access), as under ``HF_HUB_OFFLINE=1``."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(data_module, "_ANNOUNCED", set())


def _saved(path: Path, rows: list[dict] = ROWS) -> str:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def _saved_dict(path: Path) -> str:
    train = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": train, "test": train.select([2, 0])}).save_to_disk(str(path))
    return str(path)


def _where(rows) -> list[str]:
    return [r.where for r in rows]


def test_a_saved_dataset_reads_as_plain_rows_numbered_from_1(tmp_path):
    path = _saved(tmp_path / "saved")
    rows, problems = read_data_files([path])
    assert problems == []
    assert _where(rows) == [f"{path} row 1", f"{path} row 2", f"{path} row 3"]
    assert [r.row for r in rows] == [
        {"prompt": "ab=", "answer": 1},  # a null cell (the column absent from a row) counts as absent
        {"answer": 2, "tags": ["x", "y"]},
        {"prompt": "c=", "answer": 3},
    ]
    assert type(rows[0].row["answer"]) is int and type(rows[1].row["tags"]) is list  # Python values, not Arrow's
    assert all(type(r.row) is dict for r in rows)


def test_a_saved_dataset_dict_reads_the_split_after_the_at(tmp_path):
    path = _saved_dict(tmp_path / "dd")
    rows, problems = read_data_files([path])  # default: train
    assert problems == [] and _where(rows) == [f"{path}@train row {i}" for i in (1, 2, 3)]
    rows, problems = read_data_files([f"{path}@test"])
    assert problems == [] and [r.row["prompt"] for r in rows] == ["c=", "ab="]
    assert _where(rows) == [f"{path}@test row 1", f"{path}@test row 2"]
    assert read_data_files([f"{path}@validation"], "eval.files") == (
        [],
        [
            f"eval.files: '{path}@validation': the saved DatasetDict has no split 'validation' (splits: train, test); "
            f"name one as {path}@SPLIT"
        ],
    )


def test_saved_dataset_mistakes_are_one_line_each(tmp_path):
    single = _saved(tmp_path / "single")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "train.jsonl").write_text('{"prompt": "a"}\n')
    broken = Path(_saved(tmp_path / "broken"))
    next(broken.glob("*.arrow")).write_bytes(b"not arrow")
    entries = [f"{single}@test", str(tmp_path / "missing"), f"{tmp_path / 'missing'}@test", str(plain), str(broken)]
    rows, problems = read_data_files(entries)
    assert rows == []
    assert problems[:4] == [
        f"data.train_files: '{single}@test': '{single}' holds one dataset (Dataset.save_to_disk), which has no "
        "splits; drop '@test'",
        f"data.train_files: '{tmp_path / 'missing'}' does not exist",
        f"data.train_files: '{tmp_path / 'missing'}@test' does not exist",
        f"data.train_files: '{plain}' is a directory, but not one that datasets' save_to_disk wrote (it holds none "
        "of dataset_dict.json, state.json, dataset_info.json); list its .json, .jsonl or .parquet files, or use "
        f"hf:{plain} for a directory of data files that datasets.load_dataset reads",
    ]
    assert len(problems) == 5 and problems[4].startswith(
        f"data.train_files: '{broken}': datasets cannot load the saved dataset: "
    )
    assert "\n" not in problems[4]
    # a hub id written without its prefix is not a path: the message says how to write it
    assert read_data_files(["openai/gsm8k"])[1] == [
        "data.train_files: 'openai/gsm8k' does not exist; for a Hugging Face hub dataset write hf:openai/gsm8k"
    ]


def _data_dir(path: Path) -> str:
    """A directory of data files, which ``datasets.load_dataset`` takes as a repo id."""
    path.mkdir()
    (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (path / "test.jsonl").write_text('{"prompt": "b=", "answer": 7}\n')
    return str(path)


def test_hf_entries_load_with_load_dataset(tmp_path):
    repo = _data_dir(tmp_path / "mydata")
    rows, problems = read_data_files([f"hf:{repo}@test"])
    assert problems == [] and [(r.where, r.row) for r in rows] == [
        (f"hf:{repo}@test row 1", {"prompt": "b=", "answer": 7})
    ]
    rows, problems = read_data_files([f"hf:{repo}"])  # the split defaults to train, and the rows' name says so
    assert problems == [] and _where(rows) == [f"hf:{repo}@train row {i}" for i in (1, 2, 3)]
    assert rows[1].row == {"answer": 2, "tags": ["x", "y"]}
    assert read_data_files([f"hf:{repo}@dev"])[1] == [
        f"data.train_files: 'hf:{repo}@dev': the dataset has no split 'dev' (splits: train, test)"
    ]


def test_hf_entry_syntax():
    assert parse_hub_entry("hf:openai/gsm8k:main@test") == ("openai/gsm8k", "main", "test")
    assert parse_hub_entry("hf:openai/gsm8k") == ("openai/gsm8k", None, "train")
    assert parse_hub_entry("hf:/tmp/x/mydata@train[:10]") == ("/tmp/x/mydata", None, "train[:10]")
    form = "write hf:<repo_id>[:<config_name>][@<split>], e.g. hf:openai/gsm8k:main@train"
    assert read_data_files(["hf:", "hf:a/b:", "hf:a/b@"])[1] == [
        f"data.train_files: 'hf:' names no dataset; {form}",
        f"data.train_files: 'hf:a/b:' has an empty config name after ':'; {form}",
        f"data.train_files: 'hf:a/b@' has an empty split after '@'; {form}",
    ]


def test_a_hf_dataset_that_cannot_be_loaded_says_what_offline_needs(tmp_path):
    rows, problems = read_data_files(["hf:no-such-org/no-such-dataset:main@train"], "eval.files")
    assert rows == [] and len(problems) == 1, problems
    problem = problems[0]
    assert problem.startswith("eval.files: cannot load 'hf:no-such-org/no-such-dataset:main@train': ConnectionError: ")
    assert "no-such-org/no-such-dataset" in problem.split(": ", 3)[3] and "\n" not in problem
    assert problem.endswith(
        f"; {OFFLINE_HINT} (HF_HOME; load it once where the hub is reachable) or saved with save_to_disk and "
        "listed as that directory"
    )
    # a local directory that load_dataset refuses needs no hub hint
    repo = _data_dir(tmp_path / "d")
    (problem,) = read_data_files([f"hf:{repo}:nosuch"])[1]
    assert problem.startswith(f"data.train_files: cannot load 'hf:{repo}:nosuch': ValueError: ") and "nosuch" in problem
    assert OFFLINE_HINT not in problem


def test_row_problems_name_the_dataset_row(tmp_path):
    saved = _saved_dict(tmp_path / "dd")
    repo = _data_dir(tmp_path / "mydata")
    rows, problems = read_data_files([saved, f"hf:{repo}"])
    assert problems == []
    assert check_rows(rows, "prompt", {}) == [
        f"{saved}@train row 2: no column 'prompt' (columns: answer, tags); set data.prompt_key to the column "
        "holding the prompt text",
        f"hf:{repo}@train row 2: no column 'prompt' (columns: answer, tags); set data.prompt_key to the column "
        "holding the prompt text",
    ]
    problems = check_rows(rows, "answer", {"tags": "reward 'x'"})
    assert (
        problems[0]
        == f"{saved}@train row 1: column 'answer' holds a number (1); prompts are text or a list of messages"
    )
    assert (
        f"{saved}@train row 1: no column 'tags' (or it is null) (also rows 3), which reward 'x' reads; add it to "
        "every row, or point the reward at the column that holds it"
    ) in problems


def test_mixed_entries_keep_their_order(tmp_path):
    first = tmp_path / "a.jsonl"
    first.write_text('{"prompt": "x"}\n{"prompt": "y"}\n')
    saved = _saved_dict(tmp_path / "dd")
    last = tmp_path / "b.jsonl"
    last.write_text('{"prompt": "z"}\n')
    rows, problems = read_data_files([str(first), f"{saved}@test", str(last)])
    assert problems == []
    assert [(r.where, r.row["prompt"]) for r in rows] == [
        (f"{first}:1", "x"),
        (f"{first}:2", "y"),
        (f"{saved}@test row 1", "c="),
        (f"{saved}@test row 2", "ab="),
        (f"{last}:1", "z"),
    ]


# -- data.filter_overlong_prompts --------------------------------------------------------------

DROPPED = (
    "core-rl: data: dropped {} of {} prompts{} longer than data.max_prompt_tokens=4 (data.filter_overlong_prompts)"
)


def _prompts(path: Path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def test_filter_overlong_prompts_drops_exactly_the_long_ones(tmp_path, capsys, monkeypatch):
    tokenizer = build_char_tokenizer()  # one token per character after <s>: "abc" is 4 tokens
    files = [_prompts(tmp_path / "p.jsonl", ["abc", "abcd", "a", "abcdefg", "ab"])]
    config = DataConfig(train_files=files, max_prompt_tokens=4, batch_size=1)
    with pytest.raises(DataError, match=r"p.jsonl:2: the prompt has 5 tokens, more than data.max_prompt_tokens=4"):
        PromptSource(config, tokenizer, seed=0)  # off by default: too long is an error
    filtering = DataConfig(train_files=files, max_prompt_tokens=4, batch_size=1, filter_overlong_prompts=True)
    source = PromptSource(filtering, tokenizer, seed=0)
    assert sorted(item.text for item in source.items) == ["a", "ab", "abc"]
    assert capsys.readouterr().err == DROPPED.format(2, 5, "") + "\n"
    PromptSource(filtering, tokenizer, seed=0)  # the same line is said once per process
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(data_module, "_ANNOUNCED", set())
    monkeypatch.setenv("RANK", "1")  # only rank 0 of a torchrun job speaks
    assert len(PromptSource(filtering, tokenizer, seed=0).items) == 3
    assert capsys.readouterr().err == ""


def test_the_tokenised_items_preflight_hands_over_depend_on_the_filter():
    class Named:
        name_or_path = "tokenizer-dir"

    plain = DataConfig(max_prompt_tokens=4)
    assert tokenisation_key(plain, Named()) != tokenisation_key(
        DataConfig(max_prompt_tokens=4, filter_overlong_prompts=True), Named()
    )


def test_filter_overlong_prompts_keeps_other_problems_and_refuses_all_dropped(tmp_path, capsys):
    tokenizer = build_char_tokenizer()
    outside = max(tokenizer("ab")["input_ids"])  # a vocabulary that lacks "b"
    rows, _ = read_data_files([_prompts(tmp_path / "p.jsonl", ["abcd", "ab", "abcdef"])], "eval.files")
    config = DataConfig(max_prompt_tokens=4, filter_overlong_prompts=True)
    items, problems = tokenise_rows(rows, config, tokenizer, vocab_size=outside, files_key="eval.files")
    assert items == []
    assert problems == [
        f"{tmp_path / 'p.jsonl'}:2: the prompt has token id {outside}, outside the model's vocabulary (vocab_size "
        f"{outside}); the tokenizer does not match the model",
        "data.filter_overlong_prompts: all 2 prompts of eval.files are longer than data.max_prompt_tokens=4 tokens "
        "(the shortest has 5); raise data.max_prompt_tokens",
    ]
    assert capsys.readouterr().err == ""  # refused, not announced
    items, problems = tokenise_rows(rows, config, tokenizer, files_key="eval.files")
    assert problems == [] and [i.text for i in items] == ["ab"]
    assert capsys.readouterr().err == DROPPED.format(2, 3, " of eval.files") + "\n"
    items, problems = tokenise_rows(rows[:1] + rows[2:], config, tokenizer)
    assert items == [] and problems == [
        "data.filter_overlong_prompts: all 2 prompts of data.train_files are longer than data.max_prompt_tokens=4 "
        "tokens (the shortest has 5); raise data.max_prompt_tokens"
    ]


# -- end to end: core-rl config validate --preflight --------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "m", alphabet="abc=", hidden_size=16, num_heads=2)


def _run_yaml(tmp_path: Path, model: Path, train_files: list[str], **sections) -> str:
    return str(write_grpo_config(tmp_path, model, train_files, **sections))


def _plugins() -> None:
    for name in ("core_rl_fsdp", "core_rl_hf", "core_rl_grpo", "core_rl_reward_match"):
        pytest.importorskip(name)


def test_config_validate_preflight_reads_a_saved_dataset(tmp_path, tiny_model, capsys):
    _plugins()
    from core_rl import cli

    rows = [{"prompt": "ab=", "answer": "ba"}, {"prompt": "cab=", "answer": "bac"}, {"prompt": "a=", "answer": "a"}]
    saved = str(tmp_path / "dd")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(saved)
    path = _run_yaml(tmp_path, tiny_model, [saved])
    assert cli.main(["config", "validate", "--preflight", path]) == 0, capsys.readouterr().err
    assert "preflight passed" in capsys.readouterr().out
    assert cli.main(["config", "validate", "--preflight", path, f"data.train_files=[{saved}@test]"]) == 2
    err = capsys.readouterr().err
    assert (
        f"data.train_files: '{saved}@test': the saved DatasetDict has no split 'test' (splits: train); "
        f"name one as {saved}@SPLIT"
    ) in err
    assert "Traceback" not in err


def test_config_validate_preflight_filters_train_and_eval_prompts(tmp_path, tiny_model, capsys):
    _plugins()
    from core_rl import cli

    rows = [{"prompt": "ab=", "answer": "ba"}, {"prompt": "cab=", "answer": "bac"}, {"prompt": "a=", "answer": "a"}]
    saved = _saved(tmp_path / "saved", rows)  # "cab=" is 5 tokens with <s>, the others 4 and 3
    path = _run_yaml(tmp_path, tiny_model, [saved], eval={"files": [saved]})
    too_long = ["data.max_prompt_tokens=4"]
    assert cli.main(["config", "validate", "--preflight", path, *too_long]) == 2
    assert f"{saved} row 2: the prompt has 5 tokens, more than data.max_prompt_tokens=4" in capsys.readouterr().err
    filtering = [*too_long, "data.filter_overlong_prompts=true"]
    assert cli.main(["config", "validate", "--preflight", path, *filtering]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert DROPPED.format(1, 3, "") in err and DROPPED.format(1, 3, " of eval.files") in err
    assert cli.main(["config", "validate", "--preflight", path, *filtering, "data.max_prompt_tokens=2"]) == 2
    err = capsys.readouterr().err
    for files in ("data.train_files", "eval.files"):
        assert (
            f"data.filter_overlong_prompts: all 3 prompts of {files} are longer than data.max_prompt_tokens=2 tokens "
            "(the shortest has 3); raise data.max_prompt_tokens"
        ) in err
