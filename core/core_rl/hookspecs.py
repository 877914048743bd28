"""Hook specifications: the whole plugin API of core-rl.

A plugin is a module or object whose functions are marked with :data:`hookimpl` and named after the
specs below. Every spec is a *registration* hook: it receives a typed ``register`` callback and
calls it once per component it provides. Hooks are called with keyword arguments only, when the
plugin is loaded (that is, when a configuration first selects one of its names, or when
``core-rl plugins`` lists everything). A plugin implements only the hooks it needs.

The API is versioned by :data:`HOOK_API_VERSION`; specs added later carry ``versionadded``, and
:data:`INTERFACE_ADDED` records which version added each interface member after the first (what the
core checks a component for when it is built names it: :mod:`core_rl.plugins.components`).

- 2: rollout-engine factories receive ``run_dir``; :func:`core_rl_register_server_envs` and
  :func:`core_rl_register_rejection_samplers` added; per-request generation, pausing and
  collective weight updates on rollout engines, value heads on train engines, stateful advantage
  estimators, and the policy loss's ``prepare``, ``requires_recompute`` and
  ``set_rejection_sampler``.
- 3: :func:`core_rl_register_loops` and :func:`core_rl_register_workflows` added;
  ``PolicyLoss.entropy_grad``.
- 4: weights in buckets, kept on the device: ``TrainEngine.hf_weight_buckets`` and
  ``RolloutEngine.update_weights_from_buckets`` (what ``weight_sync: memory`` calls).
- 5: :func:`core_rl_register_environments` and :func:`core_rl_register_tool_parsers` added;
  launchers (:func:`core_rl_register_launchers`, :class:`core_rl.launch.launchers.Launcher`) and the
  command-line hooks a plugin extends ``core-rl`` with (:func:`core_rl_add_commands`,
  :func:`core_rl_add_train_arguments`).
- 6: ``RolloutEngine.release_memory`` and ``RolloutEngine.restore_memory`` (a rollout engine asleep
  while the trainer trains, ``rollout.sleep_while_training``, which its factory receives resolved).
- 7: ``TrainEngine.save_state`` and ``load_state`` take ``optimizer=`` (``saver.save_optimizer``,
  ``recover.load_optimizer``), and ``TrainEngine.reset_optimizer``
  (``algorithm.reference_reset_optimizer``); ``PolicyLoss.observe_step``, ``state_dict`` and
  ``load_state_dict`` (a loss's state that follows training, e.g. an adaptive entropy coefficient).
- 8: ``TrainEngine.compute_topk_logprobs`` (``teacher.loss: topk_forward_kl``; with ``vocab_size``)
  and the ``logprobs_at_key`` a loss may set (:data:`core_rl.interfaces.LOGPROBS_AT`), and
  ``TrainEngine.export_adapter`` (``rollout.lora_sync: adapter``).
- 9: the verified weight sync (``rollout.sync_check``): ``RolloutEngine.weight_fingerprints``,
  ``fingerprint_dtypes`` and ``fingerprint_prefix`` (the base class's defaults skip the check with
  a note).
- 10: :func:`core_rl_register_data_sources` added: rows made in memory by a plugin
  (:class:`core_rl.data.sources.DataSource`), selected by ``source:<key>`` entries of
  ``data.train_files`` and ``eval.files``.
- 11: ``RolloutEngine.guided_decoding`` (requests with ``SamplingParams.response_format``: the
  proxy's structured output); the ``media`` keyword of ``RolloutEngine.generate`` and
  ``agenerate`` (a prompt's pixel inputs, passed only to engines whose config class claims
  ``multimodal = True``: vision-language models, :mod:`core_rl.vision`).
- 12: the ``media`` keyword of ``WorkflowContext.generate`` (the pixel inputs of the images a
  workflow's own prompt holds; default :data:`core_rl.rollout.workflows.ROW_MEDIA`, the row's);
  ``PolicyLoss.requires_recompute`` is read at every step (a loss may turn it on with a rejection
  sampler set mid-run).
- 13: an environment's observation (what ``Environment.reset`` returns, ``StepResult.observation``)
  may be content parts mixing text and images (:data:`core_rl.rollout.environments.Observation`).
- 14: :func:`core_rl_register_model_sources` added: where the files of a ``model_path`` /
  ``tokenizer_path`` come from (:class:`core_rl.interfaces.ModelSource`, e.g. a ``.gguf`` file
  converted once into a Hugging Face directory), asked about every such path of a configuration.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Protocol

import pluggy

PROJECT_NAME = "core_rl"
HOOK_API_VERSION = 14

#: The API version that added an interface (``"Class"``: all its members) or one member of it
#: (``"Class.member"``) after version 1; anything not listed is in version 1. Classes are those of
#: :mod:`core_rl.interfaces`, :class:`core_rl.rollout.workflows.RolloutWorkflow`,
#: :class:`core_rl.interfaces.servers.ServerEnvSpec` and :class:`core_rl.launch.launchers.Launcher` (each kind's
#: ``interface``: :mod:`core_rl.plugins.kinds`).
INTERFACE_ADDED: dict[str, int] = {
    "RejectionSampler": 2,
    "ServerEnvSpec": 2,
    "PolicyLoss.prepare": 2,
    "PolicyLoss.requires_recompute": 2,
    "PolicyLoss.set_rejection_sampler": 2,
    "AdvantageEstimator.requires_values": 2,
    "AdvantageEstimator.requires_reference": 2,
    "AdvantageEstimator.state_dict": 2,
    "AdvantageEstimator.load_state_dict": 2,
    "TrainEngine.compute_values": 2,
    "TrainEngine.train_value_step": 2,
    "RolloutEngine.agenerate": 2,
    "RolloutEngine.pause": 2,
    "RolloutEngine.resume": 2,
    "RolloutEngine.health": 2,
    "RolloutEngine.update_weights_collective": 2,
    "RolloutEngine.weight_sync_modes": 2,
    "PolicyLoss.entropy_grad": 3,
    "RolloutWorkflow": 3,
    "TrainingLoop": 3,
    "TrainEngine.hf_weight_buckets": 4,
    "RolloutEngine.update_weights_from_buckets": 4,
    "Environment": 5,
    "ToolParser": 5,
    "Launcher": 5,
    "RolloutEngine.release_memory": 6,
    "RolloutEngine.restore_memory": 6,
    "TrainEngine.reset_optimizer": 7,
    "PolicyLoss.observe_step": 7,
    "PolicyLoss.state_dict": 7,
    "PolicyLoss.load_state_dict": 7,
    "TrainEngine.compute_topk_logprobs": 8,
    "TrainEngine.export_adapter": 8,
    "RolloutEngine.weight_fingerprints": 9,
    "RolloutEngine.fingerprint_dtypes": 9,
    "RolloutEngine.fingerprint_prefix": 9,
    "DataSource": 10,
    "RolloutEngine.guided_decoding": 11,
    "ModelSource": 14,
}

#: Keyword arguments a member must take since the API version given (``"Class.member"`` ->
#: ``(keyword, version)``): a component written for an earlier version has the member but not
#: the keyword, which the core passes; checked when the component is built.
INTERFACE_KEYWORDS: dict[str, tuple[str, int]] = {
    "TrainEngine.save_state": ("optimizer", 7),
    "TrainEngine.load_state": ("optimizer", 7),
}


def interface_version(interface: str, member: str) -> int:
    """The API version that added ``member`` to ``interface`` (a class name), per :data:`INTERFACE_ADDED`."""
    return INTERFACE_ADDED.get(f"{interface}.{member}", INTERFACE_ADDED.get(interface, 1))


hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class Register(Protocol):
    """The callback every registration hook receives.

    ``register(name, factory, description=..., config_cls=..., override=False)`` adds ``name``
    (the name users write in YAML) to the registry of the hook's kind.

    - ``factory``: called by core-rl to build the component; its signature depends on the kind
      (see :mod:`core_rl.interfaces`).
    - ``description``: one line shown by ``core-rl plugins``.
    - ``config_cls``: an attrs class that validates the component's YAML section (every key of
      the section except ``name``); ``None`` means the section takes no options.
    - ``override``: replace an existing entry of the same name instead of raising
      :class:`core_rl.errors.PluginError`.
    """

    def __call__(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        description: str,
        config_cls: type | None = None,
        override: bool = False,
    ) -> None: ...


@hookspec
def core_rl_register_train_engines(register: Register) -> None:
    """Register train engines (the backend that holds the policy weights and runs optimisation).

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        engine. ``factory(actor, engine_config, *, trainable)`` receives the validated
        :class:`core_rl.config.schema.ActorConfig`, the engine's own validated section
        (``actor.engine``) and whether the model is trained (``False`` for a frozen reference
        model), and returns a :class:`core_rl.interfaces.TrainEngine`.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.
    """


@hookspec
def core_rl_register_rollout_engines(register: Register) -> None:
    """Register rollout (inference) engines, which generate responses with the current weights.

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        engine. ``factory(rollout, engine_config, *, model_path, run_dir)`` receives the validated
        :class:`core_rl.config.schema.RolloutConfig`, the engine's own section
        (``rollout.engine``), the path of the Hugging Face model to serve and the run directory
        (a :class:`pathlib.Path` where the engine may write, e.g. server logs), and returns a
        :class:`core_rl.interfaces.RolloutEngine`. A ``config_cls`` attribute
        ``weight_sync_modes`` (a tuple) lists the ``rollout.weight_sync`` values it supports
        (default ``("memory", "disk")``).
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.

    .. versionchanged:: 2 the factory receives ``run_dir``.
    """


@hookspec
def core_rl_register_policy_losses(register: Register) -> None:
    """Register policy losses (the per-token objective the train engine minimises).

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        loss. ``factory(config)`` receives the validated ``algorithm.loss`` section and returns a
        :class:`core_rl.interfaces.PolicyLoss`.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.
    """


@hookspec
def core_rl_register_advantage_estimators(register: Register) -> None:
    """Register advantage estimators (rewards -> per-token advantages).

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        estimator. ``factory(config)`` receives the validated ``algorithm.advantage`` section and
        returns a :class:`core_rl.interfaces.AdvantageEstimator`.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.
    """


@hookspec
def core_rl_register_sample_filters(register: Register) -> None:
    """Register sample filters (rejection sampling, dynamic sampling: which scored samples train).

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        filter. ``factory(config)`` receives one validated entry of ``algorithm.filters`` and
        returns a :class:`core_rl.interfaces.SampleFilter`, which keeps or drops whole prompt groups
        (see :mod:`core_rl.loops.rl.filtering`).
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.
    """


@hookspec
def core_rl_register_rewards(register: Register) -> None:
    """Register reward functions (score a generated response in context of its data row).

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        reward. ``factory(config)`` receives the validated ``reward`` section and returns a
        :class:`core_rl.interfaces.Reward`.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.
    """


@hookspec
def core_rl_register_loggers(register: Register) -> None:
    """Register metric loggers (console, files, experiment trackers).

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        logger. ``factory(config)`` receives one validated entry of ``loggers`` and returns a
        :class:`core_rl.interfaces.Logger`.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.
    """


@hookspec
def core_rl_register_algorithms(register: Register) -> None:
    """Register algorithms: named recipes binding a loss, an advantage estimator, filters and defaults.

    :param register: call ``register(name, factory, description=...)`` once per algorithm.
        ``factory()`` takes no arguments and returns a :class:`core_rl.interfaces.AlgorithmRecipe`
        whose ``defaults`` are merged *under* the user's configuration before it is validated.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded, before the configuration that selects it is validated.
    """


@hookspec
def core_rl_register_rejection_samplers(register: Register) -> None:
    """Register rejection samplers: per-token divergence checks between the proximal and the
    behaviour policy that mask tokens (or sequences) or clamp their importance weights, selected by
    ``algorithm.rejection_sampling`` and applied by the decoupled loss. The registered name is the
    divergence metric (core registers ``ratio``, ``kl_k1``, ``kl_k2``, ``kl_k3``, ``tis``, ``mis``);
    a new metric is a new name.

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        sampler. ``factory(config)`` receives the validated ``algorithm.rejection_sampling`` section
        and returns a :class:`core_rl.interfaces.RejectionSampler`
        (:class:`core_rl.ops.rejection.MetricRejectionSampler` does the level / action / aggregation /
        bounds logic for any per-token metric).
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.

    .. versionadded:: 2
    """


@hookspec
def core_rl_register_server_envs(register: Register) -> None:
    """Register server environments: the virtual environments inference servers run from.

    :param register: call ``register(name, factory, description=...)`` once per environment.
        ``factory()`` takes no arguments and returns a :class:`core_rl.interfaces.servers.ServerEnvSpec`
        (its pinned requirements per variant, ``cpu`` and ``cuda``, the install steps and any
        fix-ups after them). ``core-rl server-env create NAME`` builds it.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.

    .. versionadded:: 2
    """


@hookspec
def core_rl_register_loops(register: Register) -> None:
    """Register training loops: what one run does from start to end (the RL loop, supervised
    fine-tuning, preference optimisation, reward-model training, ...), selected by ``trainer.loop``
    (an algorithm recipe sets it by default; the default is the built-in ``rl`` loop).

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        loop. ``factory(cfg, host, *, stop, data_rows, config)`` receives the validated
        :class:`core_rl.config.schema.RunConfig`, the :class:`core_rl.plugins.host.PluginHost` (to build
        the engines and loggers the configuration selects), the run's
        :class:`core_rl.loops.signals.StopSignals`, the data rows preflight already read and
        checked (a list of :class:`core_rl.data.prompts.DataRow`, or ``None``) and the loop's own
        validated section (``trainer.loop``; ``None`` without a ``config_cls``), and returns a
        :class:`core_rl.interfaces.TrainingLoop`. A ``config_cls`` class attribute
        ``rl_sections = False`` says the loop does not use the RL sections (``reward``,
        ``algorithm.advantage``, ``algorithm.loss``), which are then not required; a ``roles``
        class attribute (a tuple of :data:`core_rl.roles.build.OPTIONAL_ROLES` names) lists the role
        sections it reads (default: all of them with the RL sections, none without), and a run
        that sets another one is refused rather than have it ignored.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.

    .. versionadded:: 3
    """


@hookspec
def core_rl_register_workflows(register: Register) -> None:
    """Register rollout workflows: how one data row becomes the trajectories of one group, by
    calling the rollout engine (one or several times per trajectory, e.g. turn by turn with tool
    output appended as masked tokens) through a :class:`core_rl.rollout.workflows.WorkflowContext`.
    Selected by ``rollout.workflow``; core registers ``single_turn``.

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        workflow. ``factory(config)`` receives the validated ``rollout.workflow`` section and
        returns a :class:`core_rl.rollout.workflows.RolloutWorkflow`.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.

    .. versionadded:: 3
    """


@hookspec
def core_rl_register_environments(register: Register) -> None:
    """Register environments: what a model acts in over several turns (tools, games, simulators),
    driven by the built-in ``environment`` rollout workflow (``rollout.workflow: {name: environment,
    environment: {name: ...}}``).

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        environment. ``factory(config)`` receives the environment's validated section and returns a
        new :class:`core_rl.rollout.environments.Environment`; it is called once per trajectory.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.

    .. versionadded:: 5
    """


@hookspec
def core_rl_register_launchers(register: Register) -> None:
    """Register launchers: how a run's processes start and where its roles are placed (this
    machine, a Slurm allocation, a Ray cluster, ...), selected by ``launcher`` (default ``local``,
    core's: the trainer's ranks on this machine, or on several with ``--nnodes``).

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        launcher. ``factory(config)`` receives the validated ``launcher`` section and returns a
        :class:`core_rl.launch.launchers.Launcher`. Its ``check`` is called by every ``core-rl config
        validate`` and before ``core-rl train`` launches; its ``launch`` starts the run, each trainer
        rank through :func:`core_rl.cli.run_rank`.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded (every launcher is loaded when ``core-rl`` builds its
    command line, for the hooks below: keep the module's imports light).

    .. versionadded:: 5
    """


@hookspec
def core_rl_register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers: how a model family writes tool calls in its text. Selected by a
    tool environment's ``parser`` section; core registers ``hermes``, ``llama3_json`` and ``tags``.

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        format. ``factory(config)`` returns a :class:`core_rl.rollout.tool_parsers.ToolParser`.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.

    .. versionadded:: 5
    """


@hookspec
def core_rl_register_data_sources(register: Register) -> None:
    """Register data sources: rows made in memory (procedural task generators, a Python callable,
    an environment library's task set), selected by an entry ``source:<key>`` of
    ``data.train_files`` or ``eval.files`` beside files and ``hf:`` datasets, weighted or not
    (``<key>``: a key of ``data.sources``, whose value is ``{name: <registered name>, ...options}``,
    or a registered name with its default options).

    :param register: call ``register(name, factory, description=..., config_cls=...)`` once per
        source. ``factory(config)`` receives the source's validated section and returns a
        :class:`core_rl.data.sources.DataSource`, whose ``rows()`` returns the same rows in the same
        order every time (a resumed run builds the source again and must draw the same rows).
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded.

    .. versionadded:: 10
    """


@hookspec
def core_rl_register_model_sources(register: Register) -> None:
    """Register model sources: where the files of a ``model_path`` or ``tokenizer_path`` come from
    when the path is not a local Hugging Face directory or a hub id (core-rl-gguf's ``gguf``: a
    ``.gguf`` file converted once into a cached directory). Nothing in a configuration selects a
    source: every installed one is asked about every model path of every configuration loaded, in
    the order of their registered names, and the first that claims a path replaces it with the
    local directory it returns.

    :param register: call ``register(name, factory, description=...)`` once per source (no
        ``config_cls``: a source has no section). ``factory()`` takes no arguments and returns a
        :class:`core_rl.interfaces.ModelSource`, whose ``resolve(path, notify)`` returns the local
        directory for a path it handles, ``None`` for any other, and raises a
        :class:`core_rl.errors.CoreRLError` with a one-line reason for a path it handles but cannot
        read.
    :return: nothing; results go through ``register``.

    Called when the plugin is loaded: every model source is loaded when a configuration that names
    a model path is loaded, so keep the module's imports light (nothing heavy until a path of its
    own is resolved).

    .. versionadded:: 14
    """


@hookspec
def core_rl_add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``core-rl`` subcommands (e.g. ``core-rl slurm render``), from a launcher's plugin module
    or a module of the ``core_rl.commands`` entry-point group (a distribution that only adds
    commands, e.g. the server kit's ``core-rl server-env``).

    :param subparsers: the ``add_subparsers()`` object of the ``core-rl`` parser: call
        ``subparsers.add_parser(NAME, help=...)`` and ``parser.set_defaults(run=FUNCTION)``;
        ``core-rl NAME ...`` then returns ``FUNCTION(args)`` (an ``int`` exit status; a
        :class:`core_rl.errors.CoreRLError` it raises is printed as a message, exit status 2).
    :return: nothing.

    Called when ``core-rl`` builds its command line, on every launcher plugin and every module of
    the ``core_rl.commands`` group.

    .. versionadded:: 5
    """


@hookspec
def core_rl_add_train_arguments(group: argparse._ArgumentGroup) -> None:
    """Add options to ``core-rl train`` for a launcher (e.g. ``--ray-address``).

    :param group: the "launcher options" argument group of the ``train`` parser: call
        ``group.add_argument(...)`` with a default of ``None``. Every such value
        reaches :class:`core_rl.launch.launchers.LaunchRequest` ``.options`` under its ``dest``, whichever
        launcher the configuration selects.
    :return: nothing.

    Called when ``core-rl`` builds its command line, on every launcher plugin and every module of
    the ``core_rl.commands`` group.

    .. versionadded:: 5
    """
