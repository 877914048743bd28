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
    minimal_config["rollout"]["sampling"] = {"top_p": 1.5, "min_p": -0.1, "presence_penalty": 2.5}
    minimal_config["reward"]["scale"] = 0
    minimal_config["trainer"] = {"resume": "yes"}
    problems = _problems(tmp_path, minimal_config, host=host)
    assert "actor.optimizer.lr: must be in (0, 10.0], got -1.0" in problems
    assert "actor.grad_clip: expected a number, got 'big'" in problems
    assert "rollout.sampling.top_p: must be in (0.0, 1.0], got 1.5" in problems
    assert "rollout.sampling.min_p: must be in [0.0, 1.0), got -0.1" in problems
    assert "rollout.sampling.presence_penalty: must be in [-2.0, 2.0], got 2.5" in problems
    assert "reward.scale: must be > 0, got 0.0" in problems
    assert "trainer.resume: expected true or false, got 'yes'" in problems


def test_choices_are_listed(tmp_path, host, minimal_config):
    minimal_config["actor"]["lr_scheduler"] = {"name": "cosin"}
    problems = _problems(tmp_path, minimal_config, host=host)
    assert problems == ["actor.lr_scheduler.name: must be one of 'constant', 'linear', 'cosine', 'wsd', got 'cosin'"]


def test_unknown_plugin_names_key_path_and_hint(tmp_path, host, minimal_config):
    minimal_config["rollout"]["engine"] = {"name": "tensorrt"}
    minimal_config["loggers"] = [{"name": "jsonl"}, {"name": "nope"}]
    problems = _problems(tmp_path, minimal_config, host=host)
    assert any(
        p.startswith("rollout.engine.name: rollout engine 'tensorrt' is not installed (installed: ") for p in problems
    )
    assert any(p.startswith("loggers[1].name: logger 'nope' is not installed") for p in problems), problems


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


def test_algorithm_options_every_recipe_has(tmp_path, host, minimal_config):
    cfg = load_config(
        _write(tmp_path, minimal_config),
        [
            "algorithm.ppo_n_minibatches=2",
            "algorithm.ppo_epochs=3",
            "algorithm.recompute_logprob=true",
            "algorithm.max_num_gen_batches=4",
            "algorithm.mask_no_eos_with_zero=true",
            "algorithm.reward_shaping={scale: 2.0, clip: 5.0, overlong_tokens: 16, norm: {mean_level: group}}",
            "algorithm.adv_norm={mean_level: batch, std_level: none}",
        ],
        host=host,
    )
    alg = cfg.algorithm
    assert (alg.ppo_n_minibatches, alg.ppo_epochs, alg.recompute_logprob, alg.max_num_gen_batches) == (2, 3, True, 4)
    assert alg.reward_shaping.overlong_tokens == 16 and alg.reward_shaping.norm.mean_level == "group"
    assert alg.adv_norm.std_level == "none"
    # the schedule counts optimiser steps: 100 RL steps x 2 minibatches x 3 epochs
    assert cfg.actor.lr_scheduler.total_steps == 600


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.ppo_n_minibatches=0"], "algorithm.ppo_n_minibatches: must be in [1, 1048576], got 0"),
        (["algorithm.max_num_gen_batches=0"], "algorithm.max_num_gen_batches: must be in [1, 10000], got 0"),
        (
            ["algorithm.adv_norm={mean_level: none, leave_one_out: true}"],
            "algorithm.adv_norm.leave_one_out: needs a mean_level (batch or group), not 'none', got True",
        ),
        (
            ["algorithm.reward_shaping.norm={std_level: groups}"],
            "algorithm.reward_shaping.norm.std_level: must be one of 'batch', 'group', 'none', got 'groups'",
        ),
        (
            ["algorithm.reward_shaping.overlong_tokens=300"],
            "algorithm.reward_shaping.overlong_tokens: must be <= rollout.sampling.max_new_tokens (256), got 300",
        ),
        (
            ["algorithm.ppo_n_minibatches=40", "data.batch_size=2"],
            "algorithm.ppo_n_minibatches: must be <= the samples of a step, data.batch_size x rollout.sampling.n "
            "= 8, got 40",
        ),
        (["algorithm.rejection_sampling.name=nope"], "algorithm.rejection_sampling.name: rejection sampler 'nope'"),
    ],
)
def test_algorithm_option_errors_name_the_keys(tmp_path, host, minimal_config, overrides, message):
    problems = _problems(tmp_path, minimal_config, overrides, host=host)
    assert any(p.startswith(message) for p in problems), problems


