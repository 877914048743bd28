"""The typed configuration of a run. YAML is parsed and merged by OmegaConf, structured into these
attrs classes by cattrs (:mod:`core_rl.config.loader`). Sections selected by name (``actor.engine``,
``rollout.engine``, ``algorithm.advantage``, ``algorithm.loss``, ``algorithm.filters[]``,
``reward``, ``loggers[]``, ``launcher``) are :class:`PluginSpec` s: ``name`` plus keys validated by the selected
plugin's own ``config_cls`` (:mod:`core_rl.config.plugin_spec`). The keys every model role section
shares (optimiser, schedule, micro-batches, LoRA) live in :mod:`core_rl.config.model_sections`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import attrs

from core_rl.config.checkpoint_sections import KeepBestConfig as KeepBestConfig  # re-exported with the sections
from core_rl.config.checkpoint_sections import RecoverConfig, SaverConfig
from core_rl.config.data_config import DataConfig as DataConfig  # re-exported with the sections
from core_rl.config.data_config import TrainFile as TrainFile
from core_rl.config.derived_key import Derived
from core_rl.config.eval_config import EvalConfig
from core_rl.config.model_sections import LoraConfig, MicroBatchConfig, MoEConfig, OptimizerConfig, SchedulerConfig
from core_rl.config.placement import PlacementConfig
from core_rl.config.placement import RolePlacement as RolePlacement  # re-exported with the section
from core_rl.config.plugin_spec import PluginSpec
from core_rl.config.plugin_spec import default_from as default_from  # re-exported: the plugin guide names it here
from core_rl.config.plugin_spec import plugin_section as plugin_section  # re-exported likewise
from core_rl.config.sampling import SamplingConfig as SamplingConfig  # re-exported with the sections
from core_rl.config.validators import (
    MAX_COUNT,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    FieldValueError,
    each,
    finite,
    in_range,
    inside_directory,
    non_negative,
    not_empty,
    one_of,
    positive,
    regular_expression,
)
from core_rl.ops.names import DISTILL_LOSSES, NORM_LEVELS, REWARD_AGGREGATIONS, VALUE_LOSSES

DTYPES = ("float32", "bfloat16", "float16")
#: a switch that may be left to the run's start: ``true``, ``false`` or ``auto`` (structured by
#: :mod:`core_rl.config.converter`)
AutoBool = bool | Literal["auto"]


@attrs.define
class ExperimentConfig:
    """``name``: the run's name; its files go to ``output_dir/name`` (a relative path that stays
    inside ``output_dir``). ``seed`` seeds every RNG.

    ``offline``: model and tokenizer paths must be local directories (the default: nothing is
    downloaded). ``false`` lets ``actor.model_path`` / ``actor.tokenizer_path`` name a Hugging Face
    hub repository, downloaded into the Hugging Face cache before the run starts."""

    name: str = attrs.field(default="core-rl", validator=inside_directory())
    output_dir: str = attrs.field(default="runs", validator=not_empty())
    seed: int = attrs.field(default=1, validator=in_range(0, MAX_SEED))
    offline: bool = True

    @property
    def run_dir(self) -> Path:
        """The run's directory, ``output_dir/name``, where every file of the run goes."""
        return Path(self.output_dir) / self.name


@attrs.define
class ControllerConfig:
    """The rollout controller (:mod:`core_rl.rollout.controller`), which keeps generating while
    the trainer trains.

    ``max_head_offpolicyness``: how many versions the weights a trajectory starts under may lag
    behind the policy it trains (admission-time control: a generation batch starts only while
    this holds, so no sample is generated and then thrown away for being stale); 0 is synchronous
    training. ``max_concurrent_rollouts``: trajectories (prompts) in flight at once (0: no limit
    beyond the staleness bound). ``queue_size``: finished groups the controller may hold for the
    trainer (0: ``(max_head_offpolicyness + 1) * data.batch_size``; at least ``data.batch_size``).
    ``batching``: ``wave`` hands each generation batch's requests to the engine as one batch
    (``generate``), ``request`` sends each request alone (``agenerate``), ``auto`` is ``wave``
    when ``max_head_offpolicyness`` is 0 (the synchronous run, reproduced exactly) else
    ``request``. ``pause_mode``: how running requests pause while new weights load (``abort``:
    interrupted and continued under the new weights; ``wait``: finished first; ``keep``: frozen in
    place, their cache kept, and continued under the new weights, which vLLM and SGLang report token
    by token; on vLLM only the swap itself freezes them).
    ``wait_timeout_s``: the longest the trainer waits for a generation batch (and a weight update
    for the rollout to pause). ``warn_wait_fraction``: warn when the trainer waited on rollout
    (or rollout on the trainer) for more than this fraction of a step. ``workflow_timeout_s``: the
    longest one trajectory's workflow call (``run``, generation included) may take, and the longest
    the controller's event loop may stay blocked (by an ``async def`` making a blocking call); past
    it the run stops with one line naming the workflow (:mod:`core_rl.reliability.deadlines`)."""

    max_head_offpolicyness: int = attrs.field(default=0, validator=in_range(0, MAX_STEPS))
    max_concurrent_rollouts: int = attrs.field(default=0, validator=in_range(0, MAX_COUNT))
    queue_size: int = attrs.field(default=0, validator=in_range(0, MAX_COUNT))
    batching: str = attrs.field(default="auto", validator=one_of(("auto", "wave", "request")))
    pause_mode: str = attrs.field(default="abort", validator=one_of(("wait", "keep", "abort")))
    wait_timeout_s: float = attrs.field(default=3600.0, validator=in_range(0.0, 10**7, low_open=True))
    warn_wait_fraction: float = attrs.field(default=0.5, validator=in_range(0.0, 1.0))
    workflow_timeout_s: float = attrs.field(default=1800.0, validator=in_range(0.0, 10**7, low_open=True))


