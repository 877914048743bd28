"""Command-line overrides: key syntax (list indices in both spellings, ``~key``), YAML values with
unquoted interpolations, wholesale replacement of a section, and switching a section to another
plugin. Everything a user can get wrong is a ConfigError naming the override."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import yaml
from core_rl.config import load_config
from core_rl.config.overrides import parse_key, parse_override, parse_value
from core_rl.config.schema import RunConfig
from core_rl.errors import ConfigError


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _load(tmp_path, data, overrides, host, notes=None):
    return load_config(_write(tmp_path, data), overrides, host=host, notify=(notes if notes is not None else []).append)


def _problems(tmp_path, data, overrides, host) -> list[str]:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, data, overrides, host)
    return info.value.problems


@pytest.mark.parametrize(
    ("key", "path"),
    [
        ("loggers[1].name", ("loggers", 1, "name")),
        ("loggers.1.name", ("loggers", "1", "name")),
        ("a.b[0][2].c", ("a", "b", 0, 2, "c")),
        ("reward", ("reward",)),
    ],
)
def test_key_paths(key, path):
    assert parse_key(key) == path


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("", "empty"),
        ("a..b", "empty part"),
        ("a.", "empty part"),
        ("[0].a", "starts with an index"),
        ("a[x]", r"\[x\] is not a list index"),
        ("a[-1]", r"\[-1\] is not a list index"),
        ("a[0", "brackets must"),
        ("a[0]b", "brackets must"),
    ],
)
def test_bad_key_paths(key, message):
    with pytest.raises(ValueError, match=message):
        parse_key(key)


def test_values_are_yaml_and_interpolations_need_no_quotes():
    assert parse_value("1e-5") == pytest.approx(1e-5)
    assert parse_value("[0.9,0.95]") == [0.9, 0.95]
    assert parse_value("") is None
    assert parse_value("${a.b}/x") == "${a.b}/x"
    # unquoted ${...} inside flow collections, nested ones included, survive as text
    assert parse_value("{name: x, k: ${a.b}, p: ${a.b}/${c}}") == {"name": "x", "k": "${a.b}", "p": "${a.b}/${c}"}
    assert parse_value("[${x}, '${y}', ${oc.env:HOME,${z}}]") == ["${x}", "${y}", "${oc.env:HOME,${z}}"]
    assert parse_value("{msg: 'it''s ${q}'}") == {"msg": "it's ${q}"}  # a quoted one is left to YAML


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lr=[1", "cannot read the value '\\[1'"),
        ("lr={a: 1", "cannot read the value"),
        ("lr='open", "cannot read the value"),
        ("x={k: ${a.b}", "cannot read the value"),
        ("x=${a.b", "is not closed"),
        ("x=@y", "cannot read the value"),
        ("x={a: 1, a: 2}", "duplicate key"),
        ("novalue", "must look like key.path=value"),
        ("~x=1", "a deletion takes no value"),
    ],
)
def test_unreadable_overrides(text, message):
    with pytest.raises(ValueError, match=message):
        parse_override(text)


def test_list_indices_in_both_spellings_and_append(tmp_path, host, minimal_config):
    minimal_config["loggers"] = [{"name": "console", "every_n_steps": 5}, {"name": "jsonl"}]
    cfg = _load(
        tmp_path,
        minimal_config,
        ["loggers[0].every_n_steps=2", "loggers.1.filename=m.jsonl", "loggers[2]={name: console}"],
        host,
    )
    assert [s.name for s in cfg.loggers] == ["console", "jsonl", "console"]
    assert cfg.loggers[0].config.every_n_steps == 2
    assert cfg.loggers[1].config.filename == "m.jsonl"
    # a list the file does not set is created by an index override
    cfg = _load(tmp_path, minimal_config, ["algorithm.filters[0].name=zero_filter"], host)
    assert [s.name for s in cfg.algorithm.filters] == ["zero_filter"]


def test_index_problems_name_the_override(tmp_path, host, minimal_config):
    problems = _problems(tmp_path, minimal_config, ["loggers[3].name=jsonl", "reward[0]=1", "loggers.x=1"], host)
    assert problems == [
        "override 'loggers[3].name=jsonl': loggers[3]: index out of range; loggers has 1 item",
        "override 'reward[0]=1': reward is a mapping, not a list; [0] indexes lists",
        "override 'loggers.x=1': loggers is a list; address its items by index, e.g. loggers[0]",
    ]


def test_a_mapping_replaces_the_section_wholesale(tmp_path, host, minimal_config):
    minimal_config["actor"]["optimizer"] = {"name": "sgd", "lr": 0.5, "momentum": 0.9}
    cfg = _load(tmp_path, minimal_config, ["actor.optimizer={lr: 0.01}"], host)
    assert cfg.actor.optimizer.lr == 0.01
    assert cfg.actor.optimizer.name == "adamw" and cfg.actor.optimizer.momentum == 0.0  # defaults again
    cfg = _load(tmp_path, minimal_config, ["actor.optimizer.lr=0.01"], host)
    assert cfg.actor.optimizer.name == "sgd" and cfg.actor.optimizer.momentum == 0.9  # one key changed


def test_deleting_keys(tmp_path, host, minimal_config):
    minimal_config["actor"]["optimizer"] = {"lr": 0.5}
    minimal_config["loggers"] = [{"name": "console"}, {"name": "jsonl"}]
    cfg = _load(tmp_path, minimal_config, ["~actor.optimizer.lr", "~loggers[0]"], host)
    assert cfg.actor.optimizer.lr == 1e-5  # back to the default
    assert [s.name for s in cfg.loggers] == ["jsonl"]
    problems = _problems(tmp_path, minimal_config, ["~actor.optimizer.betas", "~nowhere.at.all"], host)
    assert problems == [
        "override '~actor.optimizer.betas': actor.optimizer.betas is not set (neither in the file nor by an earlier "
        "override), so there is nothing to delete",
        "override '~nowhere.at.all': nowhere.at.all is not set (neither in the file nor by an earlier override), so "
        "there is nothing to delete",
    ]


def test_a_scalar_where_a_section_is_expected(tmp_path, host, minimal_config):
    problems = _problems(tmp_path, minimal_config, ["actor.optimizer=[1,2]", "trainer=5"], host)
    assert "actor.optimizer: expected a mapping, got [1, 2]" in problems
    assert "trainer: expected a mapping, got 5" in problems
    problems = _problems(tmp_path, minimal_config, ["actor.model_path.x=1"], host)
    assert problems == ["override 'actor.model_path.x=1': actor.model_path is a string ('/models/tiny'), not a section"]


def test_a_plugin_short_form_expands_when_a_key_is_set_below_it(tmp_path, host, minimal_config):
    minimal_config["reward"] = "constant"
    cfg = _load(tmp_path, minimal_config, ["reward.value=0.25"], host)
    assert cfg.reward.name == "constant" and cfg.reward.config.value == 0.25


def test_interpolations_in_override_values_resolve(tmp_path, host, minimal_config):
    minimal_config["experiment"] = {"name": "exp"}
    cfg = _load(tmp_path, minimal_config, ["data.train_files=[${experiment.name}.jsonl, x/${experiment.name}]"], host)
    assert cfg.data.train_files == ["exp.jsonl", "x/exp"]


def test_switching_a_plugin_drops_the_file_options_it_does_not_take(tmp_path, host, minimal_config):
    minimal_config["reward"] = {"name": "constant", "value": 0.5, "scale": 3.0}
    notes: list[str] = []
    cfg = _load(tmp_path, minimal_config, ["reward.name=threshold"], host, notes)
    assert cfg.reward.name == "threshold"
    assert cfg.reward.config.scale == 3.0  # an option the new plugin takes is carried over
    assert notes == [
        f"reward.name is 'threshold' (was 'constant' in {tmp_path / 'run.yaml'}): dropped value from the file, "
        "which reward 'threshold' does not take"
    ]
    # the new plugin's own options can come on the same command line, in either form
    cfg = _load(tmp_path, minimal_config, ["reward.name=threshold", "reward.cutoff=0.7"], host)
    assert cfg.reward.config.cutoff == 0.7
    cfg = _load(tmp_path, minimal_config, ["reward={name: threshold, cutoff: 0.6}"], host)
    assert cfg.reward.config.cutoff == 0.6 and cfg.reward.config.scale == 1.0  # replaced: nothing carried over
    # an option given on the command line that the new plugin does not take is still an error
    problems = _problems(tmp_path, minimal_config, ["reward.name=threshold", "reward.value=1"], host)
    assert len(problems) == 1 and problems[0].startswith("reward.value: unknown key")


def test_switching_a_list_item_plugin(tmp_path, host, minimal_config):
    minimal_config["loggers"] = [{"name": "console", "every_n_steps": 5}]
    notes: list[str] = []
    cfg = _load(tmp_path, minimal_config, ["loggers[0].name=jsonl"], host, notes)
    assert cfg.loggers[0].name == "jsonl"
    assert len(notes) == 1 and notes[0].startswith("loggers[0].name is 'jsonl' (was 'console'")


def test_integer_keys_in_yaml(tmp_path, host, minimal_config):
    path = tmp_path / "int.yaml"
    path.write_text(yaml.safe_dump(minimal_config) + "1: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, [], host=host)
    sections = ", ".join(field.name for field in attrs.fields(RunConfig))
    assert info.value.problems == [f"1: unknown key (keys are names; valid keys: {sections})"]
    assert sections.startswith("experiment, data, actor, rollout, algorithm, reward")
    minimal_config["reward"][3] = "x"
    problems = _problems(tmp_path, minimal_config, [], host)
    assert problems == ["reward.3: unknown key (keys are names; valid keys: value, scale)"]


def test_every_problem_of_a_config_at_once(tmp_path, host, minimal_config):
    minimal_config["actor"]["optimizer"] = {"lr": -1, "eps": 0, "betas": [2.0, -1.0], "name": "adam"}
    minimal_config["rollout"]["sampling"] = {"n": 0, "top_p": 2.0, "stop_token_ids": [-1, 3]}
    minimal_config["reward"]["scale"] = -2
    problems = _problems(tmp_path, minimal_config, ["trainer.total_steps=0", "experiment.seed=-1"], host)
    assert sorted(problems) == sorted(
        [
            "actor.optimizer.name: must be one of 'adamw', 'sgd', 'adafactor', 'muon', 'class', got 'adam'",
            "actor.optimizer.lr: must be in (0, 10.0], got -1.0",
            "actor.optimizer.betas[0]: must be in [0.0, 1.0), got 2.0",
            "actor.optimizer.eps: must be in (0, 1.0], got 0.0",
            "rollout.sampling.n: must be in [1, 1048576], got 0",
            "rollout.sampling.top_p: must be in (0.0, 1.0], got 2.0",
            "rollout.sampling.stop_token_ids[0]: must be in [0, 16777216], got -1",
            "trainer.total_steps: must be in [1, 1000000000], got 0",
            "experiment.seed: must be in [0, 4294967295], got -1",
            "reward.scale: must be > 0, got -2.0",
        ]
    )
