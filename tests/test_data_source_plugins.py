"""Data sources (core_rl.data_sources): rows a plugin makes in memory, selected by ``source:<key>``
entries beside files. The built-in ``function`` source through the real reader (Python values kept,
rows numbered), a source in a weighted mixture with a file trained by ``core-rl train`` and resumed
bitwise, a misspelled source named with a did-you-mean (exit status 2), and a source that raises or
makes no rows named with its distribution."""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import core_rl.builtin.data_sources
import pytest
import yaml
from core_rl.config.plugin_spec import PluginSpec
from core_rl.config.sections import validate_plugin_section
from core_rl.data.files import read_data_files
from core_rl.data.sources import DataSource
from core_rl.errors import PluginFault
from core_rl.hookspecs import Register, hookimpl
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import DATA_SOURCE
from core_rl.testing import DataSourceContract, preloaded
from core_rl.testing.faults import build_task, merged, run_dir, same_run
from fault_helpers import cli_command, cli_env, cli_train

#: a data-source function file: each row's ``meta`` a tuple (what a JSON round trip would make a list)
SOURCE_FILE = """
def rows(words, tag):
    return [{"prompt": w + "=", "answer": w[::-1], "meta": (tag, len(w))} for w in words]
"""
#: a reward function that scores like char_match and gives -5 where the row's ``meta`` is no tuple
REWARD_FILE = """
def score(response, row):
    if "meta" in row and not isinstance(row["meta"], tuple):
        return -5.0
    answer = row["answer"]
    width = max(len(answer), len(response))
    return 1.0 if width == 0 else sum(a == b for a, b in zip(answer, response)) / width
"""


def contract_rows(count: int) -> list[dict[str, Any]]:
    """The rows the contract below checks the ``function`` source with: a tuple and a dict among them."""
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "meta": (i, {"parity": i % 2})} for i in range(count)]


class TestFunctionSource(DataSourceContract):
    plugin = core_rl.builtin.data_sources
    name = "function"
    distribution = "core-rl"
    options: ClassVar[dict[str, Any]] = {"path": f"{__file__}:contract_rows", "kwargs": {"count": 5}}
    expected_rows = 5
    columns: ClassVar[list[str]] = ["answer", "meta"]


def _function_spec(tmp_path: Path, words: list[str], tag: str = "t") -> PluginSpec:
    (tmp_path / "gen.py").write_text(SOURCE_FILE)
    spec = PluginSpec(
        name="function", options={"path": f"{tmp_path / 'gen.py'}:rows", "kwargs": {"words": words, "tag": tag}}
    )
    validate_plugin_section(PluginHost(), DATA_SOURCE, spec, "data.sources.gen")
    return spec


def test_a_function_source_is_read_beside_a_file_with_its_python_values(tmp_path: Path) -> None:
    spec = _function_spec(tmp_path, ["ab", "abc"])
    file = tmp_path / "f.jsonl"
    file.write_text(json.dumps({"prompt": "x=", "answer": "x"}) + "\n")
    rows, problems = read_data_files([str(file), "source:gen"], sources={"gen": spec})
    assert problems == []
    assert [(r.where, r.entry) for r in rows] == [(f"{file}:1", 0), ("source:gen row 1", 1), ("source:gen row 2", 1)]
    assert rows[1].row == {"prompt": "ab=", "answer": "ba", "meta": ("t", 2)}
    assert type(rows[2].row["meta"]) is tuple  # no JSON round trip


class Broken(DataSource):
    def __init__(self, config: Any) -> None:
        self.config = config

    def rows(self) -> Iterable[Mapping[str, Any]]:
        yield {"prompt": "fine"}
        raise RuntimeError("generator exploded")


class NotMappings(DataSource):
    def __init__(self, config: Any) -> None:
        self.config = config

    def rows(self) -> Iterable[Mapping[str, Any]]:
        return [{"prompt": "a"}, ["prompt", "b"]]


