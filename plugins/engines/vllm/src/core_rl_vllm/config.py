"""The ``rollout.engine`` section of the ``vllm`` engine."""

from __future__ import annotations

from typing import ClassVar

import attrs
from core_rl.config.validators import in_range, non_negative, one_of, positive
from core_rl.remote import ServerOptions


@attrs.define
class VLLMConfig:
    """Options of the ``vllm`` rollout engine.

    ``server``: where servers come from and how requests behave (:class:`core_rl.remote.ServerOptions`).
    The rest are vLLM's own server options, passed through:

    - ``dtype`` (``--dtype``), ``max_model_len`` (context length; 0: the model's), ``max_num_seqs`` (requests
      running at once), ``seed``, ``enforce_eager``;
    - ``tensor_parallel_size``, ``data_parallel_size``;
    - ``kv_cache_space_gib`` (CPU: ``VLLM_CPU_KVCACHE_SPACE``) or ``gpu_memory_utilization`` (GPU);
    - ``attention_backend`` (``--attention-backend``; empty: vLLM's choice);
    - ``enable_prefix_caching``, ``enable_chunked_prefill``;
    - ``log_stats``: vLLM's per-step statistics and its periodic throughput log (off: ``--disable-log-stats``;
      the trainer logs rollout throughput itself, and the statistics cost the server CPU on every step);
    - ``extra_args``: appended verbatim to the server's command line.

    With ``rollout.sleep_while_training`` on, servers start with ``--enable-sleep-mode`` and sleep
    (level 2) while the trainer trains (:mod:`core_rl_vllm.engine`).
    """

    weight_sync_modes: ClassVar[tuple[str, ...]] = ("disk", "collective")
    #: the servers can sleep while the trainer trains (``rollout.sleep_while_training``)
    releases_memory: ClassVar[bool] = True

    server: ServerOptions = attrs.field(factory=ServerOptions)
    dtype: str = attrs.field(default="bfloat16", validator=one_of(("auto", "float32", "bfloat16", "float16")))
    max_model_len: int = attrs.field(default=0, validator=non_negative())
    max_num_seqs: int = attrs.field(default=64, validator=positive())
    seed: int = 0
    enforce_eager: bool = True
    tensor_parallel_size: int = attrs.field(default=1, validator=positive())
    data_parallel_size: int = attrs.field(default=1, validator=positive())
    kv_cache_space_gib: float = attrs.field(default=1.0, validator=positive())
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=in_range(0.0, 1.0, low_open=True))
    attention_backend: str = ""
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    log_stats: bool = False
    extra_args: list[str] = attrs.field(factory=list)
