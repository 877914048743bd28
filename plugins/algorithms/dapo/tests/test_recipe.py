"""The ``dapo`` recipe resolves to DAPO's configuration, and the user's YAML still wins."""

from __future__ import annotations

import core_rl_dapo.plugin as dapo_plugin
import core_rl_grpo.plugin as grpo_plugin
import pytest
from core_rl.config import load_config
from core_rl.errors import ConfigError
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ALGORITHM
from core_rl.testing import recipe_host


@pytest.fixture
def host() -> PluginHost:
    return recipe_host((grpo_plugin, "core-rl-grpo"), (dapo_plugin, "core-rl-dapo"))


def load(host: PluginHost, *overrides: str):
    return load_config(None, ["algorithm.name=dapo", *overrides], host=host, require_complete=False)


def test_dapo_is_clip_higher_token_mean_and_dynamic_sampling(host):
    cfg = load(host)
    loss = cfg.algorithm.loss.config
    assert cfg.algorithm.advantage.name == "grpo" and cfg.algorithm.advantage.config.norm_std is True
    assert (loss.eps_clip, loss.eps_clip_higher, loss.aggregation) == (0.2, 0.28, "token-mean")
    assert loss.kl_coef == 0.0
    assert [f.name for f in cfg.algorithm.filters] == ["drop_uniform_groups"]
    assert cfg.algorithm.max_num_gen_batches == 10


def test_overlong_shaping_and_masking_are_the_users_to_set(host):
    cfg = load(
        host,
        "rollout.sampling.max_new_tokens=64",
        "algorithm.reward_shaping.overlong_tokens=16",
        "algorithm.mask_no_eos_with_zero=true",
    )
    assert cfg.algorithm.reward_shaping.overlong_tokens == 16 and cfg.algorithm.mask_no_eos_with_zero
    assert [f.name for f in cfg.algorithm.filters] == ["drop_uniform_groups"]
    with pytest.raises(ConfigError, match=r"overlong_tokens: must be <= rollout.sampling.max_new_tokens \(64\)"):
        load(host, "rollout.sampling.max_new_tokens=64", "algorithm.reward_shaping.overlong_tokens=65")
    with pytest.raises(ConfigError, match=r"algorithm\.max_num_gen_batches: must be in \[1, 10000\]"):
        load(host, "algorithm.max_num_gen_batches=0")


def test_recipe_copies(host):
    first = host.get(ALGORITHM, "dapo").factory()
    first.defaults["algorithm"]["filters"].clear()
    assert host.get(ALGORITHM, "dapo").factory().defaults["algorithm"]["filters"] == [{"name": "drop_uniform_groups"}]
