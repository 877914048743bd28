"""The ``actor.engine`` section of the ``fsdp`` train engine (every key except ``name``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import attrs
from core_rl.config import flash_attention
from core_rl.config.fused_head import fused_head_problems
from core_rl.config.sequence_parallel import key_value_heads_problems, sequence_parallel_problems
from core_rl.config.validators import one_of, positive

if TYPE_CHECKING:
    from core_rl.config.checks import EnvironmentContext, SectionContext
    from core_rl.config.schema import ActorConfig

#: dtypes accepted by ``param_dtype`` / ``reduce_dtype``
MIXED_DTYPES = ("float32", "bfloat16", "float16")
#: dtypes accepted by ``autocast_dtype``
AUTOCAST_DTYPES = ("bfloat16",)
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")  # core_rl.launch.distributed.pick_device
WRAPS = ("decoder_layers", "root")


@attrs.define
class FSDPConfig:
    """Options of the FSDP2 engine.

    - ``wrap``: ``decoder_layers`` applies ``fully_shard`` to every decoder layer (the classes the
      model lists in ``_no_split_modules``) and then to the root, so one layer is unsharded at a
      time; ``root`` shards the model as a single unit.
    - ``reshard_after_forward``: free the unsharded parameters after each unit's forward (ZeRO-3
      style, least memory); ``False`` keeps them until backward (ZeRO-2 style, less communication).
    - ``param_dtype`` / ``reduce_dtype``: FSDP2 ``MixedPrecisionPolicy``: the dtype parameters are
      all-gathered and computed in, and the dtype gradients are reduced in. ``None`` (both) means no
      mixed precision: compute in the stored dtype (``actor.dtype``).
    - ``autocast_dtype``: run the forward passes (log-probs and training) under ``torch.autocast``
      in this dtype: matrix products and attention in ``bfloat16``, reductions and normalisations
      in float32, weights, gradients and optimizer state in their stored dtype (what Hugging Face
      ``Trainer``'s ``bf16=True`` does, TRL's GRPO default). No FSDP wrapping is needed for it, so a
      one-rank run keeps the plain module. ``None`` (default): no autocast; results then match a
      float32 forward exactly. Log-probs and entropies are still computed from float32 logits.
    - ``cpu_offload``: keep sharded parameters, gradients and optimizer state in CPU memory
      (``CPUOffloadPolicy``; pinned memory only on CUDA).
    - ``device``: where this rank computes: ``auto`` is ``cuda:LOCAL_RANK`` on a machine with CUDA,
      else the CPU; ``cpu`` keeps the engine on the CPU on a GPU machine too (with gloo), e.g. a
      small reference model beside a GPU actor, or a check against CPU arithmetic; ``cuda`` requires a GPU.
    - ``backend``: process-group backend used when the engine creates the group: ``auto`` is NCCL
      for CUDA tensors plus gloo for CPU tensors on a GPU machine, and gloo on CPU.
    - ``attn_implementation``: passed to ``from_pretrained`` (e.g. ``sdpa``, ``eager``,
      ``flash_attention_2``); ``auto`` is ``flash_attention_2`` on a GPU with flash-attn installed
      (``pip install "core-rl-fsdp[flash-attn]"``) when the forward computes in bfloat16 or float16
      (``param_dtype``, ``autocast_dtype`` or ``actor.dtype``; flash-attn has no float32 kernels, and
      asked for by name it is refused in float32), else ``sdpa``, except on a CPU with
      ``autocast_dtype`` set, where it is ``sdpa_float32`` (:mod:`core_rl_train_kit.attention`: SDPA in
      float32 inside the autocast region, whose bfloat16 backward is slow on CPU); ``None`` keeps
      the transformers default.
    - ``load_on_rank0``: with several ranks, only rank 0 reads the weights; the others build the
      model on the meta device and receive just their shards (memory-efficient loading). ``False``:
      every rank reads the full weights before sharding.
    - ``shard_single_rank``: with one rank and neither mixed precision nor CPU offload, FSDP has
      nothing to shard or reduce, yet its hooks, DTensor parameters and copies cost more than the
      step's compute on a small model; so by default such a run trains the plain module (same
      parameters, same gradients, same optimizer). ``True`` wraps it with ``fully_shard`` anyway.
    - ``weight_bucket_mb``: with ``rollout.weight_sync: memory``, weights reach the rollout engine
      in buckets of about this size, each gathered on the device (with several ranks every rank
      holds one bucket's full tensors at a time; with one rank buckets are the parameters themselves).
    - ``compile``: ``torch.compile`` the model (inductor, dynamic shapes; the whole plain module of
      a one-rank run, else each FSDP unit). It fuses the element-wise work around the matrix
      products (norms, rotary embeddings, activations, autocast casts). The first forward of each
      mode (training, log-probs) pays the compilation: 30-50 s for a 3M-parameter model on a
      2-core CPU (inductor caches it across runs). There a bare micro-batch forward/backward took
      25% less time afterwards, a whole update 9-13% less, and peak memory rose by 90-170 MiB.
      Results differ from eager ones by float rounding (fused kernels), and stay deterministic for
      a seed. Needs a C++ compiler on CPU (inductor).
    - ``sequence_parallel_size``: split each micro-batch's positions over this many consecutive
      ranks (Ulysses: :mod:`core_rl_train_kit.ulysses`), for sequences too long for one device's
      activation memory. The ranks of a group pool their rows and run every micro-batch together,
      each on ``1/n`` of its positions; around attention, two all-to-alls per layer exchange
      positions for heads. It must divide the number of ranks and the model's key/value heads;
      ``max_tokens_per_mb`` then counts the tokens of one rank's slice. Parameters stay sharded
      over all ranks. Values equal a single rank's forward up to float rounding.
    """

    #: the model heads this engine builds (:data:`core_rl.interfaces.HEADS`): a critic needs ``value``
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

    wrap: str = attrs.field(default="decoder_layers", validator=one_of(WRAPS))
    reshard_after_forward: bool = True
    param_dtype: str | None = attrs.field(default=None, validator=one_of(MIXED_DTYPES))
    reduce_dtype: str | None = attrs.field(default=None, validator=one_of(MIXED_DTYPES))
    autocast_dtype: str | None = attrs.field(default=None, validator=one_of(AUTOCAST_DTYPES))
    cpu_offload: bool = False
    device: str = attrs.field(default="auto", validator=one_of(DEVICES))
    backend: str = attrs.field(default="auto", validator=one_of(BACKENDS))
    attn_implementation: str | None = "auto"
    load_on_rank0: bool = True
    shard_single_rank: bool = False
    compile: bool = False
    weight_bucket_mb: float = attrs.field(default=512.0, validator=positive())
    sequence_parallel_size: int = attrs.field(default=1, validator=positive())

    def compute_dtype(self, section: ActorConfig) -> str:
        """The dtype the forward computes activations in (``param_dtype``, else ``autocast_dtype``,
        else the stored ``dtype``), for the ``auto`` micro-batch budget."""
        return self.param_dtype or self.autocast_dtype or section.dtype

    def check_config(self, context: SectionContext) -> list[str]:
        """Settings of the run this engine cannot train with."""
        actor = context.run.actor
        if actor.dtype == "float16" and actor.optimizer.name in ("adamw", "muon"):
            return [
                f"actor.dtype: float16 weights with {actor.optimizer.name} turn to NaN at the first optimizer step "
                "(eps and small squared gradients underflow in float16, and no loss scaling is applied); use bfloat16 "
                "or float32 "
                f"({context.key('param_dtype')} sets the compute dtype separately)"
            ]
        role, section = context.role_section()
        problems = flash_attention.compute_dtype_problems(
            context,
            self.attn_implementation,
            self.compute_dtype(section or actor),
            dtype_keys=f"{role}.dtype, no param_dtype or autocast_dtype",
            set_key="param_dtype",
        )
        if self.compile and section is not None and section.fused_head:
            # the fused head replaces the head's forward around each call: a compiled model
            # would be guarded on it and recompiled every micro-batch (an untested combination)
            problems.append(
                f"{context.key('compile')}: true with {role}.fused_head: true, which compiled models do not "
                "support; set one of them to false"
            )
        problems += sequence_parallel_problems(
            context, self.sequence_parallel_size, self.attn_implementation, compile=self.compile
        )
        sharding = [k for k in ("param_dtype", "reduce_dtype", "cpu_offload", "shard_single_rank") if getattr(self, k)]
        if (section or actor).optimizer.name == "muon" and sharding:
            problems.append(
                f"{role}.optimizer.name: muon needs whole weight matrices, but {context.key(sharding[0])} makes FSDP "
                "shard them (DTensor parameters, even on one rank); remove it, or use adamw"
            )
        return problems

    def check_environment(self, context: EnvironmentContext) -> list[str]:
        """The backend, attention implementation and process count against the machine."""
        machine = context.machine
        problems = []
        if self.backend == "nccl" and not machine.cuda_available:
            problems.append(
                f"{context.key('backend')}: nccl needs CUDA GPUs and this machine has none "
                "(torch.cuda.is_available() is False); use auto or gloo"
            )
        from core_rl.roles.hf import activation_checkpointing_problems

        problems += fused_head_problems(context)
        problems += machine.gpu_per_process_problems(context.path, self.device)
        problems += activation_checkpointing_problems(context)
        problems += flash_attention.machine_problems(context, self.attn_implementation)
        problems += key_value_heads_problems(context, self.sequence_parallel_size)
        role, section = context.role_section()
        if section is not None and section.optimizer.name == "muon" and machine.processes > 1:
            problems.append(
                f"{role}.optimizer.name: muon needs whole weight matrices, but FSDP shards them over the "
                f"{machine.processes} processes of this run; run one process, or use adamw"
            )
        return problems
