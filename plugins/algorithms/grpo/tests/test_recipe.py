"""The ``grpo`` algorithm recipe: defaults merged under the user's configuration by the core loader."""

from __future__ import annotations

from pathlib import Path

import attrs
import core_rl.builtin.loggers as builtin_loggers
import core_rl_grpo.plugin as grpo_plugin
import pytest
from core_rl.config import load_config
from core_rl.errors import ConfigError
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import AlgorithmRecipe
from core_rl.kinds import ALGORITHM
from core_rl.plugins import PluginHost
from core_rl_grpo.advantages import GRPOAdvantageConfig, RLOOAdvantageConfig
from core_rl_grpo.losses import PPOClipConfig


@attrs.define
class _OtherLossConfig:
    beta: float = 1.0


class _StandIns:
    """Engines the run configuration selects by default (``fsdp``, ``hf``) and another loss, registered
    here so these tests depend on no other distribution; their factories are never called."""

    @hookimpl
    def core_rl_register_train_engines(self, register: Register) -> None:
        register("fsdp", object, description="stand-in")

    @hookimpl
    def core_rl_register_rollout_engines(self, register: Register) -> None:
        register("hf", object, description="stand-in")

    @hookimpl
    def core_rl_register_policy_losses(self, register: Register) -> None:
        register("other_loss", object, description="stand-in", config_cls=_OtherLossConfig)


@pytest.fixture
def host() -> PluginHost:
    h = PluginHost(entry_points=[])
    h.register_plugin(builtin_loggers, distribution="core-rl")
    h.register_plugin(_StandIns(), distribution="<test>")
    h.register_plugin(grpo_plugin, distribution="core-rl-grpo")
    return h


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
    assert cfg.algorithm.loss.config == PPOClipConfig()
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
