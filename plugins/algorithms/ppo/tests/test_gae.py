"""The ``gae`` estimator: GAE on the batch's values with the KL folded into the reward (against the
ops it composes, computed by hand), the adaptive coefficient and its saved state, and the
configuration checks (a critic is required; the ppo recipe starts it from the actor's model)."""

from __future__ import annotations

import pytest
import torch
from core_rl import ops
from core_rl.config import load_config
from core_rl.errors import ConfigError
from core_rl.testing import make_rl_batch, recipe_host
from core_rl_ppo.config import GAEConfig
from core_rl_ppo.gae import GAEAdvantage


def _batch():
    batch = make_rl_batch(seed=2)
    batch["values"] = torch.linspace(0.1, 0.9, batch["input_ids"].shape[1])[None, :] * batch["response_mask"]
    return batch


def test_gae_without_kl_is_ops_gae_on_the_outcome_reward() -> None:
    batch = _batch()
    adv = GAEAdvantage(GAEConfig(discount=0.9, gae_lambda=0.5))(batch)
    rewards = ops.token_level_rewards(batch["rewards"], batch["response_mask"])
    want, returns = ops.gae_advantages(rewards, batch["values"], batch["response_mask"], discount=0.9, gae_lambda=0.5)
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(batch["returns"], returns)
    # discount 1, lambda 1: every response token's advantage is the outcome reward minus its value
    adv = GAEAdvantage(GAEConfig())(batch)
    m = batch["response_mask"]
    torch.testing.assert_close(adv, (batch["rewards"][:, None] - batch["values"]) * m)


def test_kl_in_reward_and_adaptive_coefficient() -> None:
    batch = _batch()
    m = batch["response_mask"]
    gae = GAEAdvantage(GAEConfig(gae_lambda=0.0, kl_ctl=0.2, kl_estimator="k1", kl_target=0.01, kl_horizon=100))
    assert gae.requires_reference and gae.requires_values
    adv = gae(batch)
    kl = (batch["old_logprobs"] - batch["ref_logprobs"]) * m
    # lambda 0, discount 1: A_t = r_t + V_{t+1} - V_t, with r_t = -0.2 kl_t (+ reward at the last token)
    rewards = -0.2 * kl + batch["rewards"][:, None] * ops.last_token_mask(m)
    want, _ = ops.gae_advantages(rewards, batch["values"], m, discount=1.0, gae_lambda=0.0)
    torch.testing.assert_close(adv, want)
    observed = float(kl.sum(1).mean())
    assert gae.metrics() == {"kl_coef": 0.2, "kl_in_reward": pytest.approx(observed)}
    expected = 0.2 * (1 + max(min(observed / 0.01 - 1, 0.2), -0.2) * batch.batch_size / 100)
    assert gae.kl_coef == pytest.approx(expected) and gae.kl_coef != 0.2
    resumed = GAEAdvantage(gae.config)
    resumed.load_state_dict(gae.state_dict())
    assert resumed.kl_coef == gae.kl_coef


def _load(tmp_path, *overrides: str):
    import core_rl_grpo.plugin as grpo_plugin
    import core_rl_ppo.plugin as ppo_plugin

    host = recipe_host((ppo_plugin, "core-rl-ppo"), (grpo_plugin, "core-rl-grpo"))
    return load_config(None, ["actor.model_path=/m", *overrides], host=host, require_complete=False)


def test_ppo_recipe_starts_the_critic_from_the_actor(tmp_path) -> None:
    cfg = _load(tmp_path, "algorithm.name=ppo")
    assert cfg.critic is not None and cfg.critic.model_path == "/m"
    assert cfg.algorithm.advantage.name == "gae" and cfg.algorithm.loss.name == "ppo_clip"
    cfg = _load(tmp_path, "algorithm.name=ppo", "critic.model_path=/v", "critic.loss=huber")
    assert cfg.critic.model_path == "/v" and cfg.critic.loss == "huber"


def test_gae_without_a_critic_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"critic: algorithm.advantage 'gae' needs a value model"):
        _load(tmp_path, "algorithm.advantage.name=gae", "algorithm.loss.name=ppo_clip")
    with pytest.raises(ConfigError, match=r"kl_target: needs kl_ctl > 0"):
        _load(tmp_path, "algorithm.name=ppo", "algorithm.advantage.kl_target=0.1")


def test_distill_recipe_turns_the_rl_loss_off(tmp_path) -> None:
    cfg = _load(tmp_path, "algorithm.name=distill", "teacher.model_path=/t")
    assert cfg.teacher is not None and cfg.teacher.rl_coef == 0.0 and cfg.teacher.distill_coef == 1.0
    assert cfg.teacher.model_path == "/t" and cfg.critic is None
