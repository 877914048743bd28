"""The core conformance kit run against ``math``, with hand-checked scores."""

from __future__ import annotations

from typing import Any, ClassVar

import core_rl_reward_math.plugin
from core_rl.protocol import RewardInput
from core_rl.testing import RewardContract, make_reward_input


class TestMathContract(RewardContract):
    plugin = core_rl_reward_math.plugin
    name = "math"
    distribution = "core-rl-reward-math"
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("so \\boxed{\\frac{1}{2}}", {"answer": "0.5"}), 1.0),
        (make_reward_input("The answer is 7.", {"answer": 7}), 1.0),  # non-string answers: str(value)
        (make_reward_input("3 + 4 = 8", {"answer": "7"}), 0.0),
        (make_reward_input("no idea", {"answer": "7"}), 0.0),
    ]


class TestMathBoxedOnlyContract(RewardContract):
    plugin = core_rl_reward_math.plugin
    name = "math"
    distribution = "core-rl-reward-math"
    options: ClassVar[dict[str, Any]] = {"extract": ["boxed"], "answer_key": "solution", "timeout_s": 10}
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("\\boxed{2}", {"solution": "2"}), 1.0),
        (make_reward_input("The answer is 2", {"solution": "2"}), 0.0),  # only boxed answers count
    ]
