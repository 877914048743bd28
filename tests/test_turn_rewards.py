"""Per-turn rewards (``turn_reward: per_turn``): each turn's reward is paid at that turn's last token.
A batch places them (``turn_rewards``); per-token rewards keep each row's sum equal to its score;
GAE and REINFORCE++ credit a turn with the rewards from that turn on (hand computations); outcome
estimators are unchanged; the ``environment`` workflow records where each turn ends on a real tiny
model through the rollout controller."""

from __future__ import annotations

import pytest
import torch
from core_rl import ops
from core_rl.protocol import Sample, samples_to_batch
from core_rl.testing.multi_turn import Echo, PromptRow, environment_workflow, roll_out
from core_rl.testing.tiny import build_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

grpo_adv = pytest.importorskip("core_rl_grpo.advantages")
grpo_config = pytest.importorskip("core_rl_grpo.config")

PAD = 0


def two_turns(rewards: tuple[float, float] = (0.5, 1.0)) -> Sample:
    """prompt [1, 2]; response: model [3, 4], observation [5], model [6, 7]; turns end at 2 and 5."""
    return Sample(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5, 6, 7],
        logprobs=[-0.1, -0.2, 0.0, -0.3, -0.4],
        weight_version=0,
        finish_reason="stop",
        token_mask=[1, 1, 0, 1, 1],
        reward=sum(rewards),
        turn_rewards=list(rewards),
        turn_ends=[2, 5],
    )


def test_a_batch_places_each_turns_reward_at_its_last_token() -> None:
    plain = Sample(prompt_ids=[1], response_ids=[3, 4], logprobs=[-0.1, -0.2], weight_version=0, finish_reason="stop")
    batch = samples_to_batch([two_turns(), plain], [0, 1], PAD)
    assert batch["turn_rewards"].tolist() == [[0, 0, 0, 0.5, 0, 0, 1.0], [0] * 7]
    assert "turn_rewards" not in samples_to_batch([plain], [0], PAD)
    empty_turn = Sample(
        prompt_ids=[1], response_ids=[3], logprobs=[-0.1], weight_version=0, finish_reason="stop",
        turn_rewards=[0.25, 0.5], turn_ends=[1, 1],
    )  # fmt: skip
    assert samples_to_batch([empty_turn], [0], PAD)["turn_rewards"].tolist() == [[0, 0.75]]


@pytest.mark.parametrize(
    ("ends", "rewards", "match"),
    [
        ([2, 5], None, "2 turn_ends but no turn_rewards"),
        ([2], [0.5, 1.0], "1 turn_ends but 2 turn_rewards"),
        ([5, 2], [0.5, 1.0], r"must not decrease, within \[1, 5\]"),
        ([0, 5], [0.5, 1.0], r"must not decrease"),
        ([2, 6], [0.5, 1.0], r"must not decrease, within \[1, 5\]"),
    ],
)
def test_turn_ends_are_checked(ends, rewards, match) -> None:
    with pytest.raises(ValueError, match=match):
        Sample([1], [3, 4, 5, 6, 7], [0.0] * 5, 0, "stop", turn_rewards=rewards, turn_ends=ends)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=4),
    st.lists(st.floats(-2, 2), min_size=4, max_size=4),
    st.floats(-3, 3),
)
def test_per_token_rewards_add_up_to_the_score(lengths, rewards, extra) -> None:
    """Whatever the turns, a row's per-token rewards sum to its score; when the score is the sum of
    the turn rewards, each is paid exactly at its turn's last token and nothing else is paid."""
    ends = torch.tensor(lengths).cumsum(0).tolist()
    turn_rewards = rewards[: len(ends)]
    width = ends[-1] + 2
    mask = torch.zeros(1, width)
    mask[0, 1 : 1 + ends[-1]] = 1
    placed = torch.zeros(1, width)
    for end, r in zip(ends, turn_rewards, strict=True):
        placed[0, end] += r
    exact = torch.tensor([sum(turn_rewards)], dtype=torch.float32)
    per_token = ops.token_level_rewards(exact, mask, turn_rewards=placed)
    torch.testing.assert_close(per_token, placed, atol=1e-5, rtol=0)
    shaped = ops.token_level_rewards(exact + extra, mask, turn_rewards=placed)
    torch.testing.assert_close(shaped.sum(dim=1), exact + extra, atol=1e-5, rtol=0)
    torch.testing.assert_close(shaped - placed, extra * ops.last_token_mask(mask), atol=1e-5, rtol=0)


def test_gae_credits_a_turn_with_the_rewards_from_it_on_by_hand() -> None:
    """Trained tokens at 2, 3 (turn 1) and 5, 6 (turn 2); 4 is the observation; rewards 0.5 at 3
    and 1.0 at 6; values 0. Discount 0.5, lambda 1: A_6 = 1, A_5 = 0.5, A_3 = 0.5 + 0.5 * 0.5 = 0.75,
    A_2 = 0.375 (GAE steps over the observation). Paid as an outcome, every token would see the
    sum 1.5, discounted."""
    batch = samples_to_batch([two_turns()], [0], PAD)
    mask = batch["response_mask"]
    zeros = torch.zeros_like(mask)
    per_turn = ops.token_level_rewards(torch.tensor([1.5]), mask, turn_rewards=batch["turn_rewards"])
    advantages, returns = ops.gae_advantages(per_turn, zeros, mask, discount=0.5, gae_lambda=1.0)
    assert advantages[0].tolist() == [0, 0, 0.375, 0.75, 0, 0.5, 1.0]
    torch.testing.assert_close(returns, advantages)
    outcome = ops.token_level_rewards(torch.tensor([1.5]), mask)
    advantages, _ = ops.gae_advantages(outcome, zeros, mask, discount=1.0, gae_lambda=1.0)
    assert advantages[0].tolist() == [0, 0, 1.5, 1.5, 0, 1.5, 1.5]


