"""The built-in ``function`` reward: a plain Python function loaded from a file (``file.py:function``)
or a module, called per item or batched, sync or async, with its ``kwargs``; every mistake one line
at ``config validate`` (exit 2); a non-number through ``reward_runner.on_error``; as a ``combine``
part; and a real ``core-rl train`` run whose file reimplements ``char_match`` logging the packaged
reward's metrics exactly (training and evaluation)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
import reward_functions
import yaml
from core_rl.builtin import function_reward
from core_rl.builtin import rewards as builtin_rewards
from core_rl.config.loader import validate_plugin_section
from core_rl.config.schema import PluginSpec, RewardRunnerConfig
from core_rl.loops.rl.reward_runner import NOT_A_NUMBER, RewardRunner
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import REWARD
from core_rl.protocol import RewardInput
from core_rl.testing import RewardContract, make_reward_input, preloaded
from core_rl.testing.faults import build_task, merged, run_dir, stable_metrics
from fault_helpers import cli_command, cli_env

match_plugin = pytest.importorskip("core_rl_reward_match.plugin")

FUNCTIONS = Path(reward_functions.__file__)
ROW = {"answer": "abcd"}


class TestFunctionContract(RewardContract):
    plugin = function_reward
    name = "function"
    distribution = "core-rl"
    options: ClassVar[dict[str, Any]] = {"path": f"{FUNCTIONS}:char_match", "columns": ["answer"]}
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("abcd", ROW), 1.0),
        (make_reward_input(" abcx\n", ROW), 0.75),
        (make_reward_input("ab", ROW), 0.5),
        (make_reward_input("abcdefgh", ROW), 0.5),
    ]


def _host() -> PluginHost:
    host = PluginHost(entry_points=[])
    host.register_plugin(function_reward, distribution="core-rl")
    host.register_plugin(builtin_rewards, distribution="core-rl")
    host.register_plugin(match_plugin, distribution="core-rl-reward-match")
    return host


def _build(name: str, **options: Any):
    spec = PluginSpec(name=name, options=options)
    validate_plugin_section(_host(), REWARD, spec, "reward")
    return spec.build()


def _items(*responses: str, finish_reason: str = "stop") -> list[RewardInput]:
    return [make_reward_input(r, ROW, finish_reason=finish_reason) for r in responses]


def test_kwargs_batched_and_async_calls():
    reward = _build("function", path=f"{FUNCTIONS}:scaled_length", kwargs={"scale": 2, "offset": 0.5})
    assert reward.score(_items("ab", "abcd")) == [4.5, 8.5]
    batched = _build("function", path=f"{FUNCTIONS}:lengths_batched", batched=True)
    assert batched.score(_items("ab", "abc")) == [2.0, 3.0]
    assert batched.score(_items("ab", finish_reason="length")) == [-2.0]
    assert _build("function", path=f"{FUNCTIONS}:async_length").score(_items("a", "abc")) == [1.0, 3.0]


def test_module_function_and_declared_columns():
    spec = PluginSpec(name="function", options={"path": "reward_functions:char_match", "columns": ["answer"]})
    validate_plugin_section(_host(), REWARD, spec, "reward")
    assert spec.config.required_columns() == ["answer"]
    assert spec.build().score(_items("abcd")) == [1.0]


def test_a_non_number_goes_through_on_error_and_threads_of_the_runner_call_it():
    reward = _build("function", path=f"{FUNCTIONS}:labelled")
    config = RewardRunnerConfig(items_per_call=1, num_workers=4, on_error="value", error_value=-1.0)
    runner = RewardRunner(reward, "function", config)
    result = runner.score(_items("ab", "", "abc"))
    runner.close()
    assert result.scores == [2.0, -1.0, 3.0]
    assert [(f.index, f.kind) for f in result.failures] == [(1, NOT_A_NUMBER)]
    assert "score is not a number: str 'empty'" in result.failures[0].error

    reward = _build("function", path=f"{FUNCTIONS}:thread_name")
    threads = reward.function.__globals__["THREADS"]  # the file's own module, not the imported one
    assert threads is not reward_functions.THREADS
    runner = RewardRunner(reward, "function", config)
    assert runner.score(_items(*"abcdefgh")).scores == [1.0] * 8
    runner.close()
    assert threads and all(t.startswith("reward-function-") for t in threads)


def test_a_combine_part():
    reward = _build(
        "combine",
        parts=[
            {"reward": {"name": "function", "path": f"{FUNCTIONS}:char_match"}, "weight": 0.5, "label": "file"},
            {"reward": {"name": "char_match"}, "weight": 0.5},
        ],
    )
    result = reward.score_with_parts(_items("abcd", "abxx"))
    assert result.scores == [1.0, 0.5]
    assert result.parts == {"file": [1.0, 0.5], "char_match": [1.0, 0.5]}


# -- every mistake is one line of core-rl config validate, exit 2 ---------------------------------


def _validate(tmp_path: Path, reward: dict[str, Any]) -> tuple[int, list[str], str]:
    config = {
        "actor": {"model_path": "/m"},
        "algorithm": {"name": "grpo"},
        "data": {"train_files": ["a.jsonl"]},
        "reward": {"name": "combine", "parts": [{"reward": {"name": "char_match"}}, {"reward": reward}]},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    proc = preloaded.run(
        cli_command("config", "validate", "c.yaml"), capture_output=True, text=True, env=cli_env(), cwd=tmp_path
    )
    return proc.returncode, [ln[4:] for ln in proc.stderr.splitlines() if ln.startswith("  - ")], proc.stderr


def test_mistakes_are_one_line_each_at_config_validate(tmp_path: Path):
    rewards = tmp_path / "rewards"
    rewards.mkdir()
    shutil.copy(FUNCTIONS, rewards / "fns.py")
    (rewards / "broken.py").write_text("x = 1\ndef score(response\n")
    (rewards / "imports.py").write_text("import os\n\nimport no_such_module_xyz\n")
    key = "reward.parts[1].reward"
    inputs = "response, prompt, row, finish_reason, prompt_ids, response_ids, workflow_reward, info, item"
    cases = {
        "rewards/fns.py:char_match": None,
        "rewards/nope.py:score": f"{key}.path: no file {tmp_path}/rewards/nope.py ('rewards/nope.py' from the "
        f"working directory {tmp_path})",
        "rewards/broken.py:score": f"{key}.path: {rewards}/broken.py:2: SyntaxError: '(' was never closed",
        "rewards/imports.py:score": f"{key}.path: {rewards}/imports.py:3: ModuleNotFoundError: No module named "
        "'no_such_module_xyz'",
        "rewards/fns.py:char_mtach": f"{key}.path: {rewards}/fns.py has no 'char_mtach'; the callables it defines: "
        "async_length, char_match, digit_fraction, labelled, lengths_batched, scaled_length, solves_ab, thread_name",
        "rewards/fns.py:scaled_length": f"{key}.path: scaled_length(response, *, scale, offset=0.0): "
        f"parameter 'scale' is neither an input ({inputs}) nor a key of {key}.kwargs; rename it, "
        f"give it a default or set it in {key}.kwargs",
        "rewards/fns.py": f"{key}.path: must be 'path/to/file.py:function' or 'package.module:function', got "
        "'rewards/fns.py'",
    }
    for path, line in cases.items():
        code, lines, err = _validate(tmp_path, {"name": "function", "path": path})
        assert "Traceback" not in err
        assert (code, lines) == ((0, []) if line is None else (2, [line])), err
    code, lines, _ = _validate(
        tmp_path, {"name": "function", "path": "rewards/fns.py:char_match", "kwargs": {"row": 1, "scale": 2}}
    )
    assert code == 2 and lines == [
        f"{key}.kwargs.row: 'row' is an input the reward passes itself; rename the argument",
        f"{key}.kwargs.scale: char_match(response, row) takes no argument 'scale'; remove it or add it",
    ]


# -- a real run: the file's char_match trains and evaluates exactly as the packaged one ----------------


def test_a_grpo_run_with_a_file_reward_matches_the_packaged_char_match(tmp_path: Path):
    for name in ("core_rl_fsdp", "core_rl_hf", "core_rl_grpo"):
        pytest.importorskip(name)
    base = build_task(tmp_path / "task")
    base = merged(
        base,
        trainer={"total_steps": 2},
        saver={"every_n_steps": 0, "at_end": False, "export_hf": False},
        eval={"files": base["data"]["train_files"], "at_end": True, "max_prompts": 4},
        reward_runner={"num_workers": 3, "items_per_call": 2},
    )
    (tmp_path / "rewards").mkdir()
    shutil.copy(FUNCTIONS, tmp_path / "rewards" / "mine.py")
    runs = {}
    for name, reward in (
        ("packaged", {"name": "char_match"}),
        ("file", {"name": "function", "path": "rewards/mine.py:char_match", "columns": ["answer"]}),
    ):
        config = merged(base, experiment={"name": name}, reward=reward)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        proc = preloaded.run(
            cli_command("train", str(path)), capture_output=True, text=True, env=cli_env(), cwd=tmp_path, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = stable_metrics(run_dir(config))
    assert sorted(runs["file"]) == [1, 2]
    assert any(0.0 < row["reward/mean"] < 1.0 for row in runs["file"].values())  # partial credit was scored
    assert any(k.startswith("eval/") for k in runs["file"][2])
    # the per-plugin tally names each run's own reward; everything else is logged alike
    tallies = {
        name: {k for row in rows.values() for k in row if k.startswith("plugins/")} for name, rows in runs.items()
    }
    assert (
        "plugins/reward.char_match/calls" in tallies["packaged"] and "plugins/reward.function/calls" in tallies["file"]
    )
    untallied = {name: {s: {k: v for k, v in row.items() if not k.startswith("plugins/")} for s, row in rows.items()}
                 for name, rows in runs.items()}  # fmt: skip
    assert untallied["file"] == untallied["packaged"]
    for step in (1, 2):  # and counted alike
        assert (
            runs["file"][step]["plugins/reward.function/calls"]
            == runs["packaged"][step]["plugins/reward.char_match/calls"]
        )
