"""The conformance kit: base test classes a plugin's tests subclass, and tiny offline models.

Subclass the contract of your component's kind in your plugin's tests, set the class attributes it
documents, and pytest runs the contract's tests against your component::

    from core_rl.testing import RewardContract

    class TestMyReward(RewardContract):
        plugin = my_package.plugin       # the module with the hook implementations
        name = "my_reward"
        distribution = "my-dist"         # optional: also checks the entry point is declared
        examples = [(reward_input(...), 1.0), ...]
"""

from core_rl.testing.contracts import (
    AdvantageEstimatorContract,
    AlgorithmContract,
    ComponentContract,
    LoggerContract,
    LoopContract,
    PolicyLossContract,
    RejectionSamplerContract,
    RewardContract,
    SampleFilterContract,
    WorkflowContract,
    installed_distribution,
    make_grouped_rl_batch,
    make_reward_input,
    make_rl_batch,
    recipe_host,
)
from core_rl.testing.data_source_contracts import DataSourceContract
from core_rl.testing.engine_contracts import TrainEngineContract
from core_rl.testing.environment_contracts import EnvironmentContract, ToolParserContract
from core_rl.testing.launcher_contract import LauncherContract
from core_rl.testing.rollout_contracts import RolloutEngineContract
from core_rl.testing.server_contract import ServerRolloutEngineContract

__all__ = [
    "AdvantageEstimatorContract",
    "AlgorithmContract",
    "ComponentContract",
    "DataSourceContract",
    "EnvironmentContract",
    "LauncherContract",
    "LoggerContract",
    "LoopContract",
    "PolicyLossContract",
    "RejectionSamplerContract",
    "RewardContract",
    "RolloutEngineContract",
    "SampleFilterContract",
    "ServerRolloutEngineContract",
    "ToolParserContract",
    "TrainEngineContract",
    "WorkflowContract",
    "installed_distribution",
    "make_grouped_rl_batch",
    "make_reward_input",
    "make_rl_batch",
    "recipe_host",
]
