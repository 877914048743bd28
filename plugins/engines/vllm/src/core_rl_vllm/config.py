"""The ``rollout.engine`` section of the ``vllm`` engine."""

from __future__ import annotations

from typing import ClassVar

import attrs
from core_rl.config.checks import SectionContext
from core_rl.config.schema import AutoBool
from core_rl.config.validators import in_range, non_negative, one_of, positive
from core_rl.errors import CoreRLError
from core_rl_server_kit.remote import ServerOptions

from core_rl_vllm.lora import max_lora_rank

#: ``gpu_memory_utilization`` of a server on GPUs of its own (vLLM's default), and the most one on
#: the trainer's GPU takes
GPU_MEMORY_UTILIZATION = 0.9
#: the least share worth starting a colocated server with
MIN_COLOCATED_UTILIZATION = 0.05


@attrs.define
class VLLMConfig:
    """Options of the ``vllm`` rollout engine.

    ``server``: where servers come from and how requests behave (:class:`core_rl_server_kit.remote.ServerOptions`).
    The rest are vLLM's own server options, passed through:

    - ``dtype`` (``--dtype``), ``max_model_len`` (context length; 0: the model's), ``max_num_seqs`` (requests
      running at once; 0: vLLM's own default, which it sizes by device: 128 per rank on CPU, 256-1024 on a
      GPU by its memory), ``seed``;
    - ``enforce_eager`` (``auto``: eager on CPU, where vLLM's compiled graph added ~20 s to the tiny
      model's start and generated no faster; on a GPU vLLM's compiled model with CUDA graphs, which a
      weight update leaves valid: ``reload_weights`` copies into the tensors the graphs captured);
    - ``tensor_parallel_size``, ``data_parallel_size``;
    - ``kv_cache_space_gib`` (CPU: ``VLLM_CPU_KVCACHE_SPACE``) or ``gpu_memory_utilization`` (GPU: the
      share of the GPU's memory a server takes; 0, the default: :data:`GPU_MEMORY_UTILIZATION` on
      GPUs of its own, on the trainer's GPU what the trainer leaves, :meth:`with_colocated_memory`);
    - ``attention_backend`` (``--attention-backend``; empty: vLLM's choice);
    - ``enable_prefix_caching``, ``enable_chunked_prefill``;
    - ``log_stats``: vLLM's per-step statistics and its periodic throughput log (off: ``--disable-log-stats``;
      the trainer logs rollout throughput itself, and the statistics cost the server CPU on every step);
    - ``extra_args``: appended verbatim to the server's command line.

    With ``rollout.sleep_while_training`` on, servers start with ``--enable-sleep-mode`` and sleep
    (level 2) while the trainer trains (:mod:`core_rl_vllm.engine`).
    """

    weight_sync_modes: ClassVar[tuple[str, ...]] = ("disk", "collective")
    #: requests carry ``rollout.sampling.extra`` to the server as they are
    #: (:func:`core_rl.interfaces.sampling.with_extra`)
    sampling_extra: ClassVar[bool] = True
    #: what the engine sets in its requests itself; ``rollout.sampling.extra`` may not name them
    request_keys: ClassVar[frozenset[str]] = frozenset(
        {
            *("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "logprobs", "stop"),
            *("repetition_penalty", "frequency_penalty", "presence_penalty", "stop_token_ids", "detokenize"),
            *("skip_special_tokens", "include_stop_str_in_output", "model", "prompt", "return_token_ids"),
            "structured_outputs",
        }
    )
    #: the servers can sleep while the trainer trains (``rollout.sleep_while_training``)
    releases_memory: ClassVar[bool] = True
    #: the server stops at rollout.sampling.stop strings itself (core_rl.rollout.stop_strings)
    stop_strings: ClassVar[bool] = True
    #: ``actor.trust_remote_code`` reaches its servers (``--trust-remote-code``; :mod:`core_rl.roles.remote_code`)
    loads_remote_code: ClassVar[bool] = True
    #: its servers load LoRA adapters (``rollout.lora_sync: adapter``: the factory's ``lora_rank``,
    #: :mod:`core_rl_vllm.lora`)
    serves_lora_adapters: ClassVar[bool] = True
    #: prompts with images (a vision-language model's ``media``: ``/core_rl/generate``, :mod:`core_rl_vllm.engine`)
    multimodal: ClassVar[bool] = True

    server: ServerOptions = attrs.field(factory=ServerOptions)
    dtype: str = attrs.field(default="bfloat16", validator=one_of(("auto", "float32", "bfloat16", "float16")))
    max_model_len: int = attrs.field(default=0, validator=non_negative())
    max_num_seqs: int = attrs.field(default=0, validator=non_negative())
    seed: int = 0
    enforce_eager: AutoBool = "auto"
    tensor_parallel_size: int = attrs.field(default=1, validator=positive())
    data_parallel_size: int = attrs.field(default=1, validator=positive())
    kv_cache_space_gib: float = attrs.field(default=1.0, validator=positive())
    gpu_memory_utilization: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    attention_backend: str = ""
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    log_stats: bool = False
    extra_args: list[str] = attrs.field(factory=list)

    def check_config(self, context: SectionContext) -> list[str]:
        """With ``rollout.lora_sync: adapter``, ``actor.lora.rank`` must be one vLLM can serve."""
        run = context.run
        if run.rollout.lora_sync != "adapter" or not run.actor.lora.enabled:
            return []
        try:
            max_lora_rank(run.actor.lora.rank)
        except ValueError as exc:
            return [
                f"actor.lora.rank: {exc} (rollout.lora_sync: adapter); use a smaller rank, or rollout.lora_sync: merged"
            ]
        return []

    def gpus_per_server(self) -> int:
        """The GPUs one server takes (``rollout.engine.server.gpus`` gives each this many)."""
        return self.tensor_parallel_size * self.data_parallel_size

    def with_colocated_memory(self, budget_bytes: int, total_bytes: int) -> tuple[VLLMConfig, str | None]:
        """This config for servers on the trainer's GPU, where each may take ``budget_bytes`` of
        the ``total_bytes`` a GPU has (:attr:`core_rl.rollout.colocated_memory.SharedGPU.budget`): vLLM
        starts only if the GPU has ``gpu_memory_utilization x total`` free, and takes that much. An
        explicit figure is kept; 0 becomes ``budget / total`` (at most
        :data:`GPU_MEMORY_UTILIZATION`), with the note saying so."""
        if self.gpu_memory_utilization:
            return self, None
        share = min(GPU_MEMORY_UTILIZATION, budget_bytes / total_bytes)
        key = "rollout.engine.gpu_memory_utilization"
        gib, total_gib = max(budget_bytes, 0) / 2**30, total_bytes / 2**30
        if share < MIN_COLOCATED_UTILIZATION:
            raise CoreRLError(
                f"{key}: 0 (auto), but on the trainer's GPU a server may take {gib:.1f} GiB of {total_gib:.1f}; give "
                "the servers GPUs of their own (placement.mode: split), make the trainer smaller (offload, a smaller "
                f"model), or set {key} yourself"
            )
        share = int(share * 1000) / 1000  # rounded down: the budget is an upper bound
        note = f"{key}: auto -> {share:g} ({gib:.1f} GiB of {total_gib:.1f} on the trainer's GPU, per server)"
        return attrs.evolve(self, gpu_memory_utilization=share), note
