"""The KL penalty in the reward (``algorithm.advantage.kl_ctl``, :mod:`core_rl.ops.kl_reward`) for the
group-outcome estimators and REINFORCE++: hand-computed advantages, parity with the loop-per-sample
reference formulation under hypothesis, the adaptive coefficient and its resume, the configuration
checks, and a tiny real ``core-rl train`` run of REINFORCE++ with the KL in its reward."""

from __future__ import annotations

import json
import math
from pathlib import Path

import core_rl_grpo.plugin as grpo_plugin
import pytest
import torch
from core_rl import ops
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.loops.rl.batching import runs_in_update
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ADVANTAGE
from core_rl.protocol import TensorBatch
from core_rl.testing import reference
from hypothesis import given, settings
from hypothesis import strategies as st


def build(name: str, **options: object):
    host = PluginHost(entry_points=[])
    host.register_plugin(grpo_plugin, distribution="core-rl-grpo")
    entry = host.get(ADVANTAGE, name)
    return entry.factory(structure(options, entry.config_cls, path="algorithm.advantage"))


# four samples in two groups; k1 KL per token (old - ref): a [0.5, 0.5], b [0.25], c [0, 0], d [1, 1]
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
OLD = torch.tensor([[-0.5, -1.0], [-1.0, 0.0], [-2.0, -2.0], [-1.0, -0.5]])
REF = torch.tensor([[-1.0, -1.5], [-1.25, 0.0], [-2.0, -2.0], [-2.0, -1.5]])


def hand_batch() -> TensorBatch:
    return TensorBatch(
        {
            "rewards": torch.tensor([1.0, 1.0, 1.0, 0.0]),
            "group_index": torch.tensor([0, 0, 1, 1]),
            "response_mask": MASK.clone(),
            "old_logprobs": OLD.clone(),
            "ref_logprobs": REF.clone(),
        }
    )


def test_grpo_and_rloo_subtract_the_summed_kl_from_the_score() -> None:
    # beta 0.5: scores a 1 - 0.5 * 1 = 0.5, b 1 - 0.5 * 0.25 = 0.875, c 1, d 0 - 0.5 * 2 = -1
    # group 0 [0.5, 0.875]: mean 0.6875, deviations -+0.1875, unbiased std 0.1875 * sqrt(2)
    # group 1 [1, -1]: mean 0, deviations +-1, unbiased std sqrt(2)
    unnormalised = build("grpo", kl_ctl=0.5, norm_std=False)(hand_batch())
    want = torch.tensor([[-0.1875, -0.1875], [0.1875, 0.0], [1.0, 1.0], [-1.0, -1.0]])
    torch.testing.assert_close(unnormalised, want)
    normalised = build("grpo", kl_ctl=0.5)(hand_batch())
    a, b = 0.1875 / (0.1875 * math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)
    torch.testing.assert_close(normalised, torch.tensor([[-a, -a], [a, 0.0], [b, b], [-b, -b]]))
    # leave-one-out: a 0.5 - 0.875, b 0.875 - 0.5, c 1 - (-1), d -1 - 1
    rloo = build("rloo", kl_ctl=0.5)(hand_batch())
    torch.testing.assert_close(rloo, torch.tensor([[-0.375, -0.375], [0.375, 0.0], [2.0, 2.0], [-2.0, -2.0]]))
    # without the penalty group 0 is uniform (1, 1): its advantages are exactly 0
    assert (build("grpo")(hand_batch())[:2] == 0).all()


def test_reinforce_pp_pays_the_kl_per_token_and_discounts_it() -> None:
    # beta 0.5, per-token rewards: a [-0.25, 1 - 0.25], b [1 - 0.125], c [0, 1], d [-0.5, -0.5]
    # gamma 1: returns a [0.5, 0.75], b [0.875], c [1, 1], d [-1, -0.5]
    returns = torch.tensor([0.5, 0.75, 0.875, 1.0, 1.0, -1.0, -0.5])
    want = (returns - returns.mean()) / (returns.std() + 1e-5)
    got = build("reinforce_pp", kl_ctl=0.5)(hand_batch())
    torch.testing.assert_close(got[MASK != 0], want)
    # gamma 0.5: a [-0.25 + 0.5 * 0.75, 0.75], c [0.5, 1], d [-0.5 - 0.25, -0.5]
    returns = torch.tensor([0.125, 0.75, 0.875, 0.5, 1.0, -0.75, -0.5])
    want = (returns - returns.mean()) / (returns.std() + 1e-5)
    torch.testing.assert_close(build("reinforce_pp", kl_ctl=0.5, gamma=0.5)(hand_batch())[MASK != 0], want)
    # group baseline first (group 0 [1, 1] -> 0, group 1 [1, 0] -> +-0.5), then the per-token KL (gamma 1):
    # a [-0.5, -0.25], b [-0.125], c [0.5, 0.5], d [-1.5, -1]
    returns = torch.tensor([-0.5, -0.25, -0.125, 0.5, 0.5, -1.5, -1.0])
    want = (returns - returns.mean()) / (returns.std() + 1e-5)
    got = build("reinforce_pp", kl_ctl=0.5, group_baseline=True)(hand_batch())
    torch.testing.assert_close(got[MASK != 0], want)