class Empty(NotMappings):
    def rows(self) -> Iterable[Mapping[str, Any]]:
        return []


class Plugin:
    @hookimpl
    def core_rl_register_data_sources(self, register: Register) -> None:
        register("broken", Broken, description="raises")
        register("lists", NotMappings, description="a row that is a list")
        register("empty", Empty, description="no rows")


def _spec(name: str) -> PluginSpec:
    host = PluginHost(entry_points=[])
    host.register_plugin(Plugin(), distribution="core-rl-broken-source", version="9.9")
    spec = PluginSpec(name=name)
    validate_plugin_section(host, DATA_SOURCE, spec, f"data.sources.{name}")
    return spec


def test_a_source_that_raises_names_itself_and_its_distribution() -> None:
    with pytest.raises(PluginFault) as caught:
        read_data_files(["source:b"], sources={"b": _spec("broken")})
    assert str(caught.value) == (
        "data source 'broken' (distribution core-rl-broken-source 9.9) failed while making its rows: "
        "RuntimeError: generator exploded"
    )
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_rows_that_are_not_mappings_and_a_source_with_no_rows_are_problems() -> None:
    rows, problems = read_data_files(["source:l", "source:e"], sources={"l": _spec("lists"), "e": _spec("empty")})
    assert [r.row for r in rows] == [{"prompt": "a"}]
    assert problems == [
        "source:l row 2: the source made a list (['prompt', 'b']), not a mapping of column to value; "
        "DataSource.rows returns mappings such as {'prompt': ...}",
        "data.train_files: 'source:e': data source 'empty' (distribution core-rl-broken-source 9.9) made no rows",
    ]


def test_eval_files_read_a_source_named_by_the_configuration(tmp_path: Path) -> None:
    """An entry of ``eval.files`` naming a ``data.sources`` key, validated by the loader, is read
    by evaluation's reader with its rows' Python values."""
    from core_rl.config.loader import load_config
    from core_rl.data.prompts import check_eval_data

    (tmp_path / "gen.py").write_text(SOURCE_FILE)
    gen = {"name": "function", "path": f"{tmp_path / 'gen.py'}:rows", "kwargs": {"words": ["ab", "cd"], "tag": "e"}}
    config = {
        "actor": {"model_path": "/m"},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "exact_match"},
        "data": {"train_files": ["t.jsonl"], "sources": {"gen": gen}},
        "eval": {"files": ["source:gen"]},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    cfg = load_config(path, host=PluginHost(), require_complete=False)
    assert cfg.data.sources["gen"].entry is not None  # validated by the loader
    rows, problems = check_eval_data(cfg, {"answer": "reward 'exact_match'"})
    assert problems == []
    assert [(r.where, r.row["meta"]) for r in rows] == [("source:gen row 1", ("e", 2)), ("source:gen row 2", ("e", 2))]


def test_a_registered_name_without_a_section_is_that_source_with_its_defaults() -> None:
    from core_rl.data.sources import resolve_source_entries

    host = PluginHost(entry_points=[])
    host.register_plugin(Plugin(), distribution="core-rl-broken-source", version="9.9")
    sources: dict[str, PluginSpec] = {}
    assert resolve_source_entries(sources, [("data.train_files[0]", "source:lists"), ("x", "a.jsonl")], host) == []
    assert list(sources) == ["lists"] and sources["lists"].name == "lists" and sources["lists"].entry is not None
    assert resolve_source_entries({}, [("eval.files[2]", "source:")], host) == [
        "eval.files[2]: 'source:' names no data source; write source:<key>, a key of data.sources"
    ]


def _validate(tmp_path: Path, data: dict[str, Any]) -> subprocess.CompletedProcess:
    config = {"actor": {"model_path": "/m"}, "algorithm": {"name": "grpo"}, "reward": {"name": "exact_match"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**config, "data": data}))
    return preloaded.run(cli_command("config", "validate", str(path)), capture_output=True, text=True, env=cli_env())


