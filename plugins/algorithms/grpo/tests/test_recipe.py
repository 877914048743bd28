"""The ``grpo`` algorithm recipe: defaults merged under the user's configuration by the core loader."""

from __future__ import annotations

from pathlib import Path

import attrs
import core_rl_grpo.plugin as grpo_plugin
import pytest
from core_rl.config import load_config
from core_rl.errors import ConfigError
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import AlgorithmRecipe
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ALGORITHM
from core_rl.testing import recipe_host
from core_rl_grpo.config import GRPOAdvantageConfig, PPOClipConfig, RLOOAdvantageConfig


@attrs.define
class _OtherLossConfig:
    beta: float = 1.0


class _OtherLoss:
    """Another loss, registered here so these tests depend on no other distribution."""

    @hookimpl
    def core_rl_register_policy_losses(self, register: Register) -> None:
        register("other_loss", object, description="stand-in", config_cls=_OtherLossConfig)


@pytest.fixture
def host() -> PluginHost:
    return recipe_host((_OtherLoss(), "<test>"), (grpo_plugin, "core-rl-grpo"))


def load(host: PluginHost, *overrides: str, path: Path | None = None):
    return load_config(path, list(overrides), host=host, require_complete=False)


def test_recipe_object(host: PluginHost) -> None:
    recipe = host.get(ALGORITHM, "grpo").factory()
    assert isinstance(recipe, AlgorithmRecipe)
    assert recipe.defaults == {
        "algorithm": {"advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"}, "filters": []}
    }
    recipe.defaults["algorithm"]["loss"]["eps_clip"] = 0.5  # a fresh copy each call
    assert host.get(ALGORITHM, "grpo").factory().defaults["algorithm"]["loss"] == {"name": "ppo_clip"}


def test_defaults(host: PluginHost) -> None:
    cfg = load(host, "algorithm.name=grpo")
    assert cfg.algorithm.advantage.name == "grpo"
    assert cfg.algorithm.advantage.config == GRPOAdvantageConfig()
    assert cfg.algorithm.loss.name == "ppo_clip"
    # norm_length defaults to the response budget, rollout.sampling.max_new_tokens (256 by default)
    assert cfg.algorithm.loss.config == PPOClipConfig(norm_length=256)
    assert cfg.algorithm.filters == []


def test_user_yaml_overrides_the_advantage(host: PluginHost, tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("algorithm: {name: grpo, advantage: {name: rloo}}\n")
    cfg = load(host, path=path)
    assert cfg.algorithm.advantage.name == "rloo"
    assert cfg.algorithm.advantage.config == RLOOAdvantageConfig()
    assert cfg.algorithm.loss.name == "ppo_clip"


@pytest.mark.parametrize("override", ["algorithm.advantage.name=rloo", "algorithm.advantage=rloo"])
def test_dotted_override_replaces_the_advantage(host: PluginHost, override: str) -> None:
    cfg = load(host, "algorithm.name=grpo", override)
    assert cfg.algorithm.advantage.name == "rloo"
    assert cfg.algorithm.advantage.config == RLOOAdvantageConfig()


def test_overrides_set_options_and_filters(host: PluginHost) -> None:
    cfg = load(
        host,
        "algorithm.name=grpo",
        "algorithm.loss.eps_clip_higher=0.28",
        "algorithm.loss.kl_coef=0.04",
        "algorithm.advantage.norm_std=false",
        "algorithm.filters=[{name: drop_uniform_groups, min_std: 0.01}]",
    )
    assert cfg.algorithm.loss.config.eps_clip_higher == 0.28
    assert cfg.algorithm.loss.config.kl_coef == 0.04
    assert cfg.algorithm.advantage.config.norm_std is False
    assert [f.name for f in cfg.algorithm.filters] == ["drop_uniform_groups"]
    assert cfg.algorithm.filters[0].config.min_std == 0.01


def test_another_loss_gets_no_stale_options(host: PluginHost) -> None:
    cfg = load(host, "algorithm.name=grpo", "algorithm.loss.name=other_loss")
    assert cfg.algorithm.loss.name == "other_loss"
    assert cfg.algorithm.loss.config == _OtherLossConfig()


def test_bad_option_under_the_recipe_names_the_key(host: PluginHost) -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.loss\.eps_clip: must be in"):
        load(host, "algorithm.name=grpo", "algorithm.loss.eps_clip=2.0")
    with pytest.raises(ConfigError, match=r"algorithm\.advantage\.eps: must be in \(0, 1\.0\]"):
        load(host, "algorithm.name=grpo", "algorithm.advantage.eps=-1")


def test_dr_grpo_normalises_by_the_response_budget(host: PluginHost) -> None:
    cfg = load(host, "algorithm.name=dr_grpo", "rollout.sampling.max_new_tokens=96")
    assert cfg.algorithm.advantage.name == "grpo" and cfg.algorithm.advantage.config.norm_std is False
    loss = cfg.algorithm.loss.config
    assert loss.aggregation == "seq-mean-token-sum-norm" and loss.norm_length == 96
    assert load(host, "algorithm.name=dr_grpo", "algorithm.loss.norm_length=10").algorithm.loss.config.norm_length == 10


def test_rloo_and_reinforce_pp_recipes(host: PluginHost) -> None:
    rloo = load(host, "algorithm.name=rloo")
    assert rloo.algorithm.advantage.name == "rloo" and rloo.algorithm.loss.name == "ppo_clip"
    rpp = load(host, "algorithm.name=reinforce_pp", "algorithm.advantage.group_baseline=true")
    assert rpp.algorithm.advantage.name == "reinforce_pp" and rpp.algorithm.advantage.config.group_baseline
    assert rpp.algorithm.loss.config.aggregation == "token-mean"
