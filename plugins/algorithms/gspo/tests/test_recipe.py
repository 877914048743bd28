"""The ``gspo`` recipe resolves to GSPO's configuration, and the user's YAML still wins."""

from __future__ import annotations

import core_rl_grpo.plugin as grpo_plugin
import core_rl_gspo.plugin as gspo_plugin
import pytest
from core_rl.config import load_config
from core_rl.errors import ConfigError
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ALGORITHM
from core_rl.testing import recipe_host


@pytest.fixture
def host() -> PluginHost:
    return recipe_host((grpo_plugin, "core-rl-grpo"), (gspo_plugin, "core-rl-gspo"))


def load(host: PluginHost, *overrides: str):
    return load_config(None, ["algorithm.name=gspo", *overrides], host=host, require_complete=False)


def test_gspo_is_sequence_level_ppo_with_a_narrow_clip(host):
    cfg = load(host)
    loss = cfg.algorithm.loss.config
    assert cfg.algorithm.advantage.name == "grpo" and cfg.algorithm.loss.name == "ppo_clip"
    assert loss.importance_sampling_level == "sequence"
    assert (loss.eps_clip, loss.eps_clip_higher) == (3.0e-4, 4.0e-4)
    assert loss.aggregation == "seq-mean-token-mean"
    assert cfg.algorithm.ppo_n_minibatches == 4 and cfg.algorithm.recompute_logprob is True
    assert cfg.actor.lr_scheduler.total_steps == 4 * cfg.trainer.total_steps


def test_the_users_settings_win(host):
    cfg = load(host, "algorithm.loss.eps_clip_higher=5e-4", "algorithm.ppo_n_minibatches=1")
    assert cfg.algorithm.loss.config.eps_clip_higher == 5e-4 and cfg.algorithm.ppo_n_minibatches == 1
    cfg = load(host, "algorithm.loss.use_decoupled_loss=true", "algorithm.rejection_sampling.name=tis")
    assert cfg.algorithm.loss.config.importance_sampling_level == "sequence"
    assert cfg.algorithm.rejection_sampling.name == "tis"
    with pytest.raises(ConfigError, match=r"algorithm\.loss\.eps_clip_higher: must be >= eps_clip"):
        load(host, "algorithm.loss.eps_clip_higher=1e-4")


def test_recipe_copies(host):
    first = host.get(ALGORITHM, "gspo").factory()
    first.defaults["algorithm"]["loss"]["eps_clip"] = 0.5
    assert host.get(ALGORITHM, "gspo").factory().defaults["algorithm"]["loss"]["eps_clip"] == 3.0e-4
