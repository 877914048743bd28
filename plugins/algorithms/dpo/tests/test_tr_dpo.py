"""TR-DPO: the ``dpo`` loop's reference reset by ``algorithm.reference_reset_every_n_steps``, softly
with ``algorithm.reference_reset_alpha`` (:mod:`core_rl.loops.rl.reference_reset`), through ``core-rl
train`` with the real ``fsdp`` engine on a tiny model: right after a soft reset the log-ratio margin
lies between a hard reset's 0 and the margin without resets, the export is the hand mix of the
policy's export and the previous reference's, a resumed run ends bitwise as an uninterrupted one,
and a reset without a reference model is one clear line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.checkpoint.hf_exports import export_dir, exported_steps
from pair_task import pair_task
from safetensors.torch import load_file

pytest.importorskip("core_rl_fsdp")


def train(config: Path, *overrides: str) -> None:
    from core_rl import cli

    assert cli.main(["train", str(config), *overrides]) == 0


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def _margins(run: Path) -> dict[int, float]:
    return {r["step"]: r["dpo/rewards/margin"] for r in read_metrics(run / "metrics.jsonl")}


def test_soft_reference_updates_and_resume(tmp_path: Path) -> None:
    setup = pair_task(
        tmp_path,
        "trdpo",
        {"name": "dpo", "reference_reset_every_n_steps": 2, "reference_reset_alpha": 0.5},
        {"total_steps": 4, "loop": {"beta": 0.5}},
        {"every_n_steps": 1, "keep_last": 2, "export_hf_every_n_steps": 2, "export_hf_keep_last": 0},
    )
    runs, config = tmp_path / "runs", setup["config"]
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "loggers": [{"name": "jsonl"}]}))
    train(config, "experiment.name=soft")
    train(config, "experiment.name=hard", "trainer.total_steps=3", "algorithm.reference_reset_alpha=1.0")
    no_reset = ("algorithm.reference_reset_every_n_steps=0", "algorithm.reference_reset_alpha=1.0")
    train(config, "experiment.name=plain", "trainer.total_steps=3", *no_reset)
    soft, hard, plain = _margins(runs / "soft"), _margins(runs / "hard"), _margins(runs / "plain")
    assert soft[2] == hard[2] == plain[2]  # the same run until the first reset
    assert hard[3] == 0.0  # the reference is the policy step 3 starts from: log-ratios 0
    assert 0.1 * plain[3] < soft[3] < 0.9 * plain[3], (soft, plain)
    assert exported_steps(runs / "soft", "reference") == [2, 4]
    mixed, policy = _weights(export_dir(runs / "soft", 4, "reference")), _weights(export_dir(runs / "soft", 4))
    before = _weights(export_dir(runs / "soft", 2, "reference"))
    assert mixed.keys() == policy.keys()
    for name, value in mixed.items():
        by_hand = np.float32(0.5) * policy[name].numpy() + np.float32(0.5) * before[name].numpy()
        assert value.dtype == torch.float32 and np.array_equal(value.numpy(), by_hand), name
    train(config, "experiment.name=resumed", "trainer.total_steps=3")
    train(config, "experiment.name=resumed", "recover.mode=auto")
    assert _margins(runs / "resumed") == soft
    resumed = _weights(export_dir(runs / "resumed", 4, "reference"))
    assert all(resumed[k].equal(mixed[k]) for k in mixed)
    final = [load_file(str(runs / name / "final_hf" / "model.safetensors")) for name in ("soft", "resumed")]
    assert all(final[0][k].equal(final[1][k]) for k in final[0])


def test_a_reset_without_a_reference_model_is_refused(tmp_path: Path, capsys) -> None:
    from core_rl import cli

    setup = pair_task(
        tmp_path,
        "pre",
        {"name": "dpo", "reference_reset_every_n_steps": 2},
        {"loop": {"reference": "precomputed"}},
        {},
    )
    assert cli.main(["config", "validate", str(setup["config"])]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "reference_reset" in line]
    assert len(err) == 1 and "the dpo loop resets only a reference model" in err[0], err
