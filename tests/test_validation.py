"""Validation beyond types: finite sane ranges, checks across fields and sections, every problem of
a section at once, third-party validators and checks, and did-you-mean for plugin names."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import yaml
from core_rl.config import load_config
from core_rl.config.checks import SectionContext, config_problems, group_size_problems
from core_rl.config.loader import structure
from core_rl.config.schema import OptimizerConfig, RunConfig, SamplingConfig
from core_rl.config.validators import FieldValueError, each, finite, in_range, non_negative, not_empty, positive
from core_rl.errors import ConfigError
from core_rl.hookspecs import hookimpl
from core_rl.plugins.host import unknown_name_message
from core_rl.plugins.kinds import ADVANTAGE, REWARD, TRAIN_ENGINE


def _problems(cls, data) -> list[str]:
    with pytest.raises(ConfigError) as info:
        structure(data, cls, path="x")
    return info.value.problems


@pytest.mark.parametrize(
    "value", [float("inf"), float("-inf"), float("nan"), "inf", "-Infinity", "nan", "1e309", 10**400]
)
def test_no_float_field_takes_a_non_finite_number(value):
    problems = _problems(OptimizerConfig, {"lr": value})
    assert len(problems) == 1 and problems[0].startswith("x.lr: expected a finite number, got ")


def test_numeric_validators_refuse_non_finite_values_built_in_code():
    for validator in (positive(), non_negative(), finite(), in_range(0, 1)):
        with pytest.raises(FieldValueError, match="must be a finite number"):
            validator(None, attrs.fields(OptimizerConfig).lr, float("inf"))


@pytest.mark.parametrize(
    ("betas", "problem"),
    [
        ("12", "x.betas: expected a list of 2, got '12'"),
        ([0.9], "x.betas: expected a list of exactly 2 values, got [0.9]"),
        ([0.9, 0.99, 0.999], "x.betas: expected a list of exactly 2 values, got [0.9, 0.99, 0.999]"),
        ([0.9, 1.0], "x.betas[1]: must be in [0.0, 1.0), got 1.0"),
        ([0.9, "b"], "x.betas[1]: expected a number, got 'b'"),
    ],
)
def test_betas(betas, problem):
    assert _problems(OptimizerConfig, {"betas": betas}) == [problem]


def test_every_problem_of_a_section_at_once():
    problems = _problems(
        SamplingConfig,
        {"n": 0, "temperature": 0, "top_k": -1, "min_p": 1, "max_new_tokens": 0, "stop_token_ids": [1, -2], "x": 1},
    )
    assert sorted(problems) == [
        "x.max_new_tokens: must be in [1, 16777216], got 0",
        "x.min_p: must be in [0.0, 1.0), got 1.0",
        "x.n: must be in [1, 1048576], got 0",
        "x.stop_token_ids[1]: must be in [0, 16777216], got -2",
        "x.temperature: must be in (0.0, 100.0], got 0.0",
        "x.top_k: must be in [0, 16777216], got -1",
        "x.x: unknown key; valid keys: n, temperature, top_p, top_k, min_p, repetition_penalty, frequency_penalty, "
        "presence_penalty, max_new_tokens, min_new_tokens, stop_token_ids, stop, greedy, extra",
    ]


def test_min_p_defaults_off_and_eval_sampling_may_replace_it():
    from core_rl.config.eval_config import EvalSamplingConfig

    assert SamplingConfig().to_params().min_p == 0.0
    run = SamplingConfig(min_p=0.1)
    assert EvalSamplingConfig().resolve(run).min_p == 0.1
    assert EvalSamplingConfig(min_p=0.25).resolve(run).to_params().min_p == 0.25


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("repetition_penalty", 0, "must be in (0.0, 2.0], got 0.0"),
        ("repetition_penalty", 2.5, "must be in (0.0, 2.0], got 2.5"),
        ("frequency_penalty", -2.1, "must be in [-2.0, 2.0], got -2.1"),
        ("presence_penalty", 3, "must be in [-2.0, 2.0], got 3.0"),
    ],
)
def test_penalty_ranges(key, value, problem):
    assert _problems(SamplingConfig, {key: value}) == [f"x.{key}: {problem}"]
    for edge in {"repetition_penalty": (1e-3, 2.0)}.get(key, (-2.0, 2.0)):
        assert getattr(structure({key: edge}, SamplingConfig, path="x"), key) == edge


def test_penalties_default_off_and_eval_sampling_may_replace_them():
    from core_rl.config.eval_config import EvalSamplingConfig

    params = SamplingConfig().to_params()
    assert (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) == (1.0, 0.0, 0.0)
    run = SamplingConfig(repetition_penalty=1.2, frequency_penalty=0.5)
    assert EvalSamplingConfig().resolve(run).to_params().repetition_penalty == 1.2
    resolved = EvalSamplingConfig(frequency_penalty=0.0, presence_penalty=-0.5).resolve(run).to_params()
    assert (resolved.repetition_penalty, resolved.frequency_penalty, resolved.presence_penalty) == (1.2, 0.0, -0.5)
    assert _problems(EvalSamplingConfig, {"repetition_penalty": 0}) == [
        "x.repetition_penalty: must be in (0.0, 2.0], got 0.0"
    ]


def test_checks_across_fields_run_once_the_fields_are_valid():
    assert _problems(SamplingConfig, {"min_new_tokens": 9, "max_new_tokens": 8}) == [
        "x.min_new_tokens: must be <= max_new_tokens (8), got 9"
    ]
    # while a field is invalid the cross-field check stays quiet instead of piling on
    assert _problems(SamplingConfig, {"min_new_tokens": 9, "max_new_tokens": 0}) == [
        "x.max_new_tokens: must be in [1, 16777216], got 0"
    ]


@attrs.define
class ThirdPartyConfig:
    """Uses attrs' own validators and containers the core's converter must handle."""

    count: int = attrs.field(default=1, validator=attrs.validators.gt(0))
    weights: dict[str, float] = attrs.field(factory=dict, validator=attrs.validators.max_len(2))
    names: list[str] = attrs.field(factory=list, validator=each(not_empty()))
    pair: tuple[int, ...] = (1, 2)


def test_third_party_validators_and_containers():
    problems = _problems(
        ThirdPartyConfig, {"count": 0, "weights": {"a": 1, "b": "heavy"}, "names": ["a", ""], "pair": "12"}
    )
    assert sorted(problems) == [
        "x.count: 'count' must be > 0: 0, got 0",  # attrs' own wording, after the key path
        "x.names[1]: must not be empty, got ''",
        "x.pair: expected a list of values, got '12'",
        "x.weights.b: expected a number, got 'heavy'",
    ]
    assert _problems(ThirdPartyConfig, {"weights": [1, 2]}) == ["x.weights: expected a mapping, got [1, 2]"]
    assert _problems(ThirdPartyConfig, {"weights": {"a": 1, "b": 2, "c": 3}}) == [
        "x.weights: Length of 'weights' must be <= 2: 3, got {'a': 1.0, 'b': 2.0, 'c': 3.0}"
    ]
    assert structure({"weights": {"a": 1}, "pair": [3, 4, 5]}, ThirdPartyConfig).pair == (3, 4, 5)


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _load_problems(path: Path, host) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, [], host=host)
    return info.value.problems


def test_size_bounds_across_sections(tmp_path: Path, host, minimal_config):
    minimal_config["data"]["batch_size"] = 4096
    minimal_config["rollout"]["sampling"] = {"n": 1024}
    assert _load_problems(_write(tmp_path, minimal_config), host) == [
        "data.batch_size: 4096 prompts x rollout.sampling.n=1024 samples is 4194304 samples per step, more than "
        "1048576; lower one of them"
    ]


@attrs.define
class GroupAdvantageConfig:
    allow_single_sample_groups: bool = False

    def check_config(self, context: SectionContext) -> list[str]:
        return group_size_problems(
            context, allowed=self.allow_single_sample_groups, option="allow_single_sample_groups"
        )


class GroupPlugin:
    @hookimpl
    def core_rl_register_advantage_estimators(self, register):
        register("group_adv", lambda config: None, description="test", config_cls=GroupAdvantageConfig)


def test_a_plugin_check_config_sees_the_whole_run(tmp_path: Path, host, minimal_config):
    host.register_plugin(GroupPlugin(), distribution="test-group")
    minimal_config["algorithm"]["advantage"] = {"name": "group_adv"}
    minimal_config["rollout"]["sampling"] = {"n": 1}
    path = _write(tmp_path, minimal_config)
    assert _load_problems(path, host) == [
        "algorithm.advantage: 'group_adv' compares the samples of each prompt's group, but rollout.sampling.n is 1, "
        "so every group holds one sample and nothing would train; set rollout.sampling.n to 2 or more, or "
        "algorithm.advantage.allow_single_sample_groups=true to run anyway"
    ]
    cfg = load_config(path, ["algorithm.advantage.allow_single_sample_groups=true"], host=host)
    assert cfg.rollout.sampling.n == 1
    assert load_config(path, ["rollout.sampling.n=2"], host=host).rollout.sampling.n == 2


def test_a_check_that_returns_something_else_is_a_bug():
    class Broken:
        def check_config(self, context):
            return "not a list"

    with pytest.raises(TypeError, match=r"check_config must return an iterable of strings"):
        config_problems(Broken(), SectionContext(path="reward", run=RunConfig()))

    class Relative:
        def check_config(self, context):
            return ["needs more cowbell", "actor.dtype: not this one"]

    assert config_problems(Relative(), SectionContext(path="reward", run=RunConfig())) == [
        "reward: needs more cowbell",  # a line without a key path gets the section's
        "actor.dtype: not this one",
    ]


def test_did_you_mean_for_plugin_names(host):
    with pytest.raises(Exception, match=r"reward 'constnt' is not installed; did you mean 'constant'\?"):
        host.get(REWARD, "constnt")
    # close to a name an extra provides that is not installed: suggest it with its install hint
    message = unknown_name_message(ADVANTAGE, "rlo", ["rank_advantage"])
    assert message == (
        "advantage estimator 'rlo' is not installed (installed: rank_advantage); did you mean 'rloo'? "
        'install it with: pip install "core-rl[grpo]"'
    )
    # a name an extra provides exactly: its install hint
    assert unknown_name_message(TRAIN_ENGINE, "megatron", ["fsdp"]).endswith(
        'install it with: pip install "core-rl[megatron]"'
    )
    # far from everything: the plain hint
    assert unknown_name_message(TRAIN_ENGINE, "quantum_engine", ["fsdp"]).endswith(
        "install the distribution that registers 'quantum_engine' in entry-point group core_rl.train_engines"
    )
