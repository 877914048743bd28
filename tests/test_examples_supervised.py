"""The supervised examples (examples/tiny_supervised: sft.yaml, dpo.yaml, kto.yaml, rm.yaml) run through
``core-rl train`` for a few steps on the data and model prepare.py builds, and learn."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from core_rl.builtin.loggers import read_metrics
from core_rl.testing import preloaded
from core_rl.testing.launch import run_train

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_sft")
pytest.importorskip("core_rl_dpo")
pytest.importorskip("core_rl_rm")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "tiny_supervised"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("supervised")
    preloaded.run([sys.executable, str(EXAMPLES / "prepare.py"), "--workdir", str(work)], check=True, timeout=300)
    return work


@pytest.mark.parametrize(
    ("config", "metric"),
    [("sft.yaml", "sft/loss"), ("dpo.yaml", "dpo/loss"), ("kto.yaml", "kto/loss"), ("rm.yaml", "rm/loss")],
)
def test_example_trains(workdir: Path, config: str, metric: str) -> None:
    run_train(EXAMPLES / config, f"experiment.output_dir={workdir}", "trainer.total_steps=6", "saver.every_n_steps=3")
    run = workdir / Path(config).stem
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    if config == "rm.yaml":
        # the score head starts at 0 (every loss log 2); at its lr, 6 steps move the training loss by
        # little, so the check is the held-out pairs, scored after the last step only
        assert rows[0][metric] == pytest.approx(math.log(2), abs=1e-6)
        assert "rm/val/loss" in rows[-1] and all("rm/val/loss" not in r for r in rows[:-1])
        assert rows[-1]["rm/val/loss"] < math.log(2) - 0.005 and rows[-1]["rm/val/scores/margin"] > 0
    else:
        assert rows[-1][metric] < rows[0][metric]
    assert (run / "checkpoints" / "step_00000006").is_dir() and (run / "final_hf" / "config.json").is_file()


def test_grpo_against_the_trained_reward_model(workdir: Path) -> None:
    """grpo_rm.yaml: the SFT example's policy trained by GRPO against the rm example's export, served
    by the reward_model: role (every reward is the reward model's score: the example has no rule-based
    reward)."""
    pytest.importorskip("core_rl_hf")
    pytest.importorskip("core_rl_grpo")
    for config in ("sft.yaml", "rm.yaml"):  # made by test_example_trains unless it was deselected
        if not (workdir / Path(config).stem / "final_hf" / "config.json").is_file():
            run_train(EXAMPLES / config, f"experiment.output_dir={workdir}", "trainer.total_steps=2")
    quick = ("trainer.total_steps=2", "data.batch_size=4", "saver.at_end=false", "saver.export_hf=false")
    run_train(EXAMPLES / "grpo_rm.yaml", f"experiment.output_dir={workdir}", *quick)
    rows = read_metrics(workdir / "grpo_rm" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["reward/mean"] == pytest.approx(row["reward/reward_model/mean"], abs=1e-7)
        assert row["reward/reward_model/std"] > 0 and "actor/loss" in row
