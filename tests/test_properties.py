"""Property-based tests (hypothesis): generated configurations, YAML texts, overrides, data files and
model directories. Whatever the input, the outcome is exit status 0 or 2 (or a clean result from
the preflight check), never a traceback, and every rejection names a key path, an override, or a
file position.

The number of generated cases per test is bounded (``EXAMPLES``) and derandomised, so CI runs the
same cases every time in well under a minute; the total is :data:`TOTAL_EXAMPLES`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from core_rl.cli import main
from core_rl.data.prompts import check_rows, read_data_files
from core_rl.loops.preflight import check_model_dir, check_tokenizer_dir
from core_rl.testing.tiny import build_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

EXAMPLES = {"configs": 100, "yaml_texts": 50, "overrides": 120, "data_files": 120, "parquet": 30, "model_dirs": 40}
TOTAL_EXAMPLES = sum(EXAMPLES.values())


def _settings(name: str) -> settings:
    return settings(
        max_examples=EXAMPLES[name],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


BASE: dict[str, Any] = {
    "experiment": {"name": "run", "output_dir": "runs", "seed": 1},
    "data": {"train_files": ["${experiment.output_dir}/train.jsonl"], "prompt_key": "prompt", "batch_size": 4},
    "actor": {
        "model_path": "${experiment.output_dir}/model",
        "engine": {"name": "fsdp", "wrap": "root"},
        "optimizer": {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.99]},
        "lr_scheduler": {"name": "cosine", "warmup_steps": 2},
        "grad_clip": 1.0,
    },
    "rollout": {
        "engine": {"name": "hf", "device": "cpu"},
        "sampling": {"n": 4, "temperature": 1.0, "max_new_tokens": 8, "stop_token_ids": [2]},
    },
    "algorithm": {"name": "grpo", "loss": {"name": "ppo_clip", "eps_clip": 0.2}, "filters": ["drop_uniform_groups"]},
    "reward": {"name": "char_match", "answer_key": "answer"},
    "loggers": [{"name": "console", "every_n_steps": 5}, {"name": "jsonl"}],
    "saver": {"every_n_steps": 10, "keep_last": 2},
    "trainer": {"total_steps": 20, "torch_threads": 1},
}

_SEGMENT = r"(?:[\w-]+|'[^']*'|\"[^\"]*\")"
KEY_PATH = re.compile(rf"{_SEGMENT}(?:\.{_SEGMENT}|\[\d+\])*: ")


def _cli(*args: str) -> tuple[int, str]:
    """Run the CLI in-process; any exception other than the CLI's own exit is a failure."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return code, err.getvalue()


def _assert_clean(code: int, stderr: str, config: Path) -> None:
    """Exit 0 or 2, no traceback, and every problem names a key path, an override or the file."""
    assert code in (0, 2), stderr
    assert "Traceback" not in stderr
    if code == 0:
        return
    heading, *lines = [line for line in stderr.splitlines() if not line.startswith("core-rl: note: ")]
    assert heading.startswith("core-rl: error: ")
    problems = [line.removeprefix("  - ") for line in lines]
    assert problems, stderr
    whole_file = f"in {config}:" in heading
    for problem in problems:
        assert (
            problem.startswith(("override '", 'override "', str(config)))
            or KEY_PATH.match(problem)
            or (whole_file and problem.startswith(("cannot parse YAML", "the top level must be a mapping")))
        ), f"no key path or position in {problem!r} of:\n{stderr}"


# -- configurations -----------------------------------------------------------------------------

NAMES = st.sampled_from(
    ["name", "lr", "n", "engine", "sampling", "loss", "answer_key", "device", "x", "0", "every_n_steps", "filters"]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["fsdp", "hf", "grpo", "rloo", "exact_match", "console", "float16", "cuda", "${experiment.name}"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(NAMES, st.integers(min_value=-3, max_value=3)), inner, max_size=3),
    ),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


@st.composite
def mutated_configs(draw: st.DrawFn) -> dict:
    config = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        paths = _paths(config)
        path = draw(st.sampled_from(paths))
        parent = config
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["set", "set", "delete", "add"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.one_of(NAMES, st.integers(min_value=0, max_value=3)))] = draw(VALUES)
        else:
            parent[path[-1]] = draw(VALUES)
    return config