def test_off_is_bitwise_the_estimator_without_it_and_needs_no_reference() -> None:
    full = hand_batch()
    batch = TensorBatch({k: full[k] for k in ("rewards", "group_index", "response_mask", "old_logprobs")})
    rewards, groups = batch["rewards"], batch["group_index"]
    without = {  # the estimators' math before the KL in the reward, composed from the ops
        "grpo": ops.normalize(rewards, group_index=groups, mean_level="group", std_level="group", eps=1e-6)[:, None]
        * MASK,
        "rloo": ops.normalize(rewards, group_index=groups, mean_level="group", std_level="none", leave_one_out=True)[
            :, None
        ]
        * MASK,
        "reinforce_pp": ops.normalize(ops.discounted_outcome_returns(rewards, MASK, 0.9), mask=MASK, eps=1e-5),
    }
    for name, options in (("grpo", {}), ("rloo", {}), ("reinforce_pp", {"gamma": 0.9})):
        off = build(name, **options)
        assert not off.requires_reference and not runs_in_update(off)
        assert torch.equal(off(batch), without[name]), name
        assert off.metrics() == {} and off.state_dict() == {"kl_coef": 0.0}
        on = build(name, **options, kl_ctl=0.1)
        assert on.requires_reference and runs_in_update(on)


@st.composite
def kl_batch(draw):
    """A right-padded batch of 1..8 rows with random log-probs, rewards and groups."""
    rows, width = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, width), min_size=rows, max_size=rows))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    return TensorBatch(
        {
            "rewards": torch.randint(0, 3, (rows,), generator=g).float(),
            "group_index": torch.randint(0, 3, (rows,), generator=g),
            "response_mask": mask,
            "old_logprobs": -torch.rand(rows, width, generator=g) * 3 * mask,
            "ref_logprobs": -torch.rand(rows, width, generator=g) * 3 * mask,
        }
    )


@settings(max_examples=40, deadline=None)
@given(
    kl_batch(),
    st.sampled_from(["grpo", "rloo", "reinforce_pp"]),
    st.sampled_from(["k1", "k2", "k3"]),
    st.floats(0.01, 2.0),
    st.booleans(),
    st.sampled_from([1.0, 0.8]),
)
def test_parity_with_the_reference_formulation(batch, name, estimator, beta, flag, gamma) -> None:
    lengths = batch["response_mask"].sum(1).long().tolist()
    token_kl = reference.token_kl(batch["old_logprobs"], batch["ref_logprobs"], lengths, estimator)
    rewards, groups = batch["rewards"].tolist(), batch["group_index"].tolist()
    if name == "reinforce_pp":
        est = build(name, kl_ctl=beta, kl_estimator=estimator, group_baseline=flag, gamma=gamma)
        want = reference.reinforce_pp_advantages(
            rewards, groups, lengths, group_baseline=flag, gamma=gamma, eps=1e-5, token_kl=token_kl, kl_coef=beta
        )
    else:
        est = build(name, kl_ctl=beta, kl_estimator=estimator, norm_std=flag)
        scores = reference.group_advantages(
            rewards, groups, norm_std=flag, eps=1e-6, leave_one_out=name == "rloo", token_kl=token_kl, kl_coef=beta
        )
        want = [[s] * n for s, n in zip(scores, lengths)]
    got = est(batch)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(got[i, :n], torch.tensor(want[i]), rtol=1e-4, atol=1e-4)
        assert (got[i, n:] == 0).all()
    observed = sum(map(sum, token_kl)) / len(lengths)
    assert est.metrics()["kl_coef"] == beta
    assert est.metrics()["kl_in_reward"] == pytest.approx(observed, rel=1e-4, abs=1e-5)


def test_adaptive_coefficient_follows_the_controller_and_resumes_bitwise() -> None:
    options = {"kl_ctl": 0.2, "kl_target": 0.5, "kl_horizon": 40}
    batches = [_seeded(s) for s in range(4)]
    whole = build("reinforce_pp", **options)
    coefs, advantages = [], []
    for batch in batches:
        coefs.append(whole.kl.coef)
        advantages.append(whole(batch))
        # observed KL: mean over sequences of the summed per-token k1 estimate
        kl = ((batch["old_logprobs"] - batch["ref_logprobs"]) * batch["response_mask"]).sum(1).mean()
        error = min(max(float(kl) / 0.5 - 1, -0.2), 0.2)
        assert whole.kl.coef == pytest.approx(coefs[-1] * (1 + error * batch.batch_size / 40))
        assert whole.metrics()["kl_coef"] == coefs[-1]
    assert len(set(coefs)) == 4  # it moved every step
    # stop after two steps, resume from the saved state: the same coefficients and advantages, bitwise
    first = build("reinforce_pp", **options)
    for batch in batches[:2]:
        first(batch)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = build("reinforce_pp", **options)
    resumed.load_state_dict(state)
    for batch, coef, adv in zip(batches[2:], coefs[2:], advantages[2:]):
        assert resumed.kl.coef == coef
        assert torch.equal(resumed(batch), adv)
    assert resumed.state_dict() == whole.state_dict()
    # the group estimators carry the same state
    grpo = build("grpo", **options)
    grpo(batches[0])
    assert grpo.state_dict() == {"kl_coef": pytest.approx(coefs[1])} and grpo.kl.coef != 0.2


