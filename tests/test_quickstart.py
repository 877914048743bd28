"""``docs/quickstart.md`` as written: its configuration (the YAML block saved as ``my_run.yaml``)
and its commands, in order, on a tiny random model with a chat template and a JSONL of prompts and
answers. Only sizes are overridden (steps, batch, lengths) so the run takes seconds; a change to
the page's configuration or commands changes what runs here."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from core_rl.testing import preloaded

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "quickstart.md").read_text()

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_math")

#: what the tiny model runs with instead of the page's sizes (appended to its commands that load the config)
SMALL = [
    "trainer.total_steps=2",
    "data.batch_size=2",
    "data.max_prompt_tokens=32",
    "rollout.sampling.n=2",
    "rollout.sampling.max_new_tokens=4",
    "sample_log.every_n_steps=1",
]
TRAIN = [("12+30=?", "42"), ("7+8=?", "15"), ("9-4=?", "5"), ("6+6=?", "12")]
EVAL = [("20+22=?", "42"), ("3+4=?", "7"), ("10-1=?", "9")]


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", PAGE, flags=re.M | re.S)


def _page_config() -> str:
    [config] = [block for block in _blocks("yaml") if block.startswith("# my_run.yaml")]
    return config


def _page_commands() -> list[list[str]]:
    """The page's ``core-rl`` commands in order, as argument lists (comments dropped)."""
    lines = [line for block in _blocks("bash") for line in block.splitlines() if line.startswith("core-rl ")]
    return [shlex.split(line, comments=True)[1:] for line in lines]


def _write_jsonl(path: Path, rows: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_pages_commands_run_in_order_on_a_tiny_model(tmp_path: Path) -> None:
    from core_rl.testing.tiny import add_chat_template, build_tiny_model

    add_chat_template(build_tiny_model(tmp_path / "models" / "my-model"))
    _write_jsonl(tmp_path / "data" / "train.jsonl", TRAIN)
    _write_jsonl(tmp_path / "data" / "eval.jsonl", EVAL)
    (tmp_path / "my_run.yaml").write_text(_page_config())
    commands = _page_commands()
    assert [c[0] for c in commands] == ["config", "train", "eval", "plot"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CORE_RL_HOME": str(tmp_path / "home")}
    for args in commands:
        sized = [*args, *SMALL] if "my_run.yaml" in args else args
        proc = preloaded.run(
            [sys.executable, "-m", "core_rl.cli", *sized], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, f"core-rl {shlex.join(sized)}\n{proc.stdout}\n{proc.stderr}"

    run = tmp_path / "runs" / "my_run"
    rendered = {p: f"<s>u:{p}>a:" for p, _ in TRAIN + EVAL}  # the tiny chat template's user turn + generation prompt
    for step in (0, 2):  # eval.before_train, eval.at_end
        records = _records(run / "eval" / f"step_{step:06d}.jsonl")
        assert [r["prompt"] for r in records] == [p for p, _ in EVAL]
        assert [r["rendered_prompt"] for r in records] == [rendered[p] for p, _ in EVAL]
    samples = _records(run / "samples.jsonl")
    assert samples and all(s["rendered_prompt"] == rendered[s["prompt"]] for s in samples)
    assert (run / "final_hf" / "config.json").is_file() and (run / "plot.png").is_file()
    again = _records(tmp_path / "runs" / "my_run-final" / "eval" / "step_000000.jsonl")
    assert [r["prompt"] for r in again] == [p for p, _ in EVAL]
