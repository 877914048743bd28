"""The typed configuration of a run. YAML is parsed and merged by OmegaConf, structured into these
attrs classes by cattrs (:mod:`core_rl.config.loader`). Sections selected by name (``actor.engine``,
``rollout.engine``, ``algorithm.advantage``, ``algorithm.loss``, ``algorithm.filters[]``,
``reward``, ``loggers[]``) are :class:`PluginSpec` s: ``name`` plus keys validated by the selected
plugin's own ``config_cls``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from core_rl.config.validators import in_range, non_negative, one_of, positive

if TYPE_CHECKING:
    from core_rl.interfaces import SamplingParams

DTYPES = ("float32", "bfloat16", "float16")


@attrs.define
class PluginSpec:
    """``{name: <registered name>, ...options}``. ``config`` is the options validated by the
    plugin's ``config_cls`` (filled in by the loader; ``None`` if the plugin takes no options)."""

    name: str
    options: dict[str, Any] = attrs.field(factory=dict)
    config: Any = attrs.field(default=None, eq=False)


@attrs.define
class ExperimentConfig:
    """``name``: the run's name; its files go to ``output_dir/name``. ``seed`` seeds every RNG."""

    name: str = "core-rl"
    output_dir: str = "runs"
    seed: int = 1


@attrs.define
class DataConfig:
    """Training prompts: JSON/JSONL/Parquet files whose rows hold ``prompt_key`` (text) plus any
    columns rewards read (e.g. ``answer``). ``batch_size`` prompts are drawn per step."""

    train_files: list[str] = attrs.field(factory=list)
    prompt_key: str = "prompt"
    batch_size: int = attrs.field(default=8, validator=positive())
    shuffle: bool = True
    max_prompt_tokens: int = attrs.field(default=1024, validator=positive())
    apply_chat_template: bool = False


@attrs.define
class SamplingConfig:
    """Rollout sampling. ``n`` is the group size (samples per prompt)."""

    n: int = attrs.field(default=8, validator=positive())
    temperature: float = attrs.field(default=1.0, validator=in_range(0.0, 100.0, low_open=True))
    top_p: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0, low_open=True))
    top_k: int = attrs.field(default=0, validator=non_negative())
    max_new_tokens: int = attrs.field(default=256, validator=positive())
    min_new_tokens: int = attrs.field(default=0, validator=non_negative())
    stop_token_ids: list[int] = attrs.field(factory=list)
    greedy: bool = False

    def to_params(self) -> SamplingParams:
        from core_rl.interfaces import SamplingParams

        return SamplingParams(**attrs.asdict(self))


@attrs.define
class RolloutConfig:
    """The rollout engine (``engine.name`` selects it) and how it samples.

    ``weight_sync``: how new weights reach it after each step: ``memory`` (a state dict handed
    over in-process), ``disk`` (a Hugging Face directory written and reloaded) or ``collective``
    (broadcast from the trainer's main rank to the engine's workers over a process group). The
    selected engine must support the mode (``weight_sync_modes`` of its config class)."""

    engine: PluginSpec = attrs.field(factory=lambda: PluginSpec(name="hf"))
    sampling: SamplingConfig = attrs.field(factory=SamplingConfig)
    weight_sync: str = attrs.field(default="memory", validator=one_of(("memory", "disk", "collective")))


@attrs.define
class OptimizerConfig:
    """``name``: ``adamw`` or ``sgd``. ``betas``/``eps`` apply to AdamW, ``momentum`` to SGD."""

    name: str = attrs.field(default="adamw", validator=one_of(("adamw", "sgd")))
    lr: float = attrs.field(default=1e-5, validator=positive())
    weight_decay: float = attrs.field(default=0.0, validator=non_negative())
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = attrs.field(default=1e-8, validator=positive())
    momentum: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))


@attrs.define
class SchedulerConfig:
    """Learning-rate schedule: linear warmup over ``warmup_steps`` (or ``warmup_ratio`` of the total
    steps when ``warmup_steps`` is 0), then ``constant``, ``linear`` or ``cosine`` decay to
    ``min_lr_ratio * lr`` at step ``total_steps`` (0: ``trainer.total_steps``, filled in on load)."""

    name: str = attrs.field(default="constant", validator=one_of(("constant", "linear", "cosine")))
    warmup_steps: int = attrs.field(default=0, validator=non_negative())
    warmup_ratio: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    min_lr_ratio: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    total_steps: int = attrs.field(default=0, validator=non_negative())


@attrs.define
class MicroBatchConfig:
    """Rows are packed greedily into micro-batches of at most ``max_tokens_per_mb`` tokens
    (padded width x rows), and into at least ``min_num_mb`` micro-batches."""

    max_tokens_per_mb: int = attrs.field(default=8192, validator=positive())
    min_num_mb: int = attrs.field(default=1, validator=positive())


@attrs.define
class ActorConfig:
    """The policy being trained: the train engine (``engine.name`` selects it, its other keys are
    validated by that engine), the model, and the optimisation settings every engine honours."""

    model_path: str = ""
    tokenizer_path: str | None = None
    engine: PluginSpec = attrs.field(factory=lambda: PluginSpec(name="fsdp"))
    dtype: str = attrs.field(default="float32", validator=one_of(DTYPES))
    optimizer: OptimizerConfig = attrs.field(factory=OptimizerConfig)
    lr_scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    micro_batch: MicroBatchConfig = attrs.field(factory=MicroBatchConfig)
    grad_clip: float = attrs.field(default=1.0, validator=non_negative())
    gradient_checkpointing: bool = False


@attrs.define
class AlgorithmConfig:
    """``name`` selects a recipe whose defaults fill this section; ``advantage``, ``loss`` and
    ``filters`` select the components (each validated by its plugin)."""

    name: str = ""
    advantage: PluginSpec | None = None
    loss: PluginSpec | None = None
    filters: list[PluginSpec] = attrs.field(factory=list)


@attrs.define
class SaverConfig:
    """Checkpoints (full training state, for resuming) every ``every_n_steps`` steps (0: never)
    and at the end; the newest ``keep_last`` are kept. ``export_hf`` also writes the final
    policy as a Hugging Face directory."""

    every_n_steps: int = attrs.field(default=0, validator=non_negative())
    at_end: bool = True
    keep_last: int = attrs.field(default=2, validator=positive())
    export_hf: bool = True


@attrs.define
class TrainerConfig:
    """The loop: ``total_steps`` RL steps; ``resume`` continues from the run's newest checkpoint;
    ``torch_threads`` (0: leave torch's default) sets intra-op threads."""

    mode: str = attrs.field(default="sync", validator=one_of(("sync",)))
    total_steps: int = attrs.field(default=100, validator=positive())
    resume: bool = False
    torch_threads: int = attrs.field(default=0, validator=non_negative())


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
