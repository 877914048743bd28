"""The ``actor.engine`` section of the ``megatron`` train engine (every key except ``name``).

Key names follow Megatron-LM's own arguments (as the RLinf and AReaL Megatron sections do), so a
Megatron user finds the setting under the name they know.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import attrs
from core_rl.config.validators import FieldValueError, non_negative, one_of, positive

if TYPE_CHECKING:
    from core_rl.config.checks import EnvironmentContext, SectionContext
    from core_rl.config.schema import ActorConfig

BACKENDS = ("auto", "gloo", "nccl")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
TRANSFORMER_IMPLS = ("local", "transformer_engine")


#: the ``actor.optimizer.name`` values Megatron's own optimizer (on a GPU) implements
MEGATRON_OPTIMIZERS = ("adamw", "sgd")


def gpu_optimizer_problem(name: str, key: str = "actor.optimizer.name") -> str:
    """Why ``name`` cannot run with Megatron's own optimizer (the engine's optimizer on a GPU)."""
    return (
        f"{key}: {name}, but the megatron engine on a GPU steps Megatron's own optimizer, which has "
        f"{' and '.join(MEGATRON_OPTIMIZERS)} only; choose one of them, or the fsdp engine"
    )


@attrs.define
class DDPConfig:
    """Megatron's ``DistributedDataParallelConfig`` (gradient buffers and their reduction).

    - ``grad_reduce_in_fp32``: keep and reduce gradients in float32 whatever the parameter dtype.
    - ``overlap_grad_reduce``: launch each bucket's reduction as soon as its gradients are ready in
      the last micro-batch's backward, instead of after it.
    - ``overlap_param_gather``: with the distributed optimizer, all-gather updated parameters bucket
      by bucket during the next forward (needs ``use_distributed_optimizer``; GPU only).
    - ``use_distributed_optimizer``: shard optimizer state and fp32 master weights over data-parallel
      ranks (ZeRO-1, Megatron's ``DistributedOptimizer``; GPU only).
    - ``bucket_size``: parameters per gradient bucket (elements; ``None``: Megatron's default,
      ``max(40M, 1M * data-parallel size)``).
    - ``check_for_nan_in_grad``: raise when a reduced gradient holds NaN or Inf.
    """

    grad_reduce_in_fp32: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: int | None = attrs.field(default=None, validator=positive())
    check_for_nan_in_grad: bool = False

    def __attrs_post_init__(self) -> None:
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise FieldValueError("overlap_param_gather", True, "needs ddp.use_distributed_optimizer: true")


@attrs.define
class MegatronConfig:
    """Options of the Megatron-core engine.

    Parallelism (the world size must be a multiple of ``tensor * pipeline * context``; what is left
    is data parallel):

    - ``tensor_model_parallel_size``: split each linear layer and the vocabulary over this many ranks.
    - ``pipeline_model_parallel_size``: split the decoder layers into this many stages (GPU only:
      Megatron's pipeline schedules and p2p communication need CUDA).
    - ``virtual_pipeline_model_parallel_size``: model chunks per pipeline stage (interleaved 1F1B
      schedule); ``None`` or 1: off. Needs ``pipeline_model_parallel_size > 1``.
    - ``context_parallel_size``: split every sequence over this many ranks (needs
      ``transformer_impl: transformer_engine``, whose attention implements it).
    - ``expert_model_parallel_size``: split mixture-of-experts layers over this many ranks (only a
      model with experts can use more than 1; the supported families are dense).
    - ``sequence_parallel``: also split layer norms and dropout along the sequence over the tensor
      parallel ranks (needs ``tensor_model_parallel_size > 1`` and Transformer Engine or Apex norms).

    Memory and precision:

    - ``recompute_granularity``: ``full`` (recompute whole layers in backward) or ``selective``
      (recompute the attention core only); ``None``: keep activations.
    - ``recompute_method``: with ``full``: ``uniform`` (checkpoint groups of
      ``recompute_num_layers`` layers) or ``block`` (recompute the first ``recompute_num_layers``
      layers of each stage).
    - ``recompute_num_layers``: see ``recompute_method``.
    - ``recompute_modules``: with ``selective``: the submodules to recompute (Megatron's names, e.g.
      ``core_attn``, ``mlp``, ``layernorm``); ``None``: ``[core_attn]``.
    - ``bf16``: compute in bfloat16 with float32 master weights in Megatron's optimizer (GPU only;
      load the model with ``actor.dtype: float32``).
    - ``ddp``: gradient buffers and reduction (:class:`DDPConfig`).

    Model and I/O:

    - ``transformer_impl``: ``local`` (Megatron-core's own layers, runs anywhere) or
      ``transformer_engine`` (NVIDIA Transformer Engine layers; GPU, needs ``transformer-engine``).
    - ``make_vocab_size_divisible_by``: the vocabulary is padded to a multiple of this times the
      tensor-parallel size; padded entries are excluded from every softmax.
    - ``export_bucket_mb``: size of the buckets in which weights are gathered on the main rank
      for export (and written as one safetensors file each).
    - ``seed``: seed of Megatron's tensor-parallel RNG tracker (dropout inside tensor-parallel regions).
    - ``backend``: process-group backend when the engine creates the group: ``auto`` is NCCL for
      CUDA tensors plus gloo for CPU tensors on a GPU machine, gloo on CPU.
    """

    #: the model heads this engine builds (:data:`core_rl.interfaces.HEADS`): a critic needs
    #: ``value``, the ``rm`` loop ``score`` (:mod:`core_rl_megatron.heads`)
    heads: ClassVar[tuple[str, ...]] = ("lm", "value", "score")

    tensor_model_parallel_size: int = attrs.field(default=1, validator=positive())
    pipeline_model_parallel_size: int = attrs.field(default=1, validator=positive())
    virtual_pipeline_model_parallel_size: int | None = attrs.field(default=None, validator=positive())
    context_parallel_size: int = attrs.field(default=1, validator=positive())
    expert_model_parallel_size: int = attrs.field(default=1, validator=positive())
    sequence_parallel: bool = False
    recompute_granularity: str | None = attrs.field(default=None, validator=one_of(RECOMPUTE_GRANULARITIES))
    recompute_method: str | None = attrs.field(default=None, validator=one_of(RECOMPUTE_METHODS))
    recompute_num_layers: int | None = attrs.field(default=None, validator=positive())
    recompute_modules: list[str] | None = None
    bf16: bool = False
    ddp: DDPConfig = attrs.field(factory=DDPConfig)
    transformer_impl: str = attrs.field(default="local", validator=one_of(TRANSFORMER_IMPLS))
    make_vocab_size_divisible_by: int = attrs.field(default=128, validator=positive())
    export_bucket_mb: float = attrs.field(default=512.0, validator=positive())
    seed: int = attrs.field(default=1234, validator=non_negative())
    backend: str = attrs.field(default="auto", validator=one_of(BACKENDS))

    def compute_dtype(self, section: ActorConfig) -> str:
        """The dtype the forward computes activations in (``bfloat16`` with ``bf16``, else the
        stored ``dtype``), for the ``auto`` micro-batch budget (which counts a tensor- or
        pipeline-parallel model's activations as if unsplit)."""
        return "bfloat16" if self.bf16 else section.dtype

    def __attrs_post_init__(self) -> None:
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp > 1 and self.pipeline_model_parallel_size == 1:
            raise FieldValueError("virtual_pipeline_model_parallel_size", vpp, "needs pipeline_model_parallel_size > 1")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise FieldValueError("sequence_parallel", True, "needs tensor_model_parallel_size > 1")
        if self.context_parallel_size > 1 and self.transformer_impl != "transformer_engine":
            raise FieldValueError(
                "context_parallel_size",
                self.context_parallel_size,
                "needs transformer_impl: transformer_engine (Megatron's local attention has no context parallelism)",
            )
        if self.recompute_granularity == "full":
            if self.recompute_method is None or self.recompute_num_layers is None:
                raise FieldValueError(
                    "recompute_granularity", "full", "needs recompute_method and recompute_num_layers"
                )
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise FieldValueError(
                "recompute_method" if self.recompute_method is not None else "recompute_num_layers",
                self.recompute_method if self.recompute_method is not None else self.recompute_num_layers,
                "only applies with recompute_granularity: full",
            )

        if self.recompute_modules is not None and self.recompute_granularity != "selective":
            raise FieldValueError(
                "recompute_modules", self.recompute_modules, "only applies with recompute_granularity: selective"
            )

    def check_config(self, context: SectionContext) -> list[str]:
        """Role settings this engine does not honour, refused rather than ignored: LoRA adapters
        (it trains every weight)."""
        role, section = context.role_section()
        problems = []
        if section is not None and section.lora.enabled:
            problems.append(
                f"{role}.lora.rank: {section.lora.rank}, but the megatron engine trains every weight (no LoRA "
                "adapters); set it to 0, or use the fsdp or deepspeed engine for LoRA"
            )
        optimizer = section.optimizer if section is not None else None
        if optimizer is not None and optimizer.name in ("muon", "adafactor"):
            problems.append(
                f"{role}.optimizer.name: {optimizer.name} keeps optimizer state not shaped like each parameter "
                "(Adafactor's row and column factors, Muon's momentum on matrices only) and needs whole matrices, "
                "but the megatron engine checkpoints state per parameter shard and splits matrices under tensor "
                "parallelism; use adamw, sgd or class, or the fsdp engine"
            )
        return problems

    def check_environment(self, context: EnvironmentContext) -> list[str]:
        """megatron-core needs CUDA (:mod:`core_rl_megatron.device`); one process per GPU. On a GPU
        the engine steps Megatron's own optimizer, which has AdamW and SGD only."""
        from core_rl_megatron.device import NEEDS_CUDA, megatron_can_run

        machine = context.machine
        if not machine.cuda_available and not megatron_can_run():
            return [f"{context.path}.name: {NEEDS_CUDA}"]
        problems = machine.gpu_per_process_problems(context.path)
        role, section = context.role_section()
        if machine.cuda_available and section is not None and section.optimizer.name not in MEGATRON_OPTIMIZERS:
            problems.append(gpu_optimizer_problem(section.optimizer.name, f"{role}.optimizer.name"))
        return problems

    @property
    def virtual_pipeline_size(self) -> int:
        """Model chunks per pipeline stage (1 without virtual pipelining)."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model: tensor x pipeline x context parallel."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