@attrs.define
class SyncCheckConfig:
    """``enabled``: check after weight syncs (default on); ``every_n_syncs``: check the ``N``-th,
    ``2N``-th, ... sync of the run (1: every one). A mismatch stops the run at that step."""

    enabled: bool = True
    every_n_syncs: int = attrs.field(default=1, validator=in_range(1, MAX_STEPS))


@attrs.define
class RolloutDumpConfig:
    """``every_n_steps``: write the scored rollouts of every step ``N`` divisible by it to
    ``<dir>/step_<N>.parquet`` (0: never); ``dir``: where (null: ``<run>/rollouts``). The files:
    :mod:`core_rl.rollout.dump`; how a dump and ``rollout.replay_from`` combine with the rest of a
    run: :func:`core_rl.config.problems.replay_config_problems`."""

    every_n_steps: int = attrs.field(default=0, validator=in_range(0, MAX_STEPS))
    dir: str | None = attrs.field(default=None, validator=not_empty())


@attrs.define
class RolloutConfig:
    """The rollout engine (``engine.name`` selects it) and how it samples.

    ``weight_sync``: how new weights reach it after each step: ``memory`` (a state dict handed
    over in-process), ``disk`` (a Hugging Face directory written and reloaded) or ``collective``
    (broadcast from the trainer's main rank to the engine's workers over a process group). The
    selected engine must support the mode (``weight_sync_modes`` of its config class).

    ``lora_sync``: what a weight sync sends with LoRA (``actor.lora.rank > 0``): ``merged``
    (default: the adapters merged into the base weights, ``W + scaling * B @ A``, and every weight
    sent) or ``adapter`` (the adapter alone, peft's ``save_pretrained`` format, written to a fresh
    directory per version that the engine loads under a new adapter name, its requests naming it:
    the bytes of ``A`` and ``B`` instead of the whole model; the engine's base weights stay those
    of ``actor.model_path``). ``adapter`` needs a rollout engine that serves adapters
    (``serves_lora_adapters`` of its config class: ``vllm``), ``weight_sync: disk``, a train engine
    that writes the adapter alone (``exports_lora_adapter``: ``fsdp``, ``deepspeed``), and no
    sleeping while training (:mod:`core_rl.sync.lora`).

    ``sync_check``: after each weight sync (``every_n_syncs`` to thin it), compare fingerprints of
    the tensors the trainer sent with those the rollout engine loaded; a mismatch stops the run
    (:class:`SyncCheckConfig`, :mod:`core_rl.sync.check`).

    ``workflow``: how a data row becomes trajectories (:mod:`core_rl.rollout.workflows`; default
    ``single_turn``); ``controller``: asynchronous rollout and its staleness bound
    (:class:`ControllerConfig`).

    ``sleep_while_training``: the engine gives back its GPU memory after each step's generation
    and takes it back for the weight update and the next generation
    (:meth:`~core_rl.interfaces.RolloutEngine.release_memory`). ``auto``: on when the engine
    shares the trainer's GPUs (``placement.mode`` colocate, on CUDA) in a synchronous run
    (``controller.max_head_offpolicyness`` 0); ``true`` anywhere else is refused
    (:func:`core_rl.launch.placement.sleep_problems`).

    ``dump``: each step's scored rollouts saved under the run (:class:`RolloutDumpConfig`);
    ``replay_from``: a directory of such dumps to train on instead of generating (no rollout engine
    built, no reward called: :mod:`core_rl.rollout.replay`).

    ``return_routed_experts``: a mixture-of-experts model's rollout returns, per token, the experts
    each layer routed it to (``Sample.routed_experts``); on by itself with
    ``actor.moe.routing_replay: rollout``. The engine must be able to (``returns_routed_experts`` of
    its config class: ``hf``)."""

    engine: PluginSpec = attrs.field(factory=lambda: PluginSpec(name="hf"))
    sampling: SamplingConfig = attrs.field(factory=SamplingConfig)
    weight_sync: str = attrs.field(default="memory", validator=one_of(("memory", "disk", "collective")))
    lora_sync: str = attrs.field(default="merged", validator=one_of(("merged", "adapter")))
    sync_check: SyncCheckConfig = attrs.field(factory=SyncCheckConfig)
    workflow: PluginSpec = attrs.field(factory=lambda: PluginSpec(name="single_turn"))
    controller: ControllerConfig = attrs.field(factory=ControllerConfig)
    sleep_while_training: AutoBool = "auto"
    dump: RolloutDumpConfig = attrs.field(factory=RolloutDumpConfig)
    replay_from: str | None = attrs.field(default=None, validator=not_empty())
    return_routed_experts: bool = False