def test_norm_levels_agree_with_the_math():
    from core_rl.config.schema import NormConfig
    from core_rl.ops import NORM_LEVELS

    for level in NORM_LEVELS:  # the schema accepts every level core_rl.ops.normalize knows
        NormConfig(mean_level=level, std_level=level)
    with pytest.raises(ValueError, match="mean_level"):
        NormConfig(mean_level="sample")


def test_plugin_fields_can_default_to_another_key_and_check_the_run(tmp_path, host, minimal_config):
    import attrs
    from core_rl.config.schema import default_from
    from core_rl.hookspecs import Register, hookimpl

    @attrs.define
    class BudgetLossConfig:
        budget: int | None = attrs.field(default=None, metadata=default_from("rollout.sampling.max_new_tokens"))

        def check_config(self, context):
            return [f"{context.key('budget')}: too small"] if self.budget < 10 else []

    class BudgetLoss:
        @hookimpl
        def core_rl_register_policy_losses(self, register: Register) -> None:
            register("budget_loss", lambda config: None, description="test", config_cls=BudgetLossConfig)

    host.register_plugin(BudgetLoss(), distribution="test-budget")
    minimal_config["algorithm"]["loss"] = {"name": "budget_loss"}
    cfg = load_config(_write(tmp_path, minimal_config), ["rollout.sampling.max_new_tokens=48"], host=host)
    assert cfg.algorithm.loss.config.budget == 48  # unset: taken from the run
    shown = to_yaml(cfg)
    assert "budget: null  # derived: 48 = rollout.sampling.max_new_tokens" in shown  # kept derived, value shown
    (tmp_path / "shown.yaml").write_text(shown)
    again = load_config(tmp_path / "shown.yaml", ["rollout.sampling.max_new_tokens=64"], host=host)
    assert again.algorithm.loss.config.budget == 64  # the shown file derives it anew
    cfg = load_config(_write(tmp_path, minimal_config), ["algorithm.loss.budget=12"], host=host)
    assert cfg.algorithm.loss.config.budget == 12  # set: kept
    problems = _problems(tmp_path, minimal_config, ["rollout.sampling.max_new_tokens=4"], host=host)
    assert problems == ["algorithm.loss.budget: too small"]


def test_derived_keys_stay_derived_in_the_shown_yaml(tmp_path, host, minimal_config):
    """Each key the loader derives from others is shown as what keeps it derived, with its value
    in a comment, so the shown file loaded with another trainer.total_steps derives them anew:
    the actor's and the critic's schedules (total_steps; warmup_steps from warmup_ratio) and
    ${...} interpolations."""
    minimal_config["actor"]["lr_scheduler"] = {"name": "cosine", "warmup_ratio": 0.1}
    minimal_config["critic"] = {"model_path": "/m", "engine": {"name": "eng"}, "lr_scheduler": {"name": "linear"}}
    minimal_config["experiment"] = {"name": "run-${trainer.total_steps}"}
    minimal_config["trainer"] = {"total_steps": 10}
    cfg = load_config(_write(tmp_path, minimal_config), ["algorithm.ppo_epochs=2"], host=host, require_complete=False)
    assert (cfg.actor.lr_scheduler.total_steps, cfg.actor.lr_scheduler.warmup_steps) == (20, 2)
    assert (cfg.critic.lr_scheduler.total_steps, cfg.critic.lr_scheduler.warmup_steps) == (20, 0)
    shown = to_yaml(cfg)
    total = "total_steps: 0  # derived: 20 = trainer.total_steps x algorithm.ppo_n_minibatches x algorithm.ppo_epochs"
    assert shown.count(f"    {total} = 10 x 1 x 2\n") == 2  # the actor's and the critic's
    assert "    warmup_steps: 0  # derived: 2 = floor(warmup_ratio x total_steps) = floor(0.1 x 20)\n" in shown
    assert '  name: run-${trainer.total_steps}  # derived: "run-10"\n' in shown
    assert to_plain(cfg)["actor"]["lr_scheduler"]["total_steps"] == 20  # what components and loggers see

    (tmp_path / "shown.yaml").write_text(shown)
    again = load_config(tmp_path / "shown.yaml", ["trainer.total_steps=30"], host=host, require_complete=False)
    assert (again.actor.lr_scheduler.total_steps, again.actor.lr_scheduler.warmup_steps) == (60, 6)
    assert again.critic.lr_scheduler.total_steps == 60
    assert again.experiment.name == "run-30"


