"""The verifier workers print nothing: math-verify's notices that its own timeouts are off are not
printed (the pool's per-item time limit is the timeout)."""

from __future__ import annotations

from core_rl.testing import make_reward_input
from core_rl_reward_math.config import MathConfig
from core_rl_reward_math.reward import MathReward


def test_scoring_prints_nothing(capfd):
    reward = MathReward(MathConfig(num_workers=1, timeout_s=60))
    try:
        items = [make_reward_input(r, {"answer": "122"}) for r in ("The answer is $\\boxed{122}$", "It is 121.")]
        scored = reward.score_with_parts(items)
    finally:
        reward.close()
    assert scored.scores == [1.0, 0.0] and scored.parts["timeout"] == [0.0, 0.0]
    out, err = capfd.readouterr()  # the spawned workers write to the same file descriptors
    assert "Timeout is disabled" not in out + err
    assert (out, err) == ("", "")