@attrs.define
class ActorConfig:
    """The policy being trained: the train engine (``engine.name`` selects it, its other keys are
    validated by that engine), the model, and the optimisation settings every engine honours.

    ``model_path`` / ``tokenizer_path`` (default: ``model_path``): local Hugging Face directories
    (hub ids only with ``experiment.offline: false``); ``grad_clip``: the largest total gradient
    norm (0: no clipping).
    ``gradient_checkpointing``: recompute activations in backward, on every
    ``gradient_checkpointing_every_n_layers``-th decoder layer (1: all), keeping the saved layer
    inputs in host memory with ``gradient_checkpointing_offload``. ``lora``: train low-rank
    adapters instead of every weight (:class:`LoraConfig`). ``fused_head``: compute log-probs and
    entropies from the last hidden states and the output head's weight a chunk of tokens at a
    time, never materialising the logits (:mod:`core_rl_train_kit.fused_head`): ``vocab x 2``
    values per token less memory (0.6 MB a token for a 152k vocabulary in bf16) for one more
    product with the head in backward; engines ``fsdp`` and ``deepspeed``, models whose forward
    does not transform the logits (no soft-capping or scaling). ``disable_dropout``: train
    without the model's dropout (its config's attention and hidden dropout), so that the log-probs
    of a training forward are those of the rollout and the reference, which run without it; LoRA's
    own ``lora.dropout`` still applies (``megatron`` builds its models without dropout whatever
    this says). ``model_overrides``: keys of the model's ``config.json`` replaced for this run
    (e.g. ``rope_scaling``, ``max_position_embeddings``), for every engine that loads the model
    (:mod:`core_rl.roles.model_overrides`). ``trust_remote_code``: let transformers run the Python files a
    model directory ships (its ``config.json`` or ``tokenizer_config.json`` has an ``auto_map``)
    wherever this role's config, model or tokenizer is loaded; for the actor also the rollout engine
    and its inference servers (``--trust-remote-code``). Per role, not run-wide: trust belongs to a
    directory, and each role names its own (:mod:`core_rl.roles.remote_code`). Without it such a model is
    refused before the run. ``freeze``: regular expressions naming parameters that keep their
    starting values (``[embed_tokens]``; :mod:`core_rl.roles.freezing`). ``moe``: a
    mixture-of-experts model's router precision, load-balancing loss and metrics, and routing
    replay (:class:`~core_rl.config.model_sections.MoEConfig`)."""

    model_path: str = ""
    tokenizer_path: str | None = None
    engine: PluginSpec = attrs.field(factory=lambda: PluginSpec(name="fsdp"))
    dtype: str = attrs.field(default="float32", validator=one_of(DTYPES))
    optimizer: OptimizerConfig = attrs.field(factory=OptimizerConfig)
    lr_scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    micro_batch: MicroBatchConfig = attrs.field(factory=MicroBatchConfig)
    grad_clip: float = attrs.field(default=1.0, validator=non_negative())
    gradient_checkpointing: bool = False
    gradient_checkpointing_every_n_layers: int = attrs.field(default=1, validator=positive())
    gradient_checkpointing_offload: bool = False
    lora: LoraConfig = attrs.field(factory=LoraConfig)
    fused_head: bool = False
    disable_dropout: bool = True
    model_overrides: dict[str, Any] = attrs.field(factory=dict)
    trust_remote_code: bool = False
    freeze: list[str] = attrs.field(factory=list, validator=each(regular_expression()))
    moe: MoEConfig = attrs.field(factory=MoEConfig)


@attrs.define
class CriticConfig(ActorConfig):
    """The ``critic:`` section: a trained value model (PPO), built by any train engine whose config
    class lists ``value`` in ``heads``; every key of :class:`ActorConfig` (model, engine, optimiser,
    micro-batches) plus its value loss (:func:`core_rl.ops.value_loss`):

    - ``eps_clip``: values move at most this far from the values before the update (null: no
      clipping); ``loss``: ``mse`` or ``huber`` (with ``huber_delta``);
    - ``warmup_steps``: for the first this many RL steps only the critic trains (the policy is left
      unchanged while the value estimates settle)."""

    eps_clip: float | None = attrs.field(default=0.5, validator=positive())
    loss: str = attrs.field(default="mse", validator=one_of(VALUE_LOSSES))
    huber_delta: float = attrs.field(default=1.0, validator=positive())
    warmup_steps: int = attrs.field(default=0, validator=in_range(0, MAX_STEPS))