def test_a_decaying_schedule_shorter_than_the_run_is_refused(tmp_path, host, minimal_config):
    """A schedule's total_steps fixed below the run's (a file recorded before derived keys stayed
    derived, then extended) would train the last steps at learning rate 0."""
    minimal_config["actor"]["lr_scheduler"] = {"name": "cosine", "total_steps": 10}
    line = _write(tmp_path, minimal_config).read_text().splitlines().index("    total_steps: 10") + 1
    assert _problems(tmp_path, minimal_config, ["trainer.total_steps=20"], host=host) == [
        "actor.lr_scheduler.total_steps: the cosine schedule reaches learning rate 0 at optimiser step 10, but the "
        "run takes 20 (trainer.total_steps=20 x 1 optimiser step(s) per step), so its last 10 optimiser steps would "
        "not train; set actor.lr_scheduler.total_steps=0 (the default: follow trainer.total_steps) or at least 20, "
        "or actor.lr_scheduler.min_lr_ratio above 0 (values: actor.lr_scheduler.total_steps=10 in "
        f"{tmp_path / 'run.yaml'}:{line}; trainer.total_steps=20 on the command line (trainer.total_steps=20))"
    ]
    path = _write(tmp_path, minimal_config)
    load_config(path, ["trainer.total_steps=10"], host=host)  # as long as the run
    load_config(path, ["trainer.total_steps=20", "actor.lr_scheduler.min_lr_ratio=0.1"], host=host)  # a floor
    load_config(path, ["trainer.total_steps=20", "actor.lr_scheduler.name=constant"], host=host)


def test_a_wsd_warmup_must_end_before_its_decay(tmp_path, host, minimal_config):
    minimal_config["actor"]["lr_scheduler"] = {"name": "wsd", "warmup_ratio": 0.5, "decay_ratio": 0.6}
    assert _problems(tmp_path, minimal_config, ["trainer.total_steps=10"], host=host) == [
        "actor.lr_scheduler: the wsd warmup (5 optimiser steps) overlaps its decay (the last 6 of 10: "
        "decay_ratio=0.6); lower warmup_steps/warmup_ratio or decay_ratio"
    ]
    load_config(
        _write(tmp_path, minimal_config), ["trainer.total_steps=10", "actor.lr_scheduler.decay_ratio=0.5"], host=host
    )


def test_micro_batch_and_lora_sections(tmp_path, host, minimal_config):
    cfg = load_config(_write(tmp_path, minimal_config), [], host=host)
    mb, lora = cfg.actor.micro_batch, cfg.actor.lora
    assert (mb.packing_algorithm, mb.layout, mb.rank_assignment) == ("ffd", "auto", "balanced")
    assert not lora.enabled and lora.target_modules == ["all-linear"]
    overrides = ["actor.lora.rank=8", "actor.micro_batch.layout=packed", "actor.micro_batch.packing_algorithm=kk"]
    cfg = load_config(_write(tmp_path, minimal_config), overrides, host=host)
    assert cfg.actor.lora.enabled and cfg.actor.micro_batch.layout == "packed"
    minimal_config["actor"]["micro_batch"] = {"layout": "ragged"}
    minimal_config["actor"]["lora"] = {"rank": -1}
    problems = _problems(tmp_path, minimal_config, host=host)
    assert "actor.micro_batch.layout: must be one of 'auto', 'padded', 'packed', 'shared', got 'ragged'" in problems
    assert "actor.lora.rank: must be in [0, 65536], got -1" in problems
    minimal_config["actor"]["micro_batch"] = {"rank_assignment": "random"}
    minimal_config["actor"]["lora"] = {"dropout": 1.0}
    problems = _problems(tmp_path, minimal_config, host=host)
    assert "actor.micro_batch.rank_assignment: must be one of 'balanced', 'strided', got 'random'" in problems
    assert "actor.lora.dropout: must be in [0.0, 1.0), got 1.0" in problems