@_settings("configs")
@given(config=mutated_configs())
def test_generated_configs_validate_cleanly(config, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    code, stderr = _cli("config", "validate", str(path))
    _assert_clean(code, stderr, path)


def test_the_base_config_is_valid(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert _cli("config", "validate", str(path)) == (0, "")


YAML_TEXTS = st.one_of(
    st.text(max_size=80),
    st.lists(
        st.sampled_from(
            [
                "actor:",
                "  optimizer:",
                "    lr: 1e-3",
                "  - x",
                "reward: {name: char_match",
                "1: 2",
                "null: 3",
                "data: [",
                "  engine: fsdp",
                "trainer:\n\ttotal_steps: 3",
                "a: &x 1",
                "b: *y",
                "c: !!python/name:os.system",
                "d: ${",
                "e: '${x'",
                "? [1, 2]\n: 3",
                "f: |\n  text",
                "- 1",
                "g: 2001-01-01",
                "'h': !!binary aGk=",
            ]
        ),
        max_size=6,
    ).map("\n".join),
)


@_settings("yaml_texts")
@given(text=YAML_TEXTS)
def test_generated_yaml_texts_fail_cleanly(text, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    code, stderr = _cli("config", "validate", str(path))
    _assert_clean(code, stderr, path)


# -- overrides ----------------------------------------------------------------------------------

SEGMENTS = st.sampled_from(
    [
        "actor",
        "optimizer",
        "lr",
        "betas",
        "engine",
        "name",
        "rollout",
        "sampling",
        "n",
        "stop_token_ids",
        "loggers",
        "filters",
        "algorithm",
        "reward",
        "answer_key",
        "trainer",
        "total_steps",
        "data",
        "train_files",
        "experiment",
        "backend",
        "every_n_steps",
        "x",
        "0",
        "1",
    ]
)
KEYS = st.builds(
    lambda tilde, segments, indices: (
        ("~" if tilde else "") + ".".join(s + "".join(f"[{i}]" for i in idx) for s, idx in zip(segments, indices))
    ),
    st.booleans(),
    st.lists(SEGMENTS, min_size=1, max_size=4),
    st.lists(st.lists(st.integers(min_value=0, max_value=3), max_size=1), min_size=4, max_size=4),
)
RAW_VALUES = st.one_of(
    st.sampled_from(
        [
            "1",
            "-1",
            "0",
            "1e-5",
            "inf",
            ".nan",
            "1e309",
            "true",
            "null",
            "''",
            "[1",
            "{a: 1",
            "[0.9, 0.99]",
            "{name: exact_match}",
            "{name: console, every_n_steps: 2}",
            "{name: x, k: ${a.b}}",
            "${experiment.name}",
            "${nowhere}",
            "${",
            "[${experiment.name}, 2]",
            "grpo",
            "rloo",
            "fsdp",
            "float16",
            "cuda:3",
            "nccl",
            "'12'",
            "{1: 2}",
            "[[1]]",
            "@x",
            "a: b",
            "char_mach",
            "{name: ${experiment.name}}",
            "- 1",
            "'unterminated",
        ]
    ),
    st.text(max_size=10),
)
OVERRIDES = st.lists(
    st.one_of(
        st.builds(lambda k, v: k if k.startswith("~") else f"{k}={v}", KEYS, RAW_VALUES),
        st.text(max_size=15),
    ),
    min_size=1,
    max_size=3,
)


@_settings("overrides")
@given(overrides=OVERRIDES)
def test_generated_overrides_apply_or_fail_cleanly(overrides, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(BASE))
    # "--" keeps an override that starts with "-" from being read as an option
    code, stderr = _cli("config", "validate", str(path), "--", *overrides)
    _assert_clean(code, stderr, path)


# -- data files ---------------------------------------------------------------------------------

ROWS = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(max_size=8), "answer": st.text(max_size=4)}),
    st.fixed_dictionaries({"prompt": SCALARS}),
    st.dictionaries(st.sampled_from(["prompt", "answer", "question"]), SCALARS, max_size=3),
).map(lambda row: json.dumps(row, allow_nan=True))
LINES = st.one_of(ROWS, ROWS, st.text(max_size=20), st.sampled_from(["", "[1, 2]", '"x"', "{", "null", "  "]))


