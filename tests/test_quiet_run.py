"""A default short run prints no warning, progress bar or deprecation line of its own paths, and
its peak-memory figure is the maximum resident set size the OS reports for it.

One real ``core-rl train`` process (fsdp, hf rollout, GRPO, the ``math`` reward, whose answers a
tiny digit model's responses supply; checkpoint and Hugging Face export at the end): the lines it
printed are matched against the patterns of every noise seen in real runs (transformers' "Loading
weights" and "Writing model shards" bars and its ``past_key_values`` deprecation, math-verify's
timeout notices, DeepSpeed's accelerator warning), and its maximum resident set size is read from
``wait4`` by a small parent, as ``/usr/bin/time`` reads it (:mod:`max_rss`)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from core_rl.builtin.loggers import read_metrics
from core_rl.testing.launch import train_command, write_grpo_config
from core_rl.testing.tiny import build_tiny_model
from max_rss import run_measured

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_math")

#: what no line of a default run may contain
NOISE = [
    re.compile(r"warn", re.IGNORECASE),  # Python warnings, loggers' WARNING, DeepSpeed's [WARNING]
    re.compile(r"deprecat", re.IGNORECASE),
    re.compile(r"\d+%\|"),  # a tqdm bar: " 35%|███▍  | 94/272"
    re.compile(r"\d+/\d+ \[\d+:\d+"),  # its counter and timer: "272/272 [00:00<00:00"
    re.compile(r"it/s\]|s/it\]"),
    re.compile(r"Loading weights|Writing model shards"),
    re.compile(r"Timeout is disabled"),  # math-verify's notices
]


def noise(text: str) -> list[str]:
    """The lines (carriage returns split, as a terminal would draw a bar) that match a pattern."""
    return [line for line in re.split(r"[\r\n]", text) if any(p.search(line) for p in NOISE)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("quiet-run")
    model = build_tiny_model(root / "model", alphabet="0123456789+= ", seed=0)
    data = root / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in [(1, 2), (3, 4)])
    )
    config = write_grpo_config(
        root,
        model,
        [str(data)],
        reward={"name": "math"},
        trainer={"total_steps": 2},
        saver={"every_n_steps": 0, "at_end": True, "export_hf": True},
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, max_rss = run_measured(train_command(config), root / "rusage.json", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"stdout": proc.stdout, "stderr": proc.stderr, "max_rss_gib": max_rss, "run_dir": root / "runs" / "run"}


def test_writing_and_loading_a_model_prints_nothing(tmp_path, capfd):
    from core_rl.roles.hf import load_causal_lm

    load_causal_lm(str(build_tiny_model(tmp_path / "model")), dtype="float32")
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def test_the_noise_patterns_catch_what_real_runs_printed():
    seen = [
        "Loading weights:  35%|███▍      | 94/272 [00:00<00:00, 902.45it/s]",
        "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 397.38it/s]",
        "[transformers] `past_key_values`/`cache_params` are deprecated. Use `cache` instead.",
        "Timeout is disabled as parsing_timeout is None or <= 0, you must provide the logic ...",
        "[2026-01-01 00:00:00,000] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
        "/x.py:3: FutureWarning: `torch_dtype` is deprecated",
    ]
    assert noise("\n".join(seen)) == seen
    assert noise("step 1/2 reward=0 response_length=3.75 loss=0\npeak memory: host 0.40 GiB resident") == []


@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM and ru_maxrss in KiB: Linux")
def test_the_peak_memory_is_the_os_maximum_rss(run):
    (line,) = [x for x in run["stdout"].splitlines() if x.startswith("peak memory: host ")]
    reported = float(line.split()[3])
    assert abs(reported - run["max_rss_gib"]) <= 0.1 * run["max_rss_gib"], (line, run["max_rss_gib"])
    rows = list(read_metrics(run["run_dir"] / "metrics.jsonl"))
    step_peak = rows[-1]["memory/host_peak_rss_gib"]
    assert step_peak <= run["max_rss_gib"] + 0.01
    assert abs(step_peak - run["max_rss_gib"]) <= 0.1 * run["max_rss_gib"]
