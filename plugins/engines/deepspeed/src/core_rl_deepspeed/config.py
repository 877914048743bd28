"""The ``actor.engine`` section of the ``deepspeed`` train engine (every key except ``name``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from core_rl.config import flash_attention
from core_rl.config.fused_head import fused_head_problems
from core_rl.config.sequence_parallel import key_value_heads_problems, sequence_parallel_problems
from core_rl.config.validators import FieldValueError, one_of, positive

if TYPE_CHECKING:
    from core_rl.config.checks import EnvironmentContext, SectionContext
    from core_rl.config.schema import ActorConfig

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")  # core_rl.launch.distributed.pick_device
MIXED_DTYPES = ("bfloat16", "float16")
#: ``actor.optimizer.name`` values refused: ZeRO flattens the parameters the optimizer sees
FLAT_REFUSED = ("adafactor", "muon")


@attrs.define
class DeepSpeedConfig:
    """Options of the DeepSpeed ZeRO engine.

    - ``zero_stage``: what each data-parallel rank keeps a shard of: 1 the optimizer state,
      2 also the gradients, 3 also the parameters (gathered layer by layer for compute).
    - ``offload_optimizer``: keep the optimizer state (and the fp32 master weights) in CPU memory
      and step there (stages 1-3); ``offload_param``: keep parameter shards in CPU memory
      (stage 3 only). Pinned memory only on CUDA.
    - ``zero3_init``: under stage 3, build the model already partitioned (DeepSpeed's
      ``zero.Init``, rank 0 alone reading the checkpoint: :mod:`core_rl_deepspeed.partitioned_load`),
      so no rank holds the whole model; ``False`` has every rank load it whole first (for a model
      whose code does not build under ``zero.Init``). Ignored by stages 1 and 2.
    - ``mixed_precision``: ``bfloat16`` or ``float16``: compute and communicate in that dtype with
      fp32 master weights in the optimizer (fp16 with dynamic loss scaling); ``None``: compute in
      ``actor.dtype``.
    - ``overlap_comm``: overlap gradient reduction with backward (stages 2 and 3).
    - ``reduce_bucket_size``: elements per gradient-reduction bucket.
    - ``device``: where this rank computes: ``auto`` is ``cuda:LOCAL_RANK`` on a machine with CUDA,
      else the CPU; ``cpu`` keeps the engine on the CPU on a GPU machine too (with gloo), e.g. a
      small reference model beside a GPU actor, or a check against CPU arithmetic; ``cuda`` requires a GPU.
    - ``backend``: process-group backend used when the engine creates the group (as ``fsdp``).
    - ``attn_implementation``: as ``fsdp`` (``auto``: flash-attn on a GPU when installed and the forward
      computes in bfloat16 or float16, else SDPA).
    - ``shm_comm``: on CPU, let DeepSpeed build and use its shared-memory all-reduce extension
      (a C++ build of ~90 s on first use, cached under ``TORCH_EXTENSIONS_DIR``); ``False`` uses
      gloo, no compilation.
    - ``weight_bucket_mb``: with ``rollout.weight_sync: memory``, weights reach the rollout engine
      in buckets of about this size, each assembled on the device (as ``fsdp``).
    - ``config_overrides``: keys merged last into the generated DeepSpeed configuration (for
      settings not listed here; DeepSpeed validates them).
    - ``sequence_parallel_size``: as ``fsdp``'s (Ulysses, :mod:`core_rl_train_kit.ulysses`): each
      micro-batch's positions split over this many consecutive ranks; ZeRO still shards over all.
    """

    #: what this engine's models can output (:data:`core_rl.interfaces.HEADS`): an LM, or a value model
    heads: ClassVar[tuple[str, ...]] = ("lm", "value", "score")
    #: it honours a role's ``fused_head`` (:mod:`core_rl_train_kit.fused_head`)
    fused_head: ClassVar[bool] = True
    #: it computes a teacher's top-k log-probs and the policy's log-probs of given ids
    #: (``teacher.loss: topk_forward_kl``, :mod:`core_rl.config.teacher_checks`)
    topk_logprobs: ClassVar[bool] = True
    #: a role's ``trust_remote_code`` reaches its model and tokenizer loads (:mod:`core_rl.roles.remote_code`)
    loads_remote_code: ClassVar[bool] = True
    #: ``<role>.freeze`` reaches the model it builds (:mod:`core_rl.roles.freezing`)
    freezes_parameters: ClassVar[bool] = True
    #: it writes the LoRA adapter alone (``export_adapter``; ``rollout.lora_sync: adapter``, :mod:`core_rl.sync.lora`)
    exports_lora_adapter: ClassVar[bool] = True
    #: its forwards replay MoE routes (``actor.moe.routing_replay``, :mod:`core_rl_train_kit.moe`)
    replays_routes: ClassVar[bool] = True
    #: it takes prompts with images and their pixel inputs (vision-language models, :mod:`core_rl.vision`)
    multimodal: ClassVar[bool] = True

    zero_stage: int = attrs.field(default=2, validator=one_of((1, 2, 3)))
    offload_optimizer: bool = False
    offload_param: bool = False
    zero3_init: bool = True
    mixed_precision: str | None = attrs.field(default=None, validator=one_of(MIXED_DTYPES))
    overlap_comm: bool = False
    reduce_bucket_size: int = attrs.field(default=500_000_000, validator=positive())
    device: str = attrs.field(default="auto", validator=one_of(DEVICES))
    backend: str = attrs.field(default="auto", validator=one_of(BACKENDS))
    attn_implementation: str | None = "auto"
    shm_comm: bool = False
    weight_bucket_mb: float = attrs.field(default=512.0, validator=positive())
    config_overrides: dict[str, Any] = attrs.field(factory=dict)
    sequence_parallel_size: int = attrs.field(default=1, validator=positive())

    def __attrs_post_init__(self) -> None:
        if self.offload_param and self.zero_stage != 3:
            raise FieldValueError("offload_param", True, f"needs zero_stage: 3 (zero_stage is {self.zero_stage})")
        if self.overlap_comm and self.zero_stage < 2:
            raise FieldValueError("overlap_comm", True, f"needs zero_stage 2 or 3 (zero_stage is {self.zero_stage})")

    def compute_dtype(self, section: ActorConfig) -> str:
        """The dtype the forward computes activations in (``mixed_precision``, else the stored
        ``dtype``), for the ``auto`` micro-batch budget."""
        return self.mixed_precision or section.dtype

    def check_config(self, context: SectionContext) -> list[str]:
        """Settings of the run this engine cannot train with: flash-attn with a float32 forward."""
        role, section = context.role_section()
        problems = flash_attention.compute_dtype_problems(
            context,
            self.attn_implementation,
            self.compute_dtype(section or context.run.actor),
            dtype_keys=f"{role}.dtype, no mixed_precision",
            set_key="mixed_precision",
        ) + sequence_parallel_problems(context, self.sequence_parallel_size, self.attn_implementation, compile=False)
        optimizer = (section or context.run.actor).optimizer
        if optimizer.name in FLAT_REFUSED:
            problems.append(
                f"{role}.optimizer.name: {optimizer.name} needs each weight matrix whole (Muon orthogonalises it, "
                "Adafactor factors its second moment and scales its step by its RMS), but DeepSpeed ZeRO (every "
                "stage) hands the optimizer flat vectors of many parameters; use adamw, sgd or class, or the fsdp "
                "engine"
            )
        return problems

    def check_environment(self, context: EnvironmentContext) -> list[str]:
        """The device, the process count, float16 on a CPU, the attention implementation and the
        role's activation checkpointing against the machine."""
        from core_rl.roles.hf import activation_checkpointing_problems

        problems = context.machine.gpu_per_process_problems(context.path, self.device)
        if self.mixed_precision == "float16" and context.machine.runs_on_cpu(self.device) and not cpu_has_float16():
            problems.append(
                f"{context.key('mixed_precision')}: float16 on the CPU, which DeepSpeed refuses here (its CPU "
                "accelerator has float16 only where oneDNN does, and this CPU has not); use bfloat16, or a GPU"
            )
        problems += flash_attention.machine_problems(context, self.attn_implementation)
        problems += key_value_heads_problems(context, self.sequence_parallel_size)
        return problems + activation_checkpointing_problems(context) + fused_head_problems(context)


def cpu_has_float16() -> bool:
    """Whether DeepSpeed's CPU accelerator offers float16 on this machine: it asks oneDNN
    (``torch.ops.mkldnn._is_mkldnn_fp16_supported``), as probed here without importing DeepSpeed."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