def _seeded(seed: int) -> TensorBatch:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(5)[None, :] < torch.randint(1, 6, (6, 1), generator=g)).float()
    return TensorBatch(
        {
            "rewards": torch.rand(6, generator=g),
            "group_index": torch.arange(6) // 2,
            "response_mask": mask,
            "old_logprobs": -torch.rand(6, 5, generator=g) * mask,
            "ref_logprobs": -torch.rand(6, 5, generator=g) * 2 * mask,
        }
    )


def test_config_mistakes_are_one_line_each() -> None:
    from core_rl.config import load_config
    from core_rl.testing import recipe_host

    host = recipe_host((grpo_plugin, "core-rl-grpo"))

    def load(*overrides: str):
        return load_config(None, ["actor.model_path=/m", *overrides], host=host, require_complete=False)

    for algorithm in ("grpo", "rloo", "reinforce_pp", "dr_grpo"):
        with pytest.raises(ConfigError, match=r"algorithm\.advantage\.kl_target: needs kl_ctl > 0"):
            load(f"algorithm.name={algorithm}", "algorithm.advantage.kl_target=0.1")
        cfg = load(f"algorithm.name={algorithm}", "algorithm.advantage.kl_ctl=0.05")
        assert cfg.algorithm.advantage.config.kl_ctl == 0.05
    with pytest.raises(ConfigError, match=r"algorithm\.advantage\.kl_ctl: must be >= 0"):
        load("algorithm.name=grpo", "algorithm.advantage.kl_ctl=-0.1")
    with pytest.raises(ConfigError, match=r"algorithm\.advantage\.kl_estimator"):
        load("algorithm.name=rloo", "algorithm.advantage.kl_ctl=0.1", "algorithm.advantage.kl_estimator=abs")


def test_a_real_run_of_reinforce_pp_with_the_kl_in_its_reward(tmp_path: Path) -> None:
    """``core-rl train`` (fsdp + hf, 2 steps) with a reference model unlike the actor (another seed,
    the ``ref:`` section): the estimator runs in the update on the reference log-probs, the reward's
    KL and its coefficient are logged each step, and the coefficient adapts."""
    for dist in ("core_rl_fsdp", "core_rl_hf", "core_rl_reward_match"):
        pytest.importorskip(dist)
    from core_rl.builtin.loggers import read_metrics
    from core_rl.testing.launch import run_train, write_grpo_config
    from core_rl.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", alphabet="ab=", hidden_size=16, num_heads=2, seed=0)
    ref = build_tiny_model(tmp_path / "ref", alphabet="ab=", hidden_size=16, num_heads=2, seed=1)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s}) + "\n" for s in ("ab", "ba")))
    advantage = {"name": "reinforce_pp", "kl_ctl": 0.1, "kl_target": 0.01, "kl_horizon": 10}
    config = write_grpo_config(
        tmp_path,
        model,
        [str(data)],
        algorithm={"name": "reinforce_pp", "advantage": advantage},
        trainer={"total_steps": 2},
        saver={"export_hf": False},
        loggers=[{"name": "jsonl"}],
        ref={"model_path": str(ref), "engine": {"name": "fsdp"}},
    )
    run_train(config, cpu=True)
    rows = read_metrics(next((tmp_path / "runs").rglob("metrics.jsonl")))
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # the reference differs from the policy: a positive summed KL (k1) per response
        assert math.isfinite(row["advantage/kl_in_reward"]) and row["advantage/kl_in_reward"] != 0
        assert row["actor/grad_norm"] > 0  # the KL alone gives the tokens different advantages
    first, second = rows[0]["advantage/kl_coef"], rows[1]["advantage/kl_coef"]
    error = min(max(rows[0]["advantage/kl_in_reward"] / 0.01 - 1, -0.2), 0.2)  # 2 prompts x 2 samples
    assert first == pytest.approx(0.1) and second == pytest.approx(0.1 * (1 + error * 4 / 10))


@pytest.mark.parametrize("kl_ctl", [0.0, 0.1])
def test_a_kl_in_the_reward_is_measured_on_recomputed_log_probs(kl_ctl: float) -> None:
    """The update recomputes ``old_logprobs`` with the trainer's forward when the reward carries the
    KL (the rollout engine's log-probs would add its numerical gap to KL(pi_old || pi_ref)), and not
    for that reason otherwise."""
    from core_rl.config.schema import AlgorithmConfig
    from core_rl.loops.rl.update import PolicyUpdate

    loss = type("Loss", (), {"requires_recompute": False})()
    update = PolicyUpdate(
        engine=None,
        ref=None,
        loss=loss,
        algorithm=AlgorithmConfig(),
        temperature=1.0,
        shard=lambda b: b,
        world_size=1,
        advantage=build("grpo", kl_ctl=kl_ctl),
    )
    assert update.recompute is (kl_ctl > 0)
