"""Where a merged configuration's values come from (file line, override, recipe, default): a recipe
value chosen for the recipe's value of another key yields where the user sets that key, problems
name the source of each value they involve,
a recipe switched on the command line drops the file's options for the loop it no longer selects,
and ``core-rl config show`` prints an invalid configuration with its problems marked."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from core_rl.cli import main
from core_rl.config import load_config
from core_rl.config.provenance import yaml_lines
from core_rl.errors import ConfigError
from core_rl.plugins.host import PluginHost

ROOT = Path(__file__).resolve().parents[1]
GRPO_YAML = ROOT / "examples" / "tiny_grpo" / "grpo.yaml"


@pytest.fixture(scope="module")
def plugins() -> PluginHost:
    return PluginHost()


def _line(path: Path, text: str) -> int:
    """The 1-based line of ``path`` that holds ``text``."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _load(path: Path, overrides: list[str], host: PluginHost):
    notes: list[str] = []
    return load_config(path, overrides, host=host, notify=notes.append), notes


def test_a_grpo_file_switched_to_gspo_keeps_its_clip_range_and_says_why(plugins):
    """``core-rl config validate examples/tiny_grpo/grpo.yaml algorithm.name=gspo``: the file sets
    eps_clip 0.2; the gspo recipe's 4e-4 upper end, chosen for its 3e-4 lower end, is left out
    instead of contradicting the file's 0.2."""
    cfg, notes = _load(GRPO_YAML, ["algorithm.name=gspo"], plugins)
    loss = cfg.algorithm.loss.config
    assert (loss.eps_clip, loss.eps_clip_higher) == (0.2, None)
    assert loss.importance_sampling_level == "sequence"  # the rest of the recipe still applies
    assert cfg.algorithm.ppo_n_minibatches == 4 and cfg.algorithm.recompute_logprob
    assert notes == [
        f"algorithm.loss.eps_clip is 0.2 (in {GRPO_YAML}:{_line(GRPO_YAML, 'eps_clip: 0.2')}), not the 'gspo' "
        "recipe's 0.0003; so the recipe's algorithm.loss.eps_clip_higher: 0.0004, chosen for its own value, is not "
        "applied (the section's own default applies); set algorithm.loss.eps_clip_higher to choose another value"
    ]


def test_a_dependent_recipe_value_stays_where_the_user_agrees_sets_it_or_sets_only_it(plugins):
    dapo = ROOT / "examples" / "tiny_grpo" / "dapo.yaml"
    cfg, notes = _load(dapo, ["algorithm.loss.eps_clip=0.2"], plugins)  # the recipe's own value: no conflict
    assert (cfg.algorithm.loss.config.eps_clip, cfg.algorithm.loss.config.eps_clip_higher) == (0.2, 0.28)
    assert notes == []
    cfg, notes = _load(dapo, ["algorithm.loss.eps_clip=0.3"], plugins)
    assert (cfg.algorithm.loss.config.eps_clip, cfg.algorithm.loss.config.eps_clip_higher) == (0.3, None)
    assert notes and "on the command line (algorithm.loss.eps_clip=0.3)" in notes[0]
    cfg, notes = _load(dapo, ["algorithm.loss.eps_clip=0.3", "algorithm.loss.eps_clip_higher=0.4"], plugins)
    assert (cfg.algorithm.loss.config.eps_clip, cfg.algorithm.loss.config.eps_clip_higher) == (0.3, 0.4)
    assert notes == []
    cfg, notes = _load(dapo, ["algorithm.loss.eps_clip_higher=0.4"], plugins)  # the lower end depends on nothing
    assert (cfg.algorithm.loss.config.eps_clip, cfg.algorithm.loss.config.eps_clip_higher) == (0.2, 0.4)
    assert notes == []


def test_another_advantage_drops_the_ppo_recipes_batch_whitening(plugins):
    """ppo whitens GAE's returns (adv_norm); with online_dpo's advantages that would be refused."""
    cfg, _ = _load(ROOT / "examples" / "tiny_grpo" / "online_dpo.yaml", ["algorithm.name=ppo"], plugins)
    assert cfg.algorithm.advantage.name == "online_dpo" and cfg.algorithm.adv_norm is None
    cfg, _ = _load(ROOT / "examples" / "tiny_grpo" / "ppo.yaml", [], plugins)
    assert cfg.algorithm.adv_norm is not None  # the recipe's own pairing is untouched


def test_a_conflict_names_each_value_and_where_it_was_set(plugins):
    with pytest.raises(ConfigError) as info:
        load_config(GRPO_YAML, ["algorithm.loss.eps_clip_higher=0.1"], host=plugins)
    assert info.value.problems == [
        "algorithm.loss.eps_clip_higher: must be >= eps_clip (0.2) or null, got 0.1 (values: "
        "algorithm.loss.eps_clip_higher=0.1 on the command line (algorithm.loss.eps_clip_higher=0.1); "
        f"algorithm.loss.eps_clip=0.2 in {GRPO_YAML}:{_line(GRPO_YAML, 'eps_clip: 0.2')})"
    ]


