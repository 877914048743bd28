"""Agent failures are episodes, in real ``core-rl train`` runs (fsdp + hf + grpo, the proxy over
HTTP) of the openai-agents SDK's calculator agent (sdk_calculator_agent.py, a script run from its
own environment, ``rollout.workflow.requirements``) on the scripted tiny tool-calling model.

Half the rows make the agent ask the model again after each tool result, so the SDK raises
``MaxTurnsExceeded`` there: with ``max_error_fraction: 0.5`` the run trains on, those episodes
scored ``error_reward`` and counted (``agent/errors/MaxTurnsExceeded``); with 0.25 it stops at the
first step with one line naming the error (exit status 1, as the other run failures). And, in
process, ``on_error: drop`` leaves errored episodes out of their group, counted on a kept sample.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.testing import preloaded
from proxy_agents import LOG, TOOL_TEMPLATE, client

for name in ("core_rl_fsdp", "core_rl_hf", "core_rl_grpo"):
    pytest.importorskip(name)

HERE = Path(__file__).resolve().parent
CORE_RL = str(Path(__import__("sys").executable).with_name("core-rl"))
GOOD = ["let me add.", "<tool_call>", '{"name":"add","arguments":{"a":3,"b":4}}', "</tool_call>"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    from core_rl.testing.scripted_model import build_scripted_model

    work = tmp_path_factory.mktemp("errors")
    build_scripted_model(work / "model", {":": GOOD})
    # in file order: each step one row that stops at the tool's result (step 1's through
    # Runner.run_streamed, step 2's through Runner.run) and one that hits max_turns
    rows = [{"prompt": "3+4", "answer": "7", "stop_on_tool": i % 2 == 0, "streamed": i % 4 == 0} for i in range(8)]
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "template.jinja").write_text(TOOL_TEMPLATE)
    return work


def _train(work: Path, name: str, fraction: float) -> subprocess.CompletedProcess:
    config = {
        "experiment": {"name": name, "output_dir": str(work), "seed": 1},
        "data": {"train_files": [str(work / "train.jsonl")], "prompt_key": "prompt", "batch_size": 2, "shuffle": False},
        "actor": {
            "model_path": str(work / "model"),
            "engine": {"name": "fsdp"},
            "optimizer": {"name": "adamw", "lr": 1.0e-4},
        },
        "rollout": {
            "engine": {"name": "hf"},
            "sampling": {"n": 2, "max_new_tokens": 8},
            "workflow": {
                "name": "openai_agent",
                "program": str(HERE / "sdk_calculator_agent.py"),
                "requirements": ["openai-agents==0.24.*"],
                "chat_template": str(work / "template.jinja"),
                "max_context_tokens": 400,
                "timeout_s": 120,
                "error_reward": -1.0,
                "max_error_fraction": fraction,
            },
            "controller": {"batching": "request"},
        },
        "algorithm": {"name": "grpo"},
        "reward": {"name": "workflow"},
        "trainer": {"total_steps": 2, "torch_threads": 1},
        "saver": {"export_hf": False},
        "loggers": [{"name": "jsonl"}],
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return preloaded.run([CORE_RL, "train", str(path)], capture_output=True, text=True, timeout=600)


def test_errored_episodes_train_scored_and_counted(setup: Path) -> None:
    proc = _train(setup, "on", 0.5)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [r for r in read_metrics(setup / "on" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # each step: 2 rows x 2 episodes, one row's episodes hit max_turns
        assert row["agent/errors/MaxTurnsExceeded"] == 2 and row["agent/errors_total"] == 2
        assert row["rollout/failed_episodes"] == 2
        assert row["reward/mean"] == pytest.approx((1.0 + 1.0 - 1.0 - 1.0) / 4)


def test_past_the_fraction_the_run_stops_naming_the_error(setup: Path) -> None:
    proc = _train(setup, "off", 0.25)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("core-rl: error:")]
    assert "step 1: 2 of 4 episodes ended in an agent error" in line
    assert "rollout.workflow.max_error_fraction=0.25" in line and "most common: MaxTurnsExceeded (2)" in line
    assert "Traceback" not in proc.stderr


class MaxTurnsExceeded(Exception):
    """Stands for the SDK's exception in process (the SDK is not installed in core-rl's environment)."""


_calls: dict[str, int] = {}


async def _flaky(base_url: str, api_key: str, row: dict) -> float:
    """One call; then the second episode of each row to get its answer raises."""
    await client(base_url, api_key).chat.completions.create(model="policy", messages=[{"role": "user", "content": "1"}])
    _calls[row["prompt"]] = _calls.get(row["prompt"], 0) + 1
    if _calls[row["prompt"]] == 2:
        raise MaxTurnsExceeded("Max turns (1) exceeded")
    return 1.0


@pytest.mark.parametrize("on_error", ["score", "drop"])
def test_an_errored_episode_is_scored_or_dropped(run_wave, monkeypatch, on_error) -> None:
    import proxy_agents

    monkeypatch.setattr(proxy_agents, "flaky", _flaky, raising=False)
    LOG.clear()
    _calls.clear()
    rows = [{"prompt": "1"}, {"prompt": "2"}]
    wave, _ = run_wave(
        rows, n=2, batching="request", program="proxy_agents:flaky", error_reward=-0.5, on_error=on_error
    )
    samples = [s for group in wave.groups for s in group]
    errored = [s for s in samples if s.info.get("error") == "MaxTurnsExceeded"]
    if on_error == "score":
        assert len(samples) == 4 and len(errored) == 2 and all(s.reward == -0.5 for s in errored)
        assert all("MaxTurnsExceeded: Max turns (1) exceeded" in s.info["failed"] for s in errored)
    else:
        assert len(samples) == 2 and not errored and all(s.reward == 1.0 for s in samples)
        dropped = sum(s.info.get("dropped_errors", {}).get("MaxTurnsExceeded", 0) for s in samples)
        assert dropped == 2