@attrs.define
class TeacherConfig(ActorConfig):
    """The ``teacher:`` section: a frozen model (possibly larger, or of another engine) whose
    log-probs on the policy's own samples give on-policy distillation: the policy loss becomes
    ``rl_coef * (the algorithm's loss) + distill_coef * (the distillation loss)``, ``loss`` being

    - ``reverse_kl`` (default): the reverse KL(pi || teacher) estimated on the sampled tokens from
      the teacher's log-probs of them (:func:`core_rl.ops.reverse_kl_distill_loss`);
    - ``topk_forward_kl``: per response token, the forward KL(teacher || pi) over the teacher's
      ``top_k`` most likely tokens (default 20), the teacher renormalised over them:
      ``sum_v q_v (log q_v - log pi_v)``, ``q = softmax(teacher's top-k log-probs)``
      (:func:`core_rl.ops.topk_forward_kl_loss`), masked-mean over the response tokens. Only the
      ``[B, T, top_k]`` ids and log-probs leave the teacher; the policy's log-softmax is gathered
      at those ids. Both the actor's and the teacher's engine must compute them (``fsdp``,
      ``deepspeed``), without ``fused_head`` or sequence parallelism.

    ``rl_coef: 0`` distils alone. The optimiser keys are ignored (a teacher is never trained); it
    must share the policy's tokenizer."""

    distill_coef: float = attrs.field(default=1.0, validator=non_negative())
    rl_coef: float = attrs.field(default=1.0, validator=non_negative())
    loss: str = attrs.field(default="reverse_kl", validator=one_of(DISTILL_LOSSES))
    top_k: int = attrs.field(default=20, validator=in_range(1, MAX_COUNT))


#: where the reward model's score of a sample is read (:mod:`core_rl.loops.rl.reward_model`)
SCORE_TOKENS = ("last_content", "last")


@attrs.define
class RewardModelRoleConfig(ActorConfig):
    """The ``reward_model:`` section: a frozen reward model (a backbone with a scalar ``score`` head,
    e.g. the ``rm`` loop's export), built by any train engine whose config class lists ``score`` in
    ``heads``; it scores every sample of a step on the token ids of this run, on every rank:

    - ``coef``: ``reward = (the reward: section's score, 0 without one) + coef * score``, before
      ``algorithm.reward_shaping`` and the advantages;
    - ``score_token``: the response token whose output is the score: ``last_content`` (the last
      response token that is not a special token such as EOS: how the ``rm`` loop trains and the
      ``reward_model`` reward reads decoded text) or ``last`` (the last token as generated, EOS
      included);
    - ``transform``: ``none`` or ``sigmoid``, applied to the score before ``coef``.

    The optimiser keys are ignored (never trained); it must share the policy's tokenizer."""

    coef: float = attrs.field(default=1.0, validator=finite())
    score_token: str = attrs.field(default="last_content", validator=one_of(SCORE_TOKENS))
    transform: str = attrs.field(default="none", validator=one_of(("none", "sigmoid")))


@attrs.define
class NormConfig:
    """Normalisation of rewards or advantages (:func:`core_rl.ops.normalize`): subtract a baseline
    over ``mean_level`` (``batch``, ``group`` or ``none``; ``leave_one_out``: the mean of the *other*
    samples) and divide by the standard deviation over ``std_level`` (``unbiased``: Bessel's
    correction) plus ``eps``. Every response token counts once for advantages."""

    mean_level: str = attrs.field(default="batch", validator=one_of(NORM_LEVELS))
    std_level: str = attrs.field(default="batch", validator=one_of(NORM_LEVELS))
    leave_one_out: bool = False
    unbiased: bool = True
    eps: float = attrs.field(default=1e-5, validator=positive())

    def __attrs_post_init__(self) -> None:
        if self.leave_one_out and self.mean_level == "none":
            raise FieldValueError("leave_one_out", True, "needs a mean_level (batch or group), not 'none'")


@attrs.define
class RewardShapingConfig:
    """What happens to each sample's reward before advantages, in this order: DAPO's soft overlong
    punishment over the last ``overlong_tokens`` of the response budget (scaled by
    ``overlong_penalty_factor``; off when ``overlong_tokens`` is null), then
    ``clip((r + bias) * scale, -clip, clip)`` (``clip`` null: none), then ``norm`` (null: none).

    ``aggregation`` says what ``r`` is before all that: ``sum`` (the default), the reward's score, for
    ``combine`` the weighted sum of its parts; ``normalize_then_sum`` (GDPO; TRL's
    ``multi_objective_aggregation``), with a reward of weighted parts only (``combine``, or a
    plugin's whose config has ``weighted_parts()``: :mod:`core_rl.config.reward_aggregation`), the
    weighted sum of its parts each normalised within its group first, ``r_i = sum_k w_k * (p_ik - mean_g(p_k)) /
    (std_g(p_k) + part_eps)`` (``std_g`` unbiased unless ``part_unbiased`` is false; default
    ``part_eps`` 1e-4, TRL's; a part that is itself a ``combine`` counts as one). A part absent
    for a sample (``None``, or a sample whose reward call failed) is left out of that part's group
    statistics and adds 0 (:func:`core_rl.ops.normalize_then_sum`). Sample filters judge this
    ``r``, not the raw sum (``drop_uniform_groups`` keeps a group whose sums tie while its
    normalised parts do not cancel, and its ``min_std`` applies to ``r``); the ``reward/...``
    metrics report the raw weighted sum."""

    scale: float = 1.0
    bias: float = 0.0
    clip: float | None = attrs.field(default=None, validator=positive())
    overlong_tokens: int | None = attrs.field(default=None, validator=in_range(1, MAX_TOKENS))
    overlong_penalty_factor: float = attrs.field(default=1.0, validator=non_negative())
    norm: NormConfig | None = None
    aggregation: str = attrs.field(default="sum", validator=one_of(REWARD_AGGREGATIONS))
    part_eps: float = attrs.field(default=1e-4, validator=positive())
    part_unbiased: bool = True


