"""The kinds of plugin core-rl knows: each has a registry, a registration hook and an entry-point group."""

from __future__ import annotations

import attrs


@attrs.frozen
class PluginKind:
    """One kind of plugin.

    ``key`` is the identifier used in code, ``label`` the words used in messages, ``group`` the
    entry-point group whose entry-point names are the names used in YAML, ``hook`` the
    registration hook a plugin implements to add entries of this kind, and ``interface`` the class
    every component of the kind is, or provides every member of (checked when the component is
    built: :mod:`core_rl.plugins.components`): a class of :mod:`core_rl.interfaces` by name, or
    ``module:Class``.
    """

    key: str
    label: str
    group: str
    hook: str
    interface: str


TRAIN_ENGINE = PluginKind(
    "train_engine", "train engine", "core_rl.train_engines", "core_rl_register_train_engines", "TrainEngine"
)
ROLLOUT_ENGINE = PluginKind(
    "rollout_engine",
    "rollout engine",
    "core_rl.rollout_engines",
    "core_rl_register_rollout_engines",
    "RolloutEngine",
)
POLICY_LOSS = PluginKind(
    "policy_loss", "policy loss", "core_rl.policy_losses", "core_rl_register_policy_losses", "PolicyLoss"
)
ADVANTAGE = PluginKind(
    "advantage",
    "advantage estimator",
    "core_rl.advantage_estimators",
    "core_rl_register_advantage_estimators",
    "AdvantageEstimator",
)
SAMPLE_FILTER = PluginKind(
    "sample_filter", "sample filter", "core_rl.sample_filters", "core_rl_register_sample_filters", "SampleFilter"
)
REJECTION_SAMPLER = PluginKind(
    "rejection_sampler",
    "rejection sampler",
    "core_rl.rejection_samplers",
    "core_rl_register_rejection_samplers",
    "RejectionSampler",
)
REWARD = PluginKind("reward", "reward", "core_rl.rewards", "core_rl_register_rewards", "Reward")
LOGGER = PluginKind("logger", "logger", "core_rl.loggers", "core_rl_register_loggers", "Logger")
ALGORITHM = PluginKind("algorithm", "algorithm", "core_rl.algorithms", "core_rl_register_algorithms", "AlgorithmRecipe")
WORKFLOW = PluginKind(
    "workflow",
    "rollout workflow",
    "core_rl.workflows",
    "core_rl_register_workflows",
    "core_rl.rollout.workflows:RolloutWorkflow",
)
SERVER_ENV = PluginKind(
    "server_env",
    "server environment",
    "core_rl.server_envs",
    "core_rl_register_server_envs",
    "core_rl.interfaces.servers:ServerEnvSpec",
)
ENVIRONMENT = PluginKind(
    "environment",
    "environment",
    "core_rl.environments",
    "core_rl_register_environments",
    "core_rl.rollout.environments:Environment",
)
TOOL_PARSER = PluginKind(
    "tool_parser",
    "tool-call parser",
    "core_rl.tool_parsers",
    "core_rl_register_tool_parsers",
    "core_rl.rollout.tool_parsers:ToolParser",
)
DATA_SOURCE = PluginKind(
    "data_source",
    "data source",
    "core_rl.data_sources",
    "core_rl_register_data_sources",
    "core_rl.data.sources:DataSource",
)
MODEL_SOURCE = PluginKind(
    "model_source", "model source", "core_rl.model_sources", "core_rl_register_model_sources", "ModelSource"
)
LOOP = PluginKind("loop", "training loop", "core_rl.loops", "core_rl_register_loops", "TrainingLoop")
LAUNCHER = PluginKind(
    "launcher", "launcher", "core_rl.launchers", "core_rl_register_launchers", "core_rl.launch.launchers:Launcher"
)

#: the entry-point group of modules that only add ``core-rl`` subcommands (their
#: :func:`core_rl.hookspecs.core_rl_add_commands`), e.g. the server kit's ``core-rl server-env``: no
#: registry, nothing selected by name in a configuration; loaded when ``core-rl`` builds its command line
COMMANDS_GROUP = "core_rl.commands"

