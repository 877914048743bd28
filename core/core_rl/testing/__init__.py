"""The conformance kit: base test classes a plugin's tests subclass, and tiny offline models.

Subclass the contract of your component's kind in your plugin's tests, set the class attributes it
documents, and pytest runs the contract's tests against your component::

    from core_rl.testing import RewardContract

    class TestMyReward(RewardContract):
        plugin = my_package.plugin       # the module with the hook implementations
        name = "my_reward"
        distribution = "my-dist"         # optional: also checks the entry point is declared
        examples = [(reward_input(...), 1.0), ...]

The tiny offline models (:mod:`core_rl.testing.tiny`, :mod:`core_rl.testing.tiny_vlm`) import without
pytest: the contracts load when first named.
"""

from core_rl.plugins.lazy_exports import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.testing.contracts": (
            "AdvantageEstimatorContract",
            "AlgorithmContract",
            "ComponentContract",
            "LoggerContract",
            "LoopContract",
            "PolicyLossContract",
            "RejectionSamplerContract",
            "RewardContract",
            "SampleFilterContract",
            "WorkflowContract",
            "installed_distribution",
            "make_grouped_rl_batch",
            "make_reward_input",
            "make_rl_batch",
            "recipe_host",
        ),
        "core_rl.testing.data_source_contracts": ("DataSourceContract",),
        "core_rl.testing.engine_contracts": ("TrainEngineContract",),
        "core_rl.testing.environment_contracts": (
            "EnvironmentContract",
            "ToolParserContract",
        ),
        "core_rl.testing.launcher_contract": ("LauncherContract",),
        "core_rl.testing.model_source_contracts": ("ModelSourceContract",),
        "core_rl.testing.rollout_contracts": ("RolloutEngineContract",),
        "core_rl.testing.server_contract": ("ServerRolloutEngineContract",),
    },
)
