"""The ``actor.engine`` section of the ``fsdp`` train engine (every key except ``name``)."""

from __future__ import annotations

import attrs
from core_rl.config.validators import one_of

#: dtypes accepted by ``param_dtype`` / ``reduce_dtype``
MIXED_DTYPES = ("float32", "bfloat16", "float16")
BACKENDS = ("auto", "gloo", "nccl")
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
    - ``cpu_offload``: keep sharded parameters, gradients and optimizer state in CPU memory
      (``CPUOffloadPolicy``; pinned memory only on CUDA).
    - ``backend``: process-group backend used when the engine creates the group: ``auto`` is NCCL
      for CUDA tensors plus gloo for CPU tensors on a GPU machine, and gloo on CPU.
    - ``attn_implementation``: passed to ``from_pretrained`` (e.g. ``sdpa``, ``eager``,
      ``flash_attention_2``); ``auto`` is ``flash_attention_2`` on a GPU with flash-attn installed
      (``pip install "core-rl-fsdp[flash-attn]"``), else ``sdpa``; ``None`` keeps the transformers
      default.
    - ``load_on_rank0``: with several ranks, only rank 0 reads the weights; the others build the
      model on the meta device and receive just their shards (memory-efficient loading). ``False``:
      every rank reads the full weights before sharding.
    """

    wrap: str = attrs.field(default="decoder_layers", validator=one_of(WRAPS))
    reshard_after_forward: bool = True
    param_dtype: str | None = attrs.field(default=None, validator=one_of(MIXED_DTYPES))
    reduce_dtype: str | None = attrs.field(default=None, validator=one_of(MIXED_DTYPES))
    cpu_offload: bool = False
    backend: str = attrs.field(default="auto", validator=one_of(BACKENDS))
    attn_implementation: str | None = "auto"
    load_on_rank0: bool = True