def _files(_inst: object, attribute: attrs.Attribute, value: list[str]) -> None:
    if not value or not all(isinstance(v, str) and v for v in value):
        raise FieldValueError(attribute.name, value, "must list the files of the supervised rows (as data.train_files)")


@attrs.define
class PTXConfig:
    """``algorithm.ptx`` (the loss and the rows: :mod:`core_rl.loops.rl.ptx`): every optimiser
    step of the policy also trains on ``rows`` rows of ``files`` (read like
    ``data.train_files``; a row's ``prompt_key`` column is its prompt, tokenised as the training
    prompts are, and its ``response_key`` column the completion, text or token ids, followed by EOS),
    drawn in a seeded order that reshuffles each epoch and resumes where it was:

        loss = policy loss + coef * (sum of -log pi over the rows' completion tokens) / (their number)

    Each row is cut to ``max_length`` tokens (its completion at the end). The completion tokens'
    mean NLL is logged as ``actor/ptx_nll`` (over every rank's rows)."""

    files: list[str] = attrs.field(validator=_files)
    coef: float = attrs.field(default=0.05, validator=positive(1e6))
    rows: int = attrs.field(default=8, validator=in_range(1, MAX_COUNT))
    prompt_key: str = attrs.field(default="prompt", validator=not_empty())
    response_key: str = attrs.field(default="response", validator=not_empty())
    max_length: int = attrs.field(default=1024, validator=in_range(2, MAX_TOKENS))


#: what the run does once the budget is exceeded ``patience`` steps in a row
MISMATCH_ACTIONS = ("warn", "correct", "stop")
#: the metrics a budget can watch (each logged as ``mismatch/<name>``)
MISMATCH_BUDGET_METRICS = ("abs_logprob_diff", "kl_behave_trainer", "ratio_out_of_bounds")


@attrs.define
class MismatchBudgetConfig:
    """``algorithm.mismatch_budget`` (at run time: :mod:`core_rl.loops.rl.mismatch_budget`).

    The mismatch metrics are logged every step whatever this section says
    (``mismatch/abs_logprob_diff``, ``mismatch/kl_behave_trainer``, ``mismatch/ratio_out_of_bounds``:
    the share of loss tokens whose ratio ``exp(log pi_train - log pi_behave)`` is outside
    ``[1 / ratio_bound, ratio_bound]``).

    ``threshold`` (null: no budget, the metrics only): a step whose ``metric`` exceeds it is over
    budget; after ``patience`` such steps in a row the run takes ``action``:

    - ``warn``: one line naming the metric, its value, the threshold and the step (again after
      each further ``patience`` steps over budget);
    - ``correct``: from the next step on, the policy loss applies the importance-sampling
      correction ``correction`` (a ``core_rl.rejection_samplers`` plugin section: ``tis``,
      truncated importance sampling, by default; ``mis`` masks instead) to its behaviour weight,
      and one line says so. It needs a loss that applies a correction (``ppo_clip``: the decoupled
      loss's ``pi_prox / pi_behave``, or the plain loss's ``pi_old / pi_behave`` with ``old_logprobs``
      recomputed from then on) and no ``algorithm.rejection_sampling`` already on;
    - ``stop``: the run ends with exit status 1 and one line naming the metric, its value, the
      threshold and the step, after logging that step's metrics and saving nothing of it.
    """

    metric: str = attrs.field(default="abs_logprob_diff", validator=one_of(MISMATCH_BUDGET_METRICS))
    threshold: float | None = attrs.field(default=None, validator=in_range(0.0, 1e6, low_open=True))
    action: str = attrs.field(default="warn", validator=one_of(MISMATCH_ACTIONS))
    patience: int = attrs.field(default=1, validator=in_range(1, MAX_STEPS))
    ratio_bound: float = attrs.field(default=2.0, validator=in_range(1.0, 1e6, low_open=True))
    correction: PluginSpec = attrs.field(factory=lambda: PluginSpec(name="tis"))


def mismatch_budget_problems(budget: MismatchBudgetConfig, *, rejection_sampling: PluginSpec | None) -> list[str]:
    """Problems of ``algorithm.mismatch_budget`` with the rest of ``algorithm``: an action other
    than ``warn`` without a threshold, and ``correct`` while ``algorithm.rejection_sampling``
    already applies a correction from the start (whether the loss applies one is the loss's
    ``set_rejection_sampler`` to say, before training)."""
    problems = []
    if budget.threshold is None and budget.action != "warn":
        problems.append(
            f"algorithm.mismatch_budget.action: {budget.action!r} acts when the mismatch exceeds "
            "algorithm.mismatch_budget.threshold, which is null; set a threshold"
        )
    if budget.threshold is not None and budget.action == "correct" and rejection_sampling is not None:
        problems.append(
            "algorithm.mismatch_budget.action: 'correct' turns on algorithm.mismatch_budget.correction when the "
            f"budget is exceeded, but algorithm.rejection_sampling ({rejection_sampling.name!r}) is on from the "
            "start; remove one of them"
        )
    return problems


