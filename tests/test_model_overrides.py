"""``<role>.model_overrides`` (:mod:`core_rl.roles.model_overrides`): the run's model directory links the
weights and overrides ``config.json``, a misspelt key is an error naming it, and a GRPO run whose
policy has linear RoPE scaling rolls out and trains on the same overridden model (behaviour and
recomputed log-probs agree), exports it, and records the original path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from core_rl.roles.model_overrides import config_problems, make_overridden_dir
from core_rl.testing.tiny import build_tiny_model

ROPE = {"rope_type": "linear", "factor": 2.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("overrides") / "m", alphabet="abcd=", hidden_size=16, num_heads=2)


def test_the_directory_links_the_weights_and_overrides_the_config(model: Path, tmp_path: Path) -> None:
    target = make_overridden_dir(str(model), {"max_position_embeddings": 512, "rope_scaling": ROPE}, tmp_path / "o")
    config = json.loads((target / "config.json").read_text())
    original = json.loads((model / "config.json").read_text())
    assert config == {**original, "max_position_embeddings": 512, "rope_scaling": ROPE}
    assert (target / "model.safetensors").is_symlink() and (target / "tokenizer.json").is_symlink()
    assert not (target / "config.json").is_symlink()
    stamp = (target / "config.json").stat().st_mtime_ns
    make_overridden_dir(str(model), {"max_position_embeddings": 512, "rope_scaling": ROPE}, tmp_path / "o")
    assert (target / "config.json").stat().st_mtime_ns == stamp  # the same overrides: kept
    make_overridden_dir(str(model), {"max_position_embeddings": 384}, tmp_path / "o")
    assert json.loads((target / "config.json").read_text())["max_position_embeddings"] == 384
    assert json.loads((target / "config.json").read_text()).get("rope_scaling") == original.get("rope_scaling")


def test_another_model_with_the_same_config_gets_its_own_links(model: Path, tmp_path: Path) -> None:
    """The directory is reused only for the same model directory: another one whose config.json is
    the same (a later export of the run) is linked anew."""
    import shutil

    other = Path(shutil.copytree(model, tmp_path / "other"))
    target = make_overridden_dir(str(model), {"max_position_embeddings": 512}, tmp_path / "o")
    assert (target / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
    make_overridden_dir(str(other), {"max_position_embeddings": 512}, tmp_path / "o")
    assert (target / "model.safetensors").resolve() == (other / "model.safetensors").resolve()


def test_applying_twice_or_from_an_overridden_directory_keeps_the_links(model: Path, tmp_path: Path) -> None:
    """A configuration checked twice keeps its directory; a directory made from another run's
    overridden one links the weights again, not the stamp."""
    from core_rl.config.schema import ActorConfig, RunConfig
    from core_rl.roles.model_overrides import STAMP, apply_model_overrides

    cfg = RunConfig(actor=ActorConfig(model_path=str(model), model_overrides={"max_position_embeddings": 512}))
    assert apply_model_overrides(cfg, root=tmp_path / "a") == []
    first = cfg.actor.model_path
    assert apply_model_overrides(cfg, root=tmp_path / "a") == [] and cfg.actor.model_path == first
    assert (Path(first) / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
    again = make_overridden_dir(first, {"max_position_embeddings": 384}, tmp_path / "b")
    assert (again / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
    assert not (again / STAMP).is_symlink()


def test_a_key_of_the_config_file_is_known_even_where_the_class_renames_it(model: Path, tmp_path: Path) -> None:
    import shutil

    legacy = Path(shutil.copytree(model, tmp_path / "legacy"))
    config = json.loads((legacy / "config.json").read_text())
    (legacy / "config.json").write_text(json.dumps({**config, "rope_theta": 10000.0}))
    assert config_problems(str(legacy), {"rope_theta": 500000.0}, "actor") == []


def test_a_key_the_configuration_does_not_know_is_named(model: Path) -> None:
    assert config_problems(str(model), {"rope_scaling": ROPE, "max_position_embeddings": 1}, "actor") == []
    assert config_problems(str(model), {"rope_scalling": ROPE}, "actor") == [
        "actor.model_overrides.rope_scalling: not a setting of a llama model's configuration (LlamaConfig); "
        "check the name against its config.json"
    ]


pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")


def test_a_run_rolls_out_and_trains_the_overridden_model(model: Path, tmp_path: Path, capsys) -> None:
    from core_rl import cli
    from core_rl.testing.faults import build_task, merged
    from transformers import AutoConfig

    base = build_task(tmp_path)
    config = merged(
        base,
        actor={"model_path": str(model), "model_overrides": {"rope_scaling": ROPE}},
        algorithm={"name": "grpo", "recompute_logprob": True},
        trainer={"total_steps": 2},
        saver={"every_n_steps": 0, "export_hf": True},
        loggers=[{"name": "jsonl"}],
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["config", "validate", "--preflight", str(path), "actor.model_overrides={ropescaling: 1}"]) == 2
    assert "actor.model_overrides.ropescaling: not a setting" in capsys.readouterr().err
    blocked = ["experiment.output_dir=" + str(tmp_path / "runs" / "run.yaml" / "sub")]  # under a file
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "run.yaml").write_text("")
    assert cli.main(["train", str(path), *blocked]) == 2
    assert "experiment.output_dir" in capsys.readouterr().err
    assert cli.main(["train", str(path)]) == 0
    run = tmp_path / "runs" / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the rollout engine sampled from the model the trainer recomputes: the same scaled RoPE
    assert all(r["offpolicy/kl_behave_old"] < 1e-8 for r in rows), [r["offpolicy/kl_behave_old"] for r in rows]
    exported = AutoConfig.from_pretrained(run / "final_hf")  # transformers 5 names it rope_parameters
    assert (getattr(exported, "rope_parameters", None) or exported.rope_scaling)["factor"] == 2.0
    recorded = (run / "config.yaml").read_text()
    assert f"model_path: {model}" in recorded and "model_overrides (rope_scaling)" in recorded
    assert json.loads((run / "model_overrides" / "actor" / "config.json").read_text())["rope_scaling"] == ROPE
