"""The ``rollout.engine`` section of the ``sglang`` engine."""

from __future__ import annotations

from typing import ClassVar

import attrs
from core_rl.config.validators import in_range, non_negative, one_of, positive
from core_rl_server_kit.remote import ServerOptions


@attrs.define
class SGLangConfig:
    """Options of the ``sglang`` rollout engine.

    ``server``: where servers come from and how requests behave (:class:`core_rl_server_kit.remote.ServerOptions`).
    The rest are SGLang's own server options, passed through:

    - ``dtype``, ``context_length`` (0: the model's), ``max_running_requests`` (0: SGLang's own sizing from
      its KV cache), ``random_seed``;
    - ``tp_size``, ``dp_size``;
    - ``mem_fraction_static`` (0: 0.3 on CPU, SGLang's default on GPU) and ``max_total_tokens``
      (KV-cache tokens; 0: 8192 on CPU, SGLang's sizing from the memory fraction on GPU, which a
      cap would cut short). On CPU the fraction is of free RAM and SGLang fails when free RAM falls
      by more than it while the server loads (other processes allocating), so the CPU default
      leaves a wide margin, and ``max_total_tokens`` sizes the KV cache;
    - ``attention_backend`` and ``sampling_backend`` (empty: ``torch_native`` and ``pytorch`` on
      CPU, SGLang's choice on GPU);
    - ``enable_prefix_caching`` (false: ``--disable-radix-cache``), ``chunked_prefill_size``
      (0: SGLang's default; -1: off), ``disable_overlap_schedule`` (always on CPU);
    - ``sleep_on_idle`` (default true: ``--sleep-on-idle``): the scheduler waits on its sockets
      while it has nothing to run (it wakes when a request arrives). SGLang's own default polls
      them in a loop, one busy core per server for as long as it lives: measured on CPU, 1.00
      core idle against 0.02, and 0.39 against 0.28 server CPU seconds per synchronous step of
      ``benchmarks/async.py --engine sglang``, where the trainer's phases leave the server idle;
    - ``update_bucket_mb``: a collective weight update reaches each server in requests of about
      this many MiB of weights each (SGLang allocates every tensor of a request before it loads
      them, so one request would hold a second copy of the model); 0: one request.
    - ``extra_args``: appended verbatim to the server's command line.
    - ``sync_check_elements``: the weight sync check (``rollout.sync_check``) reads back at most
      about this many parameter elements per check (0: every tensor the update sent). SGLang's
      read-back route converts a whole parameter to a Python list, ~0.15 us an element on a CPU:
      all of a 135M model took 18-22 s a sync. Each check takes a different share of the tensors
      (drawn from the version), so a tensor the updates keep missing is found within a few syncs.

    With ``rollout.sleep_while_training`` on, servers start with ``--enable-memory-saver`` and give
    back their memory while the trainer trains (:mod:`core_rl_sglang.engine`).
    """

    weight_sync_modes: ClassVar[tuple[str, ...]] = ("disk", "collective")
    #: requests carry ``rollout.sampling.extra`` to the server as they are
    #: (:func:`core_rl.interfaces.sampling.with_extra`)
    sampling_extra: ClassVar[bool] = True
    #: what the engine sets in its requests' sampling parameters itself; ``rollout.sampling.extra`` may not name them
    request_keys: ClassVar[frozenset[str]] = frozenset(
        {
            *("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop"),
            *("repetition_penalty", "frequency_penalty", "presence_penalty", "stop_token_ids"),
            *("skip_special_tokens", "no_stop_trim", "json_schema"),
        }
    )
    #: the servers can give back their memory while the trainer trains (``rollout.sleep_while_training``)
    releases_memory: ClassVar[bool] = True
    #: the server stops at rollout.sampling.stop strings itself (core_rl.rollout.stop_strings) when
    #: ``min_new_tokens`` is 0 and no stop string is part of a special token (its own rule differs)
    stop_strings: ClassVar[bool] = True
    #: a mixture-of-experts model's samples carry the experts each token was routed to, as the
    #: servers return them (``rollout.return_routed_experts``: ``--enable-return-routed-experts``)
    returns_routed_experts: ClassVar[bool] = True
    #: ``actor.trust_remote_code`` reaches its servers (``--trust-remote-code``; :mod:`core_rl.roles.remote_code`)
    loads_remote_code: ClassVar[bool] = True
    #: its servers load LoRA adapters (``rollout.lora_sync: adapter``: the factory's ``lora_rank``,
    #: :mod:`core_rl_sglang.lora`)
    serves_lora_adapters: ClassVar[bool] = True
    #: prompts with images (a vision-language model's ``media``: ``/core_rl/generate``, :mod:`core_rl_sglang.engine`)
    multimodal: ClassVar[bool] = True

    server: ServerOptions = attrs.field(factory=ServerOptions)
    sync_check_elements: int = attrs.field(default=4_000_000, validator=non_negative())
    dtype: str = attrs.field(default="bfloat16", validator=one_of(("auto", "float32", "bfloat16", "float16")))
    context_length: int = attrs.field(default=0, validator=non_negative())
    max_running_requests: int = attrs.field(default=0, validator=non_negative())
    random_seed: int = 0
    tp_size: int = attrs.field(default=1, validator=positive())
    dp_size: int = attrs.field(default=1, validator=positive())
    mem_fraction_static: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    max_total_tokens: int = attrs.field(default=0, validator=non_negative())
    attention_backend: str = ""
    sampling_backend: str = ""
    enable_prefix_caching: bool = True
    chunked_prefill_size: int = 0
    disable_overlap_schedule: bool = False
    sleep_on_idle: bool = True
    update_bucket_mb: float = attrs.field(default=512.0, validator=non_negative())
    extra_args: list[str] = attrs.field(factory=list)

    def gpus_per_server(self) -> int:
        """The GPUs one server takes (``rollout.engine.server.gpus`` gives each this many)."""
        return self.tp_size * self.dp_size