def test_the_gae_estimator_reads_the_turn_rewards() -> None:
    gae = pytest.importorskip("core_rl_ppo.gae")
    from core_rl_ppo.config import GAEConfig

    batch = samples_to_batch([two_turns()], [0], PAD)
    batch["rewards"] = torch.tensor([1.5])
    batch["values"] = torch.zeros_like(batch["response_mask"])
    advantages = gae.GAEAdvantage(GAEConfig(discount=1.0, gae_lambda=1.0))(batch)
    assert advantages[0].tolist() == [0, 0, 1.5, 1.5, 0, 1.0, 1.0]
    assert batch["returns"][0].tolist() == advantages[0].tolist()


def test_reinforce_pp_whitens_the_per_turn_returns_by_hand() -> None:
    """Returns 1.5, 1.5 (turn 1) and 1.0, 1.0 (turn 2): mean 1.25, unbiased std sqrt(0.25 / 3)."""
    batch = samples_to_batch([two_turns()], [0], PAD)
    batch["rewards"] = torch.tensor([1.5])
    advantages = grpo_adv.ReinforcePPAdvantage(grpo_config.ReinforcePPAdvantageConfig(eps=1e-9))(batch)
    std = (0.25 / 3) ** 0.5
    expected = [0, 0, 0.25 / std, 0.25 / std, 0, -0.25 / std, -0.25 / std]
    torch.testing.assert_close(advantages[0], torch.tensor(expected), atol=1e-5, rtol=0)


def test_outcome_estimators_see_only_the_trajectory_reward() -> None:
    """GRPO's advantages do not change when the batch carries per-turn rewards."""
    samples = [two_turns((0.5, 1.0)), two_turns((0.0, 0.0))]
    batch = samples_to_batch(samples, [0, 0], PAD)
    batch["rewards"] = torch.tensor([1.5, 0.0])
    with_turns = grpo_adv.GroupRelativeAdvantage()(batch)
    del batch.data["turn_rewards"]
    torch.testing.assert_close(with_turns, grpo_adv.GroupRelativeAdvantage()(batch))


@pytest.fixture(scope="module")
def engine_and_tokenizer(tmp_path_factory):
    hf = pytest.importorskip("core_rl_hf.engine")
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path_factory.mktemp("turn_rewards") / "model", alphabet="abcdef=:?", seed=0)
    engine = hf.HFRolloutEngine(model, hf.HFRolloutConfig(device="cpu", seed=0))
    yield engine, AutoTokenizer.from_pretrained(model)
    engine.close()


def test_the_environment_workflow_records_where_each_turn_ends(engine_and_tokenizer) -> None:
    """``per_turn``: the reward is the sum and each turn's end is the end of its sampled tokens, so a
    batch pays turn ``k``'s reward (``k + 1`` from the echo environment) on its last sampled token."""
    engine, tokenizer = engine_and_tokenizer
    Echo.clear()
    workflow = environment_workflow(environment={"name": "echo", "turns": 3}, max_turns=5, turn_reward="per_turn")
    rows = [PromptRow(t, tokenizer) for t in ("abc=", "fed=")]
    wave, _ = roll_out(engine, tokenizer, workflow, rows, n=2, max_new_tokens=3)
    samples = [s for group in wave.groups for s in group]
    batch = samples_to_batch(samples, [0] * len(samples), tokenizer.pad_token_id)
    for i, sample in enumerate(samples):
        assert sample.turn_rewards == [1.0, 2.0, 3.0] and sample.reward == 6.0
        assert sample.turn_ends is not None and sample.turn_ends[-1] == len(sample.response_ids)
        mask = sample.token_mask
        for k, end in enumerate(sample.turn_ends):
            assert mask[end - 1] == 1 and (end == len(mask) or mask[end] == 0), f"turn {k} does not end at {end}"
        p = len(sample.prompt_ids)
        placed = {p + end - 1: float(k + 1) for k, end in enumerate(sample.turn_ends)}
        row = batch["turn_rewards"][i].tolist()
        assert {t: v for t, v in enumerate(row) if v} == placed
    Echo.clear()
    summed = environment_workflow(environment={"name": "echo", "turns": 3}, max_turns=5)
    wave, _ = roll_out(engine, tokenizer, summed, rows, n=1, max_new_tokens=3)
    assert all(s.turn_ends is None and s.reward == 6.0 for g in wave.groups for s in g)
    # turn_discount 0.5: turn k's reward counts 0.5 ** k (1 + 2 / 2 + 3 / 4), the steps keep the raw ones
    Echo.clear()
    discounted = environment_workflow(environment={"name": "echo", "turns": 3}, max_turns=5, turn_discount=0.5)
    wave, _ = roll_out(engine, tokenizer, discounted, rows, n=1, max_new_tokens=3)
    for sample in (s for g in wave.groups for s in g):
        assert sample.turn_rewards == [1.0, 1.0, 0.75] and sample.reward == 2.75
        assert [step["reward"] for step in sample.info["steps"]] == [1.0, 2.0, 3.0]