ALL_KINDS: tuple[PluginKind, ...] = (
    TRAIN_ENGINE,
    ROLLOUT_ENGINE,
    POLICY_LOSS,
    ADVANTAGE,
    SAMPLE_FILTER,
    REWARD,
    LOGGER,
    ALGORITHM,
    REJECTION_SAMPLER,
    SERVER_ENV,
    LOOP,
    WORKFLOW,
    ENVIRONMENT,
    TOOL_PARSER,
    LAUNCHER,
    DATA_SOURCE,
    MODEL_SOURCE,
)
KINDS_BY_KEY: dict[str, PluginKind] = {k.key: k for k in ALL_KINDS}

# Which core-rl extra provides a name that ships in this repository, for the install hint of an
# unknown-name error. Names from third-party distributions are not listed: the hint then says so.
# tests/test_known_extras.py holds it to the plugins' pyproject.toml files: every entry point, no other.
KNOWN_EXTRAS: dict[tuple[str, str], str] = {
    ("train_engine", "fsdp"): "fsdp",
    ("train_engine", "deepspeed"): "deepspeed",
    ("train_engine", "megatron"): "megatron",
    ("rollout_engine", "hf"): "hf",
    ("rollout_engine", "vllm"): "vllm",
    ("rollout_engine", "sglang"): "sglang",
    ("server_env", "vllm"): "vllm",
    ("server_env", "sglang"): "sglang",
    ("algorithm", "grpo"): "grpo",
    ("advantage", "grpo"): "grpo",
    ("advantage", "rloo"): "grpo",
    ("policy_loss", "ppo_clip"): "grpo",
    ("sample_filter", "drop_uniform_groups"): "grpo",
    ("algorithm", "dr_grpo"): "grpo",
    ("algorithm", "rloo"): "grpo",
    ("algorithm", "reinforce_pp"): "grpo",
    ("algorithm", "online_dpo"): "grpo",
    ("advantage", "online_dpo"): "grpo",
    ("advantage", "reinforce_pp"): "grpo",
    ("algorithm", "gspo"): "gspo",
    ("algorithm", "dapo"): "dapo",
    ("reward", "exact_match"): "reward-match",
    ("reward", "char_match"): "reward-match",
    ("reward", "math"): "reward-math",
    ("reward", "format"): "reward-format",
    ("reward", "code"): "reward-code",
    ("reward", "remote"): "reward-remote",
    ("reward", "judge"): "reward-remote",
    ("reward", "reward_model"): "reward-model",
    ("logger", "swanlab"): "swanlab",
    ("logger", "wandb"): "wandb",
    ("logger", "tensorboard"): "tensorboard",
    ("logger", "trackio"): "trackio",
    ("logger", "mlflow"): "mlflow",
    ("algorithm", "ppo"): "ppo",
    ("algorithm", "distill"): "ppo",
    ("advantage", "gae"): "ppo",
    ("algorithm", "dpo"): "dpo",
    ("algorithm", "ipo"): "dpo",
    ("algorithm", "simpo"): "dpo",
    ("algorithm", "orpo"): "dpo",
    ("loop", "dpo"): "dpo",
    ("algorithm", "kto"): "dpo",
    ("loop", "kto"): "dpo",
    ("algorithm", "sft"): "sft",
    ("loop", "sft"): "sft",
    ("algorithm", "rm"): "rm",
    ("loop", "rm"): "rm",
    ("environment", "calculator"): "env-tools",
    ("environment", "python"): "env-tools",
    ("environment", "reward"): "env-tools",
    ("launcher", "slurm"): "slurm",
    ("launcher", "ray"): "ray",
    ("workflow", "openai_agent"): "openai-proxy",
    ("data_source", "reasoning_gym"): "reasoning-gym",
    ("reward", "reasoning_gym"): "reasoning-gym",
    ("environment", "verifiers"): "verifiers",
    ("data_source", "verifiers"): "verifiers",
    ("environment", "openenv"): "openenv",
    ("model_source", "gguf"): "gguf",
}