def test_a_recipe_value_in_a_problem_is_named_as_the_recipes(plugins, tmp_path):
    data = yaml.safe_load(GRPO_YAML.read_text())
    data["algorithm"] = {"name": "dapo", "loss": {"eps_clip": 0.3}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path, ["algorithm.loss.eps_clip_higher=0.25"], host=plugins)
    assert f"algorithm.loss.eps_clip=0.3 in {path}:{_line(path, 'eps_clip: 0.3')}" in info.value.problems[0]
    with pytest.raises(ConfigError) as info:
        load_config(GRPO_YAML, ["algorithm.name=distill"], host=plugins)
    assert info.value.problems == [
        "teacher.model_path: required; the path of a Hugging Face model directory (values: teacher.model_path not "
        "set; teacher by the 'distill' recipe's defaults (core-rl-ppo; a value you set replaces it))"
    ]


def test_a_problem_about_one_value_the_user_wrote_stays_as_it_was(plugins):
    with pytest.raises(ConfigError) as info:
        load_config(GRPO_YAML, ["trainer.total_steps=0", "actor.optimzer.lr=1"], host=plugins)
    assert info.value.problems == [
        "actor.optimzer: unknown key; did you mean 'optimizer'?",
        "trainer.total_steps: must be in [1, 1000000000], got 0",
    ]


def test_switching_the_recipe_drops_the_files_options_for_the_loop_it_no_longer_selects(plugins):
    dpo = ROOT / "examples" / "tiny_supervised" / "dpo.yaml"
    cfg, notes = _load(dpo, ["algorithm.name=kto"], plugins)
    assert cfg.trainer.loop.name == "kto" and cfg.trainer.loop.config.beta == 0.1  # kto takes beta
    assert notes == [
        f"trainer.loop.name is 'kto' (was 'dpo' with algorithm.name 'dpo' in {dpo}; algorithm.name is 'kto'): "
        "dropped loss_type, label_smoothing, reference from the file, which training loop 'kto' does not take"
    ]
    with pytest.raises(ConfigError) as info:  # to an RL recipe: the rl loop, which needs a reward
        _load(dpo, ["algorithm.name=grpo"], plugins)
    assert info.value.problems == [
        "reward: required; select a reward, e.g. reward: {name: exact_match}, or add a reward_model: section"
    ]


def test_loop_options_without_a_loop_name_belong_to_the_default_loop(plugins):
    with pytest.raises(ConfigError) as info:
        load_config(GRPO_YAML, ["trainer.loop.beta=0.1"], host=plugins)
    assert info.value.problems == ["trainer.loop: training loop 'rl' takes no options, got beta"]


def test_config_show_prints_an_invalid_configuration_with_its_problems_marked(capsys):
    code = main(["config", "show", str(GRPO_YAML), "algorithm.loss.eps_clip_higher=0.1", "trainer.total_steps=0"])
    out, err = capsys.readouterr()
    assert code == 2
    shown = yaml.safe_load(out)  # comments only: what the file, overrides and recipe set, as data
    assert shown["algorithm"]["loss"] == {
        "name": "ppo_clip",
        "eps_clip": 0.2,
        "aggregation": "token-mean",
        "eps_clip_higher": 0.1,
    }
    assert shown["algorithm"]["advantage"] == {"name": "grpo"} and shown["trainer"]["total_steps"] == 0
    lines = out.splitlines()
    assert lines[0] == "# invalid configuration: 2 problems, marked '# PROBLEM:' below"
    at = yaml_lines(out)
    above_clip = lines[at[("algorithm", "loss", "eps_clip_higher")] - 2].strip()
    assert above_clip.startswith("# PROBLEM: algorithm.loss.eps_clip_higher: must be >= eps_clip (0.2)")
    assert "algorithm.loss.eps_clip=0.2 in" in above_clip
    above_steps = lines[at[("trainer", "total_steps")] - 2].strip()
    assert above_steps == "# PROBLEM: trainer.total_steps: must be in [1, 1000000000], got 0"
    assert sum(line.strip().startswith("# PROBLEM:") for line in lines) == 2
    assert "invalid configuration in" in err and "Traceback" not in err


def test_config_show_marks_a_problem_without_a_key_present_at_the_top(capsys, tmp_path):
    data = yaml.safe_load(GRPO_YAML.read_text())
    del data["reward"]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["config", "show", str(path)]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("# PROBLEM: reward: required;")


def test_config_show_of_a_valid_configuration_is_unchanged(capsys):
    assert main(["config", "show", str(GRPO_YAML)]) == 0
    out = capsys.readouterr().out
    assert "PROBLEM" not in out and yaml.safe_load(out)["algorithm"]["loss"]["eps_clip_higher"] is None


def test_yaml_lines_name_each_key_and_item():
    text = "a:\n  b: 1\n  c:\n  - x\n  - {d: 2}\n"
    assert yaml_lines(text) == {("a",): 1, ("a", "b"): 2, ("a", "c"): 3, ("a", "c", 0): 4, ("a", "c", 1): 5,
                                ("a", "c", 1, "d"): 5}  # fmt: skip
    assert yaml_lines("a: [") == {}
