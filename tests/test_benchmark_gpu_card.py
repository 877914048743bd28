"""The bench card of ``benchmarks/gpu_grpo.py``: the FLOP count and MFU (``benchmarks/gpu_card.py``)
and the results file's regression rule (``benchmarks/gpu_results.py``), on hand-computed values.
The card through a whole run is in ``tests/test_benchmark_trl.py`` (``--smoke``)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def card() -> dict:
    return runpy.run_path(str(BENCHMARKS / "gpu_card.py"), run_name="gpu_card")


@pytest.fixture(scope="module")
def results() -> dict:
    return runpy.run_path(str(BENCHMARKS / "gpu_results.py"), run_name="gpu_results")


def test_train_flops_is_six_n_d_plus_the_attention_term(card) -> None:
    # 6 * 1000 * 100 = 600,000; 12 * 2 layers * 8 hidden * 10 seq * 100 tokens = 192,000
    assert card["train_flops"](params=1000, layers=2, hidden=8, seq_len=10, tokens=100) == 792_000
    # the 0.36B model, one sequence of 5 prompt + 256 response tokens:
    # 6 * 360,000,000 * 261 = 563,760,000,000; 12 * 24 * 896 * 261 * 261 = 17,578,487,808
    assert card["train_flops"](360_000_000, 24, 896, 261, 261) == 581_338_487_808


def test_shape_counts_prompt_and_response_tokens(card) -> None:
    shape = card["Shape"](params=1, layers=1, hidden=1, samples=4, response_tokens=8, prompt_tokens=20)
    assert shape.generated == 32  # 4 samples x 8 tokens
    assert shape.trained == 52  # 20 prompt tokens (over the 4 samples) + 32
    assert shape.seq_len == 13.0  # 52 / 4


def test_card_figures_from_a_summary(card) -> None:
    shape = card["Shape"](params=1_000_000, layers=2, hidden=16, samples=4, response_tokens=8, prompt_tokens=20)
    split = {"generate": 0.5, "logprobs": 0.1, "train": 1.0, "weight_sync": 0.2, "other": 0.2}
    c = card["card"]({"step": 2.0, "split": split, "peak_gib": 3.0}, shape, 1e-3)  # a peak of 1e9 FLOP/s
    # 6 * 1e6 * 52 = 312,000,000; 12 * 2 * 16 * 13 * 52 = 259,584
    assert c.tflop == pytest.approx(312_259_584 / 1e12)
    assert c.mfu == pytest.approx(312_259_584 / 1.0 / 1e9)  # over the 1.0 s of train
    assert c.gen_tps == pytest.approx(64.0)  # 32 generated tokens / 0.5 s
    assert c.train_tps == pytest.approx(52.0)  # 52 tokens / 1.0 s
    assert (c.step, c.generate, c.train, c.sync, c.peak_gib) == (2.0, 0.5, 1.0, 0.2, 3.0)
    assert c.other == pytest.approx(0.3)  # log-prob recomputation counts as other
    assert card["card"]({"step": 2.0, "split": split, "peak_gib": 3.0}, shape, None).mfu is None


def test_mfu_and_the_peak_table(card) -> None:
    # 494.5e12 FLOPs in 1 s on a 989 TFLOP/s device: 50%
    assert card["mfu"](494.5e12, 1.0, 989.0) == pytest.approx(0.5)
    assert card["mfu"](1e12, 0.0, 989.0) is None and card["mfu"](1e12, 1.0, None) is None
    peak = card["peak_tflops"]
    assert peak("NVIDIA H100 80GB HBM3") == 989.0  # SXM
    assert peak("NVIDIA H100 PCIe") == 756.0
    assert peak("NVIDIA H200") == 989.0
    assert peak("cpu") is None and peak("NVIDIA GeForce RTX 4090") is None
    assert peak("cpu", 100.0) == 100.0 and peak("NVIDIA H200", 900.0) == 900.0  # --peak-tflops
    assert card["format_mfu"](None) == "unknown" and card["format_mfu"](0.1234) == "12.3%"


def _row(step: float, gen: float, train: float, mfu: str, device: str = "NVIDIA H100", shape: str = "0.5b") -> dict:
    return {
        "date": "2026-11-27 10:00",
        "device": device,
        "shape": shape,
        "s/step": f"{step:.3f}",
        "gen tok/s": f"{gen:.0f}",
        "train tok/s": f"{train:.0f}",
        "MFU %": mfu,
    }


def test_the_regression_rule_is_five_percent_worse(results) -> None:
    rule = results["regressions"]
    previous = _row(1.0, 1000, 2000, "40.00")
    assert rule(_row(1.049, 951, 1901, "38.01"), previous) == []  # each within 5%
    assert rule(_row(1.05, 1000, 2000, "40.00"), previous) == []  # exactly 5% is not more than 5%
    assert rule(_row(0.5, 5000, 9000, "90.00"), previous) == []  # better is never flagged
    flags = rule(_row(1.051, 949, 1899, "37.99"), previous)
    assert [f.figure for f in flags] == ["s/step", "gen tok/s", "train tok/s", "MFU %"]
    assert flags[0].text() == "s/step +5.1%" and flags[1].text() == "gen tok/s -5.1%"
    # an unknown MFU (no peak) is not compared
    assert rule(_row(1.0, 1000, 2000, "unknown"), previous) == []
    assert rule(_row(1.0, 1000, 2000, "10.00"), _row(1.0, 1000, 2000, "unknown")) == []


def test_the_results_file_flags_against_the_last_row_of_the_same_device_and_shape(results, tmp_path) -> None:
    path = tmp_path / "results" / "gpu.md"
    append = results["append"]
    assert append(path, _row(1.0, 1000, 2000, "40.00")) == []  # the file is created
    text = path.read_text()
    assert text.startswith(results["HEADER"]) and "| date | device |" in text
    # another device and another shape are not compared with the first row
    assert append(path, _row(2.0, 500, 1000, "20.00", device="NVIDIA H200")) == []
    assert append(path, _row(2.0, 500, 1000, "20.00", shape="1.5b")) == []
    assert append(path, _row(1.04, 960, 1950, "39.00")) == []  # within 5% of the first row
    # against the last row of its device and shape (1.04 s), not the first (1.0 s): 1.09 is +4.8%
    assert append(path, _row(1.09, 960, 1950, "39.00")) == []
    flags = append(path, _row(1.2, 960, 1950, "39.00"))  # +10.1% against 1.09
    assert [f.figure for f in flags] == ["s/step"]
    rows = results["read_rows"](path)
    assert [r["flags"] for r in rows] == ["-", "-", "-", "none", "none", "REGRESSION: s/step +10.1%"]
    assert rows[-1]["s/step"] == "1.200" and rows[-1]["device"] == "NVIDIA H100" and rows[-1]["shape"] == "0.5b"
