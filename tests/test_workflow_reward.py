"""The built-in ``workflow`` reward (the reward a rollout workflow assigns to its samples): scores
are what the workflow set, a sample without one is an error naming the contract (or scores
``default``), selecting it with a workflow that assigns none is a config error, and it combines
with other rewards through ``combine``. The built-in ``single_turn`` workflow passes the workflow
contract. A real run of a workflow that assigns rewards is in the out-of-tree example plugin's
tests (``examples/third_party_plugin/tests/test_second_try_workflow.py``)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import yaml
from core_rl.builtin import rewards as builtin_rewards
from core_rl.builtin import workflows as builtin_workflows
from core_rl.config.loader import load_config
from core_rl.errors import ConfigError
from core_rl.testing import RewardContract, WorkflowContract, make_reward_input


class TestWorkflowRewardContract(RewardContract):
    plugin = builtin_rewards
    name = "workflow"
    distribution = "core-rl"
    examples: ClassVar[list[Any]] = [
        (make_reward_input("ab", workflow_reward=0.25), 0.25),
        (make_reward_input("", workflow_reward=-1.5), -1.5),
        (make_reward_input("cd", workflow_reward=1.0, info={"turns": 2}), 1.0),
    ]


class TestWorkflowRewardWithDefault(RewardContract):
    plugin = builtin_rewards
    name = "workflow"
    options: ClassVar[dict[str, Any]] = {"default": 0.5}
    examples: ClassVar[list[Any]] = [
        (make_reward_input("ab", workflow_reward=0.0), 0.0),
        (make_reward_input("ab"), 0.5),
    ]


class TestSingleTurnWorkflowContract(WorkflowContract):
    plugin = builtin_workflows
    name = "single_turn"
    distribution = "core-rl"


def test_a_sample_without_a_workflow_reward_is_an_error_naming_the_contract() -> None:
    reward = builtin_rewards.WorkflowReward(builtin_rewards.WorkflowRewardConfig())
    items = [make_reward_input("ok", workflow_reward=1.0), make_reward_input("none", prompt="p=")]
    with pytest.raises(ValueError, match=r"assigned no reward to 1 of 2 samples.*'none'.*Sample\.reward"):
        reward.score(items)


def _write(tmp_path, cfg: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_selecting_it_with_a_workflow_that_assigns_no_reward_is_a_config_error(host, minimal_config, tmp_path):
    host.register_plugin(builtin_rewards, distribution="core-rl")
    host.register_plugin(builtin_workflows, distribution="core-rl")
    cfg = {**minimal_config, "reward": {"name": "workflow"}}
    with pytest.raises(
        ConfigError, match=r"reward: reward 'workflow' reads the reward .* 'single_turn'.*reward\.default"
    ):
        load_config(_write(tmp_path, cfg), host=host)
    # inside combine the message names the part's key path
    cfg["reward"] = {
        "name": "combine",
        "parts": [{"reward": {"name": "constant", "value": 1.0}}, {"reward": "workflow"}],
    }
    with pytest.raises(ConfigError, match=r"reward\.parts\[1\]\.reward: reward 'workflow'"):
        load_config(_write(tmp_path, cfg), host=host)
    # a default makes it valid with any workflow
    cfg["reward"] = {"name": "workflow", "default": 0.0}
    assert load_config(_write(tmp_path, cfg), host=host).reward.config.default == 0.0


def test_it_combines_with_other_rewards(host, minimal_config, tmp_path) -> None:
    host.register_plugin(builtin_rewards, distribution="core-rl")
    cfg = {
        **minimal_config,
        "rollout": {**minimal_config["rollout"], "workflow": {"name": "wf"}},
        "reward": {
            "name": "combine",
            "parts": [
                {"reward": {"name": "constant", "value": 1.0}, "weight": 0.5},
                {"reward": "workflow", "weight": 2},
            ],
        },
    }
    from core_rl.hookspecs import hookimpl

    class Plugin:
        @hookimpl
        def core_rl_register_workflows(self, register) -> None:
            register("wf", lambda config: builtin_workflows.SingleTurnWorkflow(), description="test")

    host.register_plugin(Plugin(), distribution="test-wf")
    reward = load_config(_write(tmp_path, cfg), host=host).reward.build()
    result = reward.score_with_parts(
        [make_reward_input("a", workflow_reward=0.25), make_reward_input("b", workflow_reward=1.0)]
    )
    assert result.scores == [0.5 + 0.5, 0.5 + 2.0]
    assert result.parts["workflow"] == [0.25, 1.0]