@st.composite
def data_files(draw: st.DrawFn) -> tuple[str, bytes]:
    suffix = draw(st.sampled_from([".jsonl", ".json"]))
    lines = draw(st.lists(LINES, max_size=6))
    text = "[" + ",\n".join(lines) + "]" if suffix == ".json" and draw(st.booleans()) else "\n".join(lines)
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-16-le", "latin-1"]))
    data = text.encode(encoding, errors="replace")
    if draw(st.booleans()):
        cut = draw(st.integers(min_value=0, max_value=len(data)))
        data = data[:cut] + draw(st.binary(max_size=4))
    return suffix, data


def _assert_named(problems: list[str], name: str) -> None:
    for problem in problems:
        assert problem.startswith((f"{name}:", f"{name} row ", "data.train_files: ")), problem


@_settings("data_files")
@given(file=data_files())
def test_generated_data_files_read_or_name_the_position(file, tmp_path):
    suffix, data = file
    path = tmp_path / f"train{suffix}"
    path.write_bytes(data)
    rows, problems = read_data_files([str(path)])
    _assert_named(problems, str(path))
    row_problems = check_rows(rows, "prompt", {"answer": "reward 'char_match'"})
    _assert_named(row_problems, str(path))
    if not problems and not row_problems:
        assert all(isinstance(r.row["prompt"], str) and r.row.get("answer") is not None for r in rows)
        assert all(r.line >= 1 for r in rows)


@_settings("parquet")
@given(
    prompts=st.lists(st.one_of(st.none(), st.text(max_size=6)), min_size=1, max_size=5),
    cut=st.floats(min_value=0.0, max_value=1.0),
)
def test_generated_parquet_files_read_or_name_the_file(prompts, cut, tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": prompts}), path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    rows, problems = read_data_files([str(path)])
    _assert_named(problems, str(path))
    if cut == 1.0:
        assert problems == [] and [r.row.get("prompt") for r in rows] == prompts


# -- model directories --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "m", alphabet="ab=", hidden_size=16, num_heads=2)


MODEL_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]


@st.composite
def corruptions(draw: st.DrawFn) -> list[tuple[str, str, Any]]:
    steps = []
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        name = draw(st.sampled_from(MODEL_FILES))
        how = draw(st.sampled_from(["truncate", "overwrite", "delete", "text"]))
        steps.append((name, how, draw(st.floats(min_value=0, max_value=1)) if how != "text" else draw(VALUES)))
    return steps


def _corrupt(directory: Path, steps: list[tuple[str, str, Any]]) -> None:
    for name, how, arg in steps:
        path = directory / name
        if not path.exists():
            continue
        data = path.read_bytes()
        if how == "delete":
            path.unlink()
        elif how == "truncate":
            path.write_bytes(data[: int(len(data) * arg)])
        elif how == "overwrite":  # garbage over the first bytes (the header of a safetensors file)
            at = int(min(len(data), 64) * arg)
            path.write_bytes(data[:at] + b"\xff{garbage" + data[at + 10 :])
        else:
            path.write_text(json.dumps(arg) if not isinstance(arg, str) else arg)


@_settings("model_dirs")
@given(steps=corruptions())
def test_generated_model_directory_damage_is_reported_by_file(steps, tiny_model):
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(shutil.copytree(tiny_model, Path(tmp) / "model"))
        _corrupt(directory, steps)
        info, problems = check_model_dir(str(directory), "actor.model_path")
        _, tokenizer_problems = check_tokenizer_dir(str(directory), "actor.model_path")
        for problem in problems + tokenizer_problems:
            assert problem.startswith((str(directory), "actor.model_path: ")), problem
        damaged_header = any(
            name == "model.safetensors" and (how in ("delete", "text") or (how == "truncate" and arg < 1))
            for name, how, arg in steps
        )
        if damaged_header:
            assert problems, steps
        if not problems:
            assert info is not None and info.vocab_size is not None
