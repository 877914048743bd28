"""``saver.export_hf_every_n_steps`` (:mod:`core_rl.checkpoint.hf_exports`): a GRPO run exports the
policy of every such step as a loadable Hugging Face directory, keeps the newest
``export_hf_keep_last``, and the last export holds the final policy's weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from core_rl.checkpoint.hf_exports import export_dir, exported_steps, prune_exports
from safetensors.torch import load_file

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")


def test_pruning_keeps_the_newest_and_ignores_partial_directories(tmp_path: Path) -> None:
    for step in (3, 10, 7):
        export_dir(tmp_path, step).mkdir(parents=True)
    (tmp_path / "hf" / ".step_00000012.partial").mkdir()  # an export cut short
    assert exported_steps(tmp_path) == [3, 7, 10]
    assert prune_exports(tmp_path, 0) == [] and exported_steps(tmp_path) == [3, 7, 10]
    assert prune_exports(tmp_path, 2) == [3] and exported_steps(tmp_path) == [7, 10]


def _config(tmp_path: Path, **saver) -> Path:
    from core_rl.testing.faults import build_task, merged

    config = merged(build_task(tmp_path), experiment={"name": "exports"}, saver={"every_n_steps": 0, **saver})
    config["saver"].update(at_end=False, export_hf=True)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_run_exports_every_n_steps_and_keeps_the_newest(tmp_path: Path) -> None:
    from core_rl import cli
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _config(tmp_path, export_hf_every_n_steps=2)
    assert cli.main(["train", str(path)]) == 0
    run = tmp_path / "runs" / "exports"
    assert exported_steps(run) == [2, 4]
    step2, step4 = (load_file(export_dir(run, s) / "model.safetensors") for s in (2, 4))
    final = load_file(run / "final_hf" / "model.safetensors")
    assert all(step4[k].equal(final[k]) for k in final)  # the last step's export is the final policy
    assert any(not step2[k].equal(step4[k]) for k in final)  # two steps of training apart
    AutoModelForCausalLM.from_pretrained(export_dir(run, 2))
    AutoTokenizer.from_pretrained(export_dir(run, 2))
    assert cli.main(["train", str(path), "experiment.name=kept", "saver.export_hf_keep_last=1"]) == 0
    assert exported_steps(tmp_path / "runs" / "kept") == [4]