@attrs.define
class AlgorithmConfig:
    """``name`` selects a recipe whose defaults fill this section; ``advantage``, ``loss``,
    ``filters`` and ``rejection_sampling`` select the components (each validated by its plugin).

    The rest applies to every recipe:

    - ``reward_shaping``, ``adv_norm`` (null: none): see :class:`RewardShapingConfig`, :class:`NormConfig`;
    - ``mask_no_eos_with_zero``: truncated samples (no stop token within the budget) leave the loss;
    - ``max_num_gen_batches``: 1 trains on what the filters leave of one generation batch; above 1,
      prompt batches are drawn until the filters leave ``data.batch_size`` prompts' groups (the rest
      is discarded), at most this many (dynamic sampling);
    - ``max_consecutive_empty_steps``: with ``max_num_gen_batches`` 1, this many steps in a row
      whose filters left nothing to train on end the run (0: no limit; each such step is a warning
      and counts in ``filter/empty_steps_total``, see :mod:`core_rl.loops.rl.filtering`);
    - ``max_consecutive_failed_steps``: this many steps in a row whose every episode failed (an
      environment past ``rollout.workflow.tool_timeout_s``, a reward call that failed) end the run
      (0: no limit; each such step is a warning and counts in ``rollout/failed_steps_total``, see
      :mod:`core_rl.loops.rl.failed_steps`);
    - ``filter_timeout_s``: the longest one sample filter's call may take; past it the run stops with
      one line naming the filter (:mod:`core_rl.reliability.deadlines`);
    - ``ppo_n_minibatches`` x ``ppo_epochs``: optimiser steps per RL step (the batch is cut into
      minibatches by rows, and the cut is passed over ``ppo_epochs`` times);
    - ``early_stop_kl`` (null: off): after an optimiser step whose measured ``approx_kl`` (the policy
      loss's KL estimate between the anchor and the policy that step started from, mean over the
      step's tokens on every rank) exceeds it, the RL step's remaining minibatches and epochs are
      skipped (the target-KL early stop of PPO implementations; ``actor/early_stopped``; the
      learning-rate schedule counts the optimiser steps taken);
    - ``ptx`` (null: off): a supervised loss on rows of its own in every optimiser step
      (:class:`PTXConfig`);
    - ``recompute_logprob``: ``old_logprobs`` come from the train engine before the first update
      (behaviour log-probs stay in ``behave_logprobs``);
    - ``mismatch_budget``: the train/rollout mismatch logged every step, and what to do when it
      stays too large (:class:`MismatchBudgetConfig`);
    - ``reference_reset_every_n_steps``: every this many steps the reference model becomes the
      current policy (0: never; :mod:`core_rl.loops.rl.reference_reset`);
    - ``reference_reset_alpha``: in ``(0, 1]``; below 1 each reset is a soft update, the reference
      becoming ``alpha * policy + (1 - alpha) * reference`` (:mod:`core_rl.loops.rl.reference_mix`);
      1: the policy itself;
    - ``reference_reset_optimizer``: each reset also drops the actor's optimizer state (Adam's
      moments and step count; the learning-rate schedule goes on), so the policy's next update
      starts the optimizer afresh, as ProRL does (default false: the state carries over). Needs
      ``reference_reset_every_n_steps``.
    """

    name: str = ""
    advantage: PluginSpec | None = None
    loss: PluginSpec | None = None
    filters: list[PluginSpec] = attrs.field(factory=list)
    rejection_sampling: PluginSpec | None = None
    reward_shaping: RewardShapingConfig = attrs.field(factory=RewardShapingConfig)
    adv_norm: NormConfig | None = None
    mask_no_eos_with_zero: bool = False
    max_num_gen_batches: int = attrs.field(default=1, validator=in_range(1, 10_000))
    max_consecutive_empty_steps: int = attrs.field(default=10, validator=in_range(0, MAX_STEPS))
    max_consecutive_failed_steps: int = attrs.field(default=3, validator=in_range(0, MAX_STEPS))
    filter_timeout_s: float = attrs.field(default=300.0, validator=in_range(0.0, 10**7, low_open=True))
    ppo_n_minibatches: int = attrs.field(default=1, validator=in_range(1, MAX_COUNT))
    ppo_epochs: int = attrs.field(default=1, validator=in_range(1, 10_000))
    early_stop_kl: float | None = attrs.field(default=None, validator=positive())
    ptx: PTXConfig | None = None
    recompute_logprob: bool = False
    mismatch_budget: MismatchBudgetConfig = attrs.field(factory=MismatchBudgetConfig)
    reference_reset_every_n_steps: int = attrs.field(default=0, validator=in_range(0, MAX_STEPS))
    reference_reset_alpha: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0, low_open=True))
    reference_reset_optimizer: bool = False

    @property
    def optimizer_steps_per_step(self) -> int:
        """Optimiser steps per RL step: ``ppo_n_minibatches * ppo_epochs``."""
        return self.ppo_n_minibatches * self.ppo_epochs


