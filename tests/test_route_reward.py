"""The built-in ``route`` reward: each sample scored by the reward its row's column selects, routes
validated at their own key paths, metrics per route, rows without a route refused before the run
(file:line, per value), each route's columns checked on its own rows; and a real ``core-rl train``
run over a weighted mixture of two sources, each row scored by its source's reward."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import reward_functions
import yaml
from core_rl.builtin import function_reward, route_reward
from core_rl.builtin import rewards as builtin_rewards
from core_rl.config.loader import validate_plugin_section
from core_rl.config.schema import PluginSpec
from core_rl.errors import ConfigError
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import REWARD
from core_rl.testing import make_reward_input, preloaded
from core_rl.testing.faults import build_task, merged, run_dir
from fault_helpers import cli_command, cli_env

match_plugin = pytest.importorskip("core_rl_reward_match.plugin")

FUNCTIONS = Path(reward_functions.__file__)
LENGTH = {"name": "function", "path": f"{FUNCTIONS}:scaled_length", "kwargs": {"scale": 1}}


def _host() -> PluginHost:
    host = PluginHost(entry_points=[])
    for module in (route_reward, function_reward, builtin_rewards):
        host.register_plugin(module, distribution="core-rl")
    host.register_plugin(match_plugin, distribution="core-rl-reward-match")
    return host


def _build(**options: Any):
    spec = PluginSpec(name="route", options=options)
    validate_plugin_section(_host(), REWARD, spec, "reward")
    return spec.build()


def test_each_item_is_scored_by_its_route_and_reported_per_route():
    reward = _build(key="task", routes={"rev": {"name": "char_match"}, "len": LENGTH}, default={"name": "exact_match"})
    items = [
        make_reward_input("abxx", {"task": "rev", "answer": "abcd"}),
        make_reward_input("hello", {"task": "len"}),
        make_reward_input("zz", {"task": "other", "answer": "zz"}),
        make_reward_input("abcd", {"task": "rev", "answer": "abcd"}),
    ]
    result = reward.score_with_parts(items)
    assert result.scores == [0.5, 5.0, 1.0, 1.0]
    # None: the part does not apply to another route's sample (not a NaN score, see value_stats)
    expected = {"rev": [0.5, None, None, 1.0], "len": [None, 5.0, None, None], "default": [None, None, 1.0, None]}
    assert result.parts == expected
    # char_match and exact_match read the normalised response as the answer; the length reward none
    assert result.answers == ["abxx", None, "zz", "abcd"]


def test_nested_parts_and_an_item_without_route():
    combined = {"name": "combine", "parts": [{"reward": {"name": "char_match"}, "label": "chars"}]}
    reward = _build(routes={"rev": combined})
    result = reward.score_with_parts([make_reward_input("ab", {"data_source": "rev", "answer": "ab"})])
    assert result.scores == [1.0] and result.parts == {"rev": [1.0], "rev/chars": [1.0]}
    with pytest.raises(ValueError, match=r"1 of 1 items have no route for column 'data_source' \('math'\)"):
        reward.score([make_reward_input("ab", {"data_source": "math"})])


def test_routes_are_validated_at_their_own_key_paths():
    with pytest.raises(ConfigError) as info:
        _build(routes={"rev": {"name": "char_match", "answr_key": "a"}}, default={"name": "nope"})
    assert info.value.problems[0] == "reward.routes.rev.answr_key: unknown key; did you mean 'answer_key'?"
    assert info.value.problems[1].startswith("reward.default.name: reward 'nope' is not installed")
    with pytest.raises(ConfigError, match="reward.routes: must map at least one value to a reward"):
        _build()


# -- before the run, and a real run over a weighted mixture -------------------------------------------


def _task(root: Path) -> dict[str, Any]:
    """The tiny task's prompts in two sources: ``rev.jsonl`` (answer: the prompt reversed, scored by
    char_match) and ``len.jsonl`` (no answer column, scored by the response's length), weighted."""
    base = build_task(root)
    lines = [json.loads(x) for x in Path(base["data"]["train_files"][0]).read_text().splitlines()]
    rev, length = root / "rev.jsonl", root / "len.jsonl"
    rev.write_text("".join(json.dumps({**row, "data_source": "rev"}) + "\n" for row in lines[:3]))
    length.write_text("".join(json.dumps({"prompt": row["prompt"], "data_source": "len"}) + "\n" for row in lines[3:]))
    shutil.copy(FUNCTIONS, root / "fns.py")
    return merged(
        base,
        data={"train_files": [{"path": str(rev), "weight": 1}, {"path": str(length), "weight": 1}]},
        reward={
            "name": "route",
            "routes": {
                "rev": {"name": "char_match"},
                "len": {"name": "function", "path": "fns.py:scaled_length", "kwargs": {"scale": 1}},
            },
        },
        trainer={"total_steps": 3},
        saver={"every_n_steps": 0, "at_end": False, "export_hf": False},
        loggers=[{"name": "jsonl"}],
        sample_log={"every_n_steps": 1, "num_samples": 8},
    )


def _cli(root: Path, config: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return preloaded.run(
        cli_command(*args, str(path)), capture_output=True, text=True, env=cli_env(), cwd=root, timeout=600
    )


def _plugins() -> None:
    for name in ("core_rl_fsdp", "core_rl_hf", "core_rl_grpo"):
        pytest.importorskip(name)


def test_rows_without_a_route_or_a_routed_column_are_refused_before_the_run(tmp_path: Path):
    _plugins()
    config = _task(tmp_path)
    assert _cli(tmp_path, config, "config", "validate", "--preflight").returncode == 0  # len rows need no answer
    with (tmp_path / "len.jsonl").open("a") as f:
        f.write(json.dumps({"prompt": "ab=", "data_source": "math"}) + "\n")
        f.write(json.dumps({"prompt": "ba=", "data_source": "math"}) + "\n")
        f.write(json.dumps({"prompt": "ba=", "data_source": "code"}) + "\n")
    with (tmp_path / "rev.jsonl").open("a") as f:
        f.write(json.dumps({"prompt": "cd=", "data_source": "rev"}) + "\n")
    proc = _cli(tmp_path, config, "config", "validate", "--preflight")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    rev, length = tmp_path / "rev.jsonl", tmp_path / "len.jsonl"
    assert [ln[4:] for ln in proc.stderr.splitlines() if ln.startswith("  - ")] == [
        f"{length}:4: column 'data_source' is 'math' (also {length}:5), which reward.routes has no route for and "
        "there is no reward.default; add a route for it, or set a default",
        f"{length}:6: column 'data_source' is 'code', which reward.routes has no route for and there is no "
        "reward.default; add a route for it, or set a default",
        f"{rev}:4: no column 'answer' (or it is null), which reward 'char_match' (reward.routes.rev) reads; add it "
        "to the rows routed to reward.routes.rev",
    ]
    default = merged(config, reward={**config["reward"], "default": {"name": "exact_match", "answer_key": "prompt"}})
    proc = _cli(tmp_path, default, "config", "validate", "--preflight")
    assert proc.returncode == 2 and "no route" not in proc.stderr and f"{rev}:4: no column 'answer'" in proc.stderr


def test_evaluation_rows_without_a_route_are_refused_before_the_run(tmp_path: Path):
    """The reward scores eval.files too: their rows are checked by its check_data as the training
    rows are, so a row no route takes stops the run before it starts, not at its first evaluation."""
    _plugins()
    evals = tmp_path / "eval.jsonl"
    rows = [{"prompt": "ab=", "answer": "ba", "data_source": "rev"}, {"prompt": "ab=", "data_source": "code"}]
    evals.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = merged(_task(tmp_path), eval={"files": [str(evals)], "before_train": False})
    proc = _cli(tmp_path, config, "config", "validate", "--preflight")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{evals}:2: column 'data_source' is 'code', which reward.routes has no route for" in proc.stderr


def _char_match(response: str, answer: str) -> float:
    r, a = response.strip(), answer.strip()
    width = max(len(r), len(a))
    return 1.0 if width == 0 else sum(x == y for x, y in zip(r, a)) / width


def test_a_mixture_run_scores_each_row_by_its_route(tmp_path: Path):
    _plugins()
    config = _task(tmp_path)
    proc = _cli(tmp_path, config, "train")
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = {}
    for name in ("rev", "len"):
        for line in (tmp_path / f"{name}.jsonl").read_text().splitlines():
            row = json.loads(line)
            answers[row["prompt"]] = (name, row.get("answer"))
    samples = [json.loads(x) for x in (run_dir(config) / "samples.jsonl").read_text().splitlines()]
    metrics = {
        json.loads(x)["step"]: json.loads(x) for x in (run_dir(config) / "metrics.jsonl").read_text().splitlines()
    }
    seen = set()
    for step in (1, 2, 3):
        mine = [s for s in samples if s["step"] == step]
        assert len(mine) == 8
        by_route: dict[str, list[float]] = {"rev": [], "len": []}
        for s in mine:
            route, answer = answers[s["prompt"]]
            expected = _char_match(s["response"], answer) if route == "rev" else float(len(s["response"]))
            assert s["reward"] == pytest.approx(expected), s
            by_route[route].append(s["reward"])
        for route, rewards in by_route.items():
            if rewards:
                seen.add(route)
                assert metrics[step][f"reward/{route}/mean"] == pytest.approx(sum(rewards) / len(rewards))
                assert f"reward/{route}/nonfinite" not in metrics[step]  # other routes' samples are not NaN scores
            else:
                assert f"reward/{route}/mean" not in metrics[step]
    assert seen == {"rev", "len"}