def test_a_misspelled_source_gets_a_did_you_mean_and_exit_status_2(tmp_path: Path) -> None:
    (tmp_path / "gen.py").write_text(SOURCE_FILE)
    gen = {"name": "function", "path": f"{tmp_path / 'gen.py'}:rows", "kwargs": {"words": ["ab"], "tag": "t"}}
    cases = {
        "source:functon": r"  - data.train_files\[0\]: 'source:functon' is no key of data.sources \(none\); "
        r"data source 'functon' is not installed; did you mean 'function'\? \(installed: .*function.*\)",
        "source:arith": r"  - data.train_files\[0\]: 'source:arith' is no key of data.sources \(arithmetic\) nor an "
        r"installed data source; did you mean 'source:arithmetic'\?",
    }
    for entry, line in cases.items():
        proc = _validate(tmp_path, {"train_files": [entry], "sources": {"arithmetic": gen} if "arith" in entry else {}})
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert any(re.fullmatch(line, ln) for ln in proc.stderr.splitlines()), proc.stderr
    proc = _validate(tmp_path, {"train_files": ["source:g"], "sources": {"g": {"name": "functoin", "path": "x.py:f"}}})
    assert proc.returncode == 2 and "data.sources.g.name: data source 'functoin' is not installed; did you mean " in (
        proc.stderr
    ), proc.stderr


def _mixture_task(root: Path, epochs: int) -> dict[str, Any]:
    """The tiny task's first two prompts in a file weighted 3, four more made by a ``function``
    source weighted 1 (6 prompts: 5 draws of the file and 1 of the source per epoch), scored by a
    reward that gives -5 to a source row whose tuple did not survive."""
    base = build_task(root)
    lines = Path(base["data"]["train_files"][0]).read_text().splitlines(keepends=True)
    file = root / "a.jsonl"
    file.write_text("".join(lines[:2]))
    (root / "gen.py").write_text(SOURCE_FILE)
    (root / "score.py").write_text(REWARD_FILE)
    source = {
        "name": "function",
        "path": f"{root / 'gen.py'}:rows",
        "kwargs": {"words": ["abc", "dca", "bd", "cc"], "tag": "s"},
    }
    data = {
        **base["data"],
        "train_files": [{"path": str(file), "weight": 3}, {"path": "source:gen", "weight": 1}],
        "sources": {"gen": source},
    }
    config = merged(base, data=data, loggers=[{"name": "jsonl"}], sample_log={"every_n_steps": 1, "num_samples": 8})
    config["reward"] = {"name": "function", "path": f"{root / 'score.py'}:score"}
    config["trainer"] = {"total_epochs": epochs, "torch_threads": 1}
    return config


def test_a_mixture_of_a_file_and_a_source_trains_and_resumes_bitwise(tmp_path: Path) -> None:
    whole = _mixture_task(tmp_path / "whole", 2)
    proc = cli_train(whole)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer.total_steps: 6 = ceil(2 epoch(s) x 6 prompts / 2 per step)" in proc.stderr
    samples = [json.loads(line) for line in (run_dir(whole) / "samples.jsonl").read_text().splitlines()]
    in_file = {json.loads(line)["prompt"] for line in (tmp_path / "whole" / "a.jsonl").read_text().splitlines()}
    draws = Counter("file" if s["prompt"] in in_file else "source" for s in samples)
    assert (draws["file"] // 4, draws["source"] // 4) == (10, 2)  # 2 epochs x (5, 1), 4 samples each
    assert all(0.0 <= s["reward"] <= 1.0 for s in samples)  # the source's tuples reached the reward

    part = _mixture_task(tmp_path / "part", 1)
    assert cli_train(part).returncode == 0
    resumed = cli_train(part, "trainer.total_epochs=2", "recover.mode=resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert same_run(run_dir(whole), run_dir(part), 6)