@attrs.define
class ProfileConfig:
    """``torch.profiler`` around chosen steps (:mod:`core_rl.loops.profiling`): ``steps`` lists
    the trainer steps to record (empty: none); each writes ``<run>/profile/step<N>-rank<R>.json``
    (a Chrome/Perfetto trace) and ``.txt`` (the operator table, ``row_limit`` rows). Every thread
    of the process is recorded (the embedded rollout engine's generation included); servers run
    in other processes and are not. ``record_shapes``, ``with_stack`` and ``profile_memory`` are
    the profiler's own options (each adds to the profiled step's time)."""

    steps: list[int] = attrs.field(factory=list, validator=each(in_range(1, MAX_STEPS)))
    record_shapes: bool = False
    with_stack: bool = False
    profile_memory: bool = False
    row_limit: int = attrs.field(default=40, validator=in_range(1, 10_000))


@attrs.define
class WatchdogConfig:
    """The progress watchdog (:mod:`core_rl.reliability.watchdog`): when no phase of a step advances
    within a bound (a phase starting or ending, a plugin, engine or server call returning), the run
    writes every thread's stack on every rank, with the phase and call each rank is in, to
    ``<run>/hang-<time>.txt`` and stops with exit status 1 and one line naming the stuck phase and call.

    The bound is ``timeout_s`` when set; otherwise the larger of ``floor_s`` and ``factor`` times the
    longest of the recent steps (the last 20, each from its start to the next step's, evaluation and
    checkpoints included) and of the longest time the current phase took before in this run. A phase
    the run has not completed yet (the first step's, the first checkpoint) gets at least
    ``first_s``. ``enabled: false`` turns the watchdog off."""

    enabled: bool = True
    floor_s: float = attrs.field(default=300.0, validator=in_range(1.0, 10**7))
    factor: float = attrs.field(default=5.0, validator=in_range(1.0, 10**4))
    first_s: float = attrs.field(default=1500.0, validator=in_range(1.0, 10**7))
    timeout_s: float | None = attrs.field(default=None, validator=in_range(1.0, 10**7))


