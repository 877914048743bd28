"""Config loading: YAML, overrides, interpolation, recipe defaults, plugin sections, and errors
that name the key path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from core_rl.config import load_config, to_plain, to_yaml
from core_rl.config.schema import RunConfig
from core_rl.errors import ConfigError


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _problems(tmp_path, data, overrides=(), host=None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, data), list(overrides), host=host)
    return info.value.problems


def test_loads_types_recipe_defaults_and_plugin_section(tmp_path, host, minimal_config):
    cfg = load_config(_write(tmp_path, minimal_config), [], host=host)
    assert isinstance(cfg, RunConfig)
    assert cfg.actor.model_path == "/models/tiny"
    # recipe defaults fill what the YAML leaves out
    assert cfg.algorithm.advantage.name == "adv" and cfg.algorithm.loss.name == "loss"
    assert cfg.rollout.sampling.n == 4 and cfg.rollout.sampling.temperature == 0.9
    # the reward section was validated by the reward's own class
    # ... merged with the recipe's options for the same reward
    assert cfg.reward.config.value == 0.5 and cfg.reward.config.scale == 2.0
    # the scheduler learns the run length
    assert cfg.actor.lr_scheduler.total_steps == cfg.trainer.total_steps == 100


def test_user_settings_beat_recipe_defaults(tmp_path, host, minimal_config):
    minimal_config["rollout"]["sampling"] = {"n": 16}
    cfg = load_config(_write(tmp_path, minimal_config), ["rollout.sampling.temperature=0.5"], host=host)
    assert cfg.rollout.sampling.n == 16 and cfg.rollout.sampling.temperature == 0.5


def test_choosing_another_plugin_drops_the_recipe_options_for_its_own(tmp_path, host, minimal_config):
    minimal_config["reward"] = {"name": "zero"}
    cfg = load_config(_write(tmp_path, minimal_config), [], host=host)
    assert cfg.reward.name == "zero" and cfg.reward.options == {}
    cfg = load_config(_write(tmp_path, minimal_config), ["reward.name=constant"], host=host)
    assert cfg.reward.config.scale == 2.0  # same plugin as the recipe's: its options apply
    cfg = load_config(_write(tmp_path, minimal_config), ["reward=constant"], host=host)
    assert cfg.reward.config.scale == 1.0  # a bare name replaces the whole section: the plugin's defaults


def test_dotted_overrides_and_interpolation(tmp_path, host, minimal_config):
    minimal_config["experiment"] = {"name": "exp", "output_dir": "/tmp/out"}
    minimal_config["data"]["train_files"] = ["${experiment.output_dir}/${experiment.name}.jsonl"]
    cfg = load_config(
        _write(tmp_path, minimal_config),
        [
            "actor.optimizer.lr=1e-5",
            "trainer.total_steps=7",
            "experiment.name=other",
            "actor.optimizer.betas=[0.8,0.9]",
        ],
        host=host,
    )
    assert cfg.actor.optimizer.lr == pytest.approx(1e-5)
    assert cfg.actor.optimizer.betas == (0.8, 0.9)
    assert cfg.trainer.total_steps == 7 and cfg.actor.lr_scheduler.total_steps == 7
    assert cfg.data.train_files == ["/tmp/out/other.jsonl"]


def test_unknown_keys_name_path_and_suggest(tmp_path, host, minimal_config):
    minimal_config["actor"]["optimzer"] = {"lr": 1.0}
    minimal_config["reward"]["scael"] = 2
    problems = _problems(tmp_path, minimal_config, ["trainer.totl_steps=3"], host=host)
    assert "actor.optimzer: unknown key; did you mean 'optimizer'?" in problems
    assert "trainer.totl_steps: unknown key; did you mean 'total_steps'?" in problems
    assert "reward.scael: unknown key; did you mean 'scale'?" in problems


def test_type_and_range_errors_name_path_and_value(tmp_path, host, minimal_config):
    minimal_config["actor"]["optimizer"] = {"lr": -1.0}
    minimal_config["actor"]["grad_clip"] = "big"
    minimal_config["rollout"]["sampling"] = {"top_p": 1.5}
    minimal_config["reward"]["scale"] = 0
    minimal_config["trainer"] = {"resume": "yes"}
    problems = _problems(tmp_path, minimal_config, host=host)
    assert "actor.optimizer.lr: must be > 0, got -1.0" in problems
    assert "actor.grad_clip: expected a number, got 'big'" in problems
    assert "rollout.sampling.top_p: must be in (0.0, 1.0], got 1.5" in problems
    assert "reward.scale: must be > 0, got 0.0" in problems
    assert "trainer.resume: expected true or false, got 'yes'" in problems


def test_choices_are_listed(tmp_path, host, minimal_config):
    minimal_config["actor"]["lr_scheduler"] = {"name": "cosin"}
    problems = _problems(tmp_path, minimal_config, host=host)
    assert problems == ["actor.lr_scheduler.name: must be one of 'constant', 'linear', 'cosine', got 'cosin'"]


def test_unknown_plugin_names_key_path_and_hint(tmp_path, host, minimal_config):
    minimal_config["rollout"]["engine"] = {"name": "trtllm"}
    minimal_config["loggers"] = [{"name": "jsonl"}, {"name": "nope"}]
    problems = _problems(tmp_path, minimal_config, host=host)
    assert any(
        p.startswith("rollout.engine.name: rollout engine 'trtllm' is not installed (installed: ") for p in problems
    )
    assert any(p.startswith("loggers[1].name: logger 'nope' is not installed") for p in problems)


def test_plugin_without_options_rejects_options(tmp_path, host, minimal_config):
    minimal_config["actor"]["engine"] = {"name": "eng", "shard": True}
    assert _problems(tmp_path, minimal_config, host=host) == [
        "actor.engine: train engine 'eng' takes no options, got shard"
    ]


def test_missing_required_parts(tmp_path, host):
    problems = _problems(tmp_path, {"actor": {"engine": "eng"}, "rollout": {"engine": "gen"}}, host=host)
    assert any(p.startswith("actor.model_path: required") for p in problems)
    assert any(p.startswith("reward: required") for p in problems)
    assert any(p.startswith("data.train_files: required") for p in problems)
    assert any(p.startswith("algorithm.name: required") for p in problems)


def test_bad_yaml_and_bad_overrides(tmp_path, host, minimal_config):
    path = tmp_path / "bad.yaml"
    path.write_text("actor: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse YAML"):
        load_config(path, [], host=host)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml", [], host=host)
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        load_config(_write(tmp_path, minimal_config), ["actor.optimizer.lr"], host=host)
    minimal_config["data"]["train_files"] = ["${nowhere.to_be_found}"]
    with pytest.raises(ConfigError, match=r"data.train_files\[0\]: cannot resolve interpolation|cannot resolve"):
        load_config(_write(tmp_path, minimal_config), [], host=host)


def test_show_output_reloads_to_the_same_config(tmp_path, host, minimal_config):
    cfg = load_config(_write(tmp_path, minimal_config), ["actor.optimizer.lr=3e-4"], host=host)
    shown = yaml.safe_load(to_yaml(cfg))
    assert shown["reward"] == {"name": "constant", "value": 0.5, "scale": 2.0}
    again = load_config(_write(tmp_path, shown), [], host=host)
    assert to_plain(again) == to_plain(cfg)


def test_a_string_is_not_a_list(tmp_path, host, minimal_config):
    minimal_config["data"]["train_files"] = "prompts.jsonl"
    minimal_config["rollout"]["sampling"] = {"stop_token_ids": [2, "x"]}
    problems = _problems(tmp_path, minimal_config, host=host)
    assert "data.train_files: expected a list, got 'prompts.jsonl'" in problems
    assert "rollout.sampling.stop_token_ids[1]: expected an integer, got 'x'" in problems
