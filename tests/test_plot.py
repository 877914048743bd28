"""``core-rl plot``: reading metrics files (NaN as strings, repeated steps, a cut-off last line),
smoothing, and the PNG and HTML for one and several runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from core_rl import cli
from core_rl.errors import CoreRLError
from core_rl_plot.plot import load_run, plot_runs, rolling_mean

pytest.importorskip("matplotlib")


def write_run(path: Path, steps: int, scale: float = 1.0) -> Path:
    path.mkdir(parents=True)
    with (path / "metrics.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            record = {
                "step": step,
                "time": 1e9 + step,
                "reward/mean": scale * step / steps,
                "reward/char_match/mean": step / steps,
                "reward/format/mean": 1.0,
                "actor/kl": 0.01 * step,
                "actor/entropy": 2.0 - step / steps,
                "actor/grad_norm": "inf" if step == 2 else 1.0 / step,
                "actor/lr": 1e-3,
                "actor/clipped": 0.1,
                "response_length/mean": 4.0,
                "timing/generate_s": 0.03,
                "timing/reward_s": 0.002,
                "timing/train_s": 0.09,
                "timing/weight_sync_s": 0.005,
                "throughput/tokens_per_s": 5000.0,
            }
            f.write(json.dumps(record) + "\n")
    return path


def test_load_run_reads_strings_repeats_and_a_cut_last_line(tmp_path):
    run = write_run(tmp_path / "a", 5)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 5, "reward/mean": 0.5}) + "\n")  # a resumed run logged step 5 again
        f.write('{"step": 6, "rew')  # killed mid-line
    loaded = load_run(run)
    steps, values = loaded.series["reward/mean"]
    assert steps == [1, 2, 3, 4, 5] and values[-1] == 0.5
    assert math.isinf(loaded.series["actor/grad_norm"][1][1])
    assert "time" not in loaded.series and loaded.steps == 5


def test_a_bad_line_in_the_middle_names_file_and_line(tmp_path):
    run = write_run(tmp_path / "a", 3)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    with pytest.raises(CoreRLError, match=r"metrics.jsonl:2: not a JSON record"):
        load_run(run)
    with pytest.raises(CoreRLError, match="no metrics.jsonl here"):
        load_run(tmp_path)


def test_rolling_mean():
    assert rolling_mean([1.0, 3.0, 5.0, float("nan"), 7.0], 2) == [1.0, 2.0, 4.0, 5.0, 7.0]
    assert rolling_mean([2.0], 10) == [2.0]


def test_plot_one_and_several_runs(tmp_path, capsys):
    a = write_run(tmp_path / "runs" / "a", 60)
    b = write_run(tmp_path / "runs" / "b", 40, scale=0.5)
    assert cli.main(["plot", str(a)]) == 0
    assert f"plot: {a / 'plot.png'}" in capsys.readouterr().out
    png = (a / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    written = plot_runs([a, b], out_dir=tmp_path / "both")
    page = written["html"].read_text()
    assert "<svg" in page and "reward/char_match/mean" in page and "reward/format/mean" in page
    assert "0.01667 &rarr; 1" in page and "0.0125 &rarr; 0.5" in page  # first -> last of each run
    assert page.count("steps</li>") == 2


def test_plot_errors_exit_2(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl here" in capsys.readouterr().err