def _steps_or_derived(inst: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    """``trainer.total_steps`` in ``[1, MAX_STEPS]``, or ``0`` (derived) with ``total_epochs`` set."""
    if not (value == 0 and inst.total_epochs is not None):
        in_range(1, MAX_STEPS)(inst, attribute, value)


@attrs.define
class TrainerConfig:
    """The loop: ``total_steps`` RL steps, or ``total_epochs`` passes over the training prompts
    (:mod:`core_rl.config.epochs`: ``total_steps`` is then derived when the run starts, from the
    number of prompts left after filtering, as ``ceil(total_epochs x prompts / data.batch_size)``;
    ``total_steps: 0`` keeps it derived, any other value with ``total_epochs`` is an error).
    ``resume: true`` is ``recover.mode: auto`` (continue from
    the run's newest valid checkpoint); ``torch_threads`` (0: leave torch's default) sets intra-op
    threads; the run warns at start-up when they, times the node's processes, need more cores than
    are free (:mod:`core_rl.loops.cpu_threads`). ``mode``: ``sync``, the only value (rollout ahead of training is
    ``rollout.controller.max_head_offpolicyness``).

    ``collective_timeout_s``: under ``torchrun``, how long any rank waits for the others (every
    collective, including waiting for rank 0's rollout and rewards) before the run fails with an
    error naming what it waited for. It must exceed the longest rank-0-only phase of a step.

    ``on_nonfinite``: what a step whose loss or gradient norm is NaN/inf does: ``skip`` (no update;
    the batch is saved under ``<run>/nonfinite/`` and counted in ``actor/nonfinite_total``) or
    ``stop`` (the same, then the run ends with an error). ``max_consecutive_nonfinite`` such steps
    in a row also end the run (0: no limit).

    ``profile``: record chosen steps with ``torch.profiler`` (:class:`ProfileConfig`).

    ``watchdog``: stop a run that makes no progress, saying where it is stuck (:class:`WatchdogConfig`).

    ``stop_grace_s``: after the first SIGINT or SIGTERM the run finishes its step and saves a
    checkpoint; when that has not happened within this many seconds (a stuck step), it stops without
    saving, keeping the newest complete checkpoint, says so and exits with 128 + the signal's number
    (:mod:`core_rl.loops.signals`).

    ``logger_timeout_s``: the longest one logger's ``log`` or ``log_samples`` call may take; past it
    the run stops with one line naming the logger, keeping its last checkpoint (:mod:`core_rl.reliability.deadlines`).
    ``warn_failure_fraction``: warn, naming the plugin, when more than this fraction of a plugin's
    calls in a step timed out or raised and the run went on (:mod:`core_rl.plugins.tally`).
    ``warn_no_signal_steps``: warn once this many RL updates in a row carried no learning signal
    (every group's samples scored alike, so every advantage was 0), saying what the rewards and the
    response lengths show (0: never; :func:`core_rl.loops.rl.update.no_signal_warning`)."""

    mode: str = attrs.field(default="sync", validator=one_of(("sync",)))
    total_steps: int = attrs.field(default=100, validator=_steps_or_derived)
    total_epochs: int | None = attrs.field(default=None, validator=in_range(1, MAX_STEPS))
    resume: bool = False
    torch_threads: int = attrs.field(default=0, validator=in_range(0, 4096))
    collective_timeout_s: float = attrs.field(default=1800.0, validator=in_range(1.0, 10**7))
    on_nonfinite: str = attrs.field(default="skip", validator=one_of(("skip", "stop")))
    max_consecutive_nonfinite: int = attrs.field(default=3, validator=in_range(0, MAX_STEPS))
    #: the training loop (a ``core_rl.loops`` plugin; its other keys are validated by it): ``rl``,
    #: the built-in RL loop, unless the algorithm recipe or the user selects another
    loop: PluginSpec = attrs.field(factory=lambda: PluginSpec(name="rl"))
    profile: ProfileConfig = attrs.field(factory=ProfileConfig)
    watchdog: WatchdogConfig = attrs.field(factory=WatchdogConfig)
    stop_grace_s: float = attrs.field(default=60.0, validator=in_range(1.0, 10**7))
    logger_timeout_s: float = attrs.field(default=120.0, validator=in_range(0.0, 10**7, low_open=True))
    warn_failure_fraction: float = attrs.field(default=0.1, validator=in_range(0.0, 1.0))
    warn_no_signal_steps: int = attrs.field(default=3, validator=in_range(0, MAX_STEPS))


@attrs.define
class RewardRunnerConfig:
    """How the reward is called (:mod:`core_rl.loops.rl.reward_runner`).

    A step's samples are scored in calls of ``items_per_call`` items (0: all in one call), up to
    ``num_workers`` calls at once in a thread pool (the reward must then be thread-safe; 1 calls it
    serially), each call bounded by ``timeout_s`` from its start. An item whose call raised or
    timed out, or whose score is NaN, inf or not a number, gets ``on_error``: ``value`` (its score
    is ``error_value``), ``drop`` (the sample leaves the step) or ``stop`` (the run ends with an
    error naming the reward, the item and the error). Every such item is counted
    (``reward/errors``) and written with its error to ``<run>/reward_errors.jsonl``. When more than
    ``max_error_fraction`` of a step's items fail, the reward is taken to be broken and the run
    stops whatever ``on_error`` says (1.0: never). A wrong number of scores always stops the run."""

    items_per_call: int = attrs.field(default=8, validator=in_range(0, MAX_COUNT))
    num_workers: int = attrs.field(default=4, validator=in_range(1, 1024))
    timeout_s: float = attrs.field(default=300.0, validator=in_range(0.0, 10**7, low_open=True))
    on_error: str = attrs.field(default="value", validator=one_of(("value", "drop", "stop")))
    error_value: float = attrs.field(default=0.0, validator=in_range(-1e30, 1e30))
    max_error_fraction: float = attrs.field(default=0.5, validator=in_range(0.0, 1.0))


@attrs.define
class SampleLogConfig:
    """Every ``every_n_steps`` steps (0: never) the loggers receive ``num_samples`` of the step's
    samples (prompt, response, reward, finish reason), spread evenly over the batch; the
    ``jsonl`` logger appends them to ``samples.jsonl`` in the run directory."""

    every_n_steps: int = attrs.field(default=10, validator=non_negative())
    num_samples: int = attrs.field(default=4, validator=positive())


@attrs.define
class RunConfig:
    """A whole run."""

    experiment: ExperimentConfig = attrs.field(factory=ExperimentConfig)
    data: DataConfig = attrs.field(factory=DataConfig)
    actor: ActorConfig = attrs.field(factory=ActorConfig)
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    algorithm: AlgorithmConfig = attrs.field(factory=AlgorithmConfig)
    reward: PluginSpec | None = None
    loggers: list[PluginSpec] = attrs.field(factory=lambda: [PluginSpec(name="console")])
    saver: SaverConfig = attrs.field(factory=SaverConfig)
    trainer: TrainerConfig = attrs.field(factory=TrainerConfig)
    sample_log: SampleLogConfig = attrs.field(factory=SampleLogConfig)
    reward_runner: RewardRunnerConfig = attrs.field(factory=RewardRunnerConfig)
    recover: RecoverConfig = attrs.field(factory=RecoverConfig)
    #: evaluation on held-out prompts while training (:mod:`core_rl.config.eval_config`); null: none
    eval: EvalConfig | None = None
    #: model roles besides the actor (:mod:`core_rl.roles.build`); null: not used (``ref`` then defaults to
    #: the actor's model, frozen, when the algorithm needs a reference)
    ref: ActorConfig | None = None
    critic: CriticConfig | None = None
    teacher: TeacherConfig | None = None
    reward_model: RewardModelRoleConfig | None = None
    #: how the run's processes start (a ``core_rl.launchers`` plugin: ``local``, the default, or
    #: e.g. ``slurm``, ``ray``) and where each role is placed (:mod:`core_rl.config.placement`)
    launcher: PluginSpec = attrs.field(factory=lambda: PluginSpec(name="local"))
    placement: PlacementConfig = attrs.field(factory=PlacementConfig)
    #: the keys the loader derived from others, by dotted key path (:mod:`core_rl.config.derived`);
    #: not a section of the file
    derived: dict[str, Derived] = attrs.field(factory=dict, init=False, eq=False, repr=False)
