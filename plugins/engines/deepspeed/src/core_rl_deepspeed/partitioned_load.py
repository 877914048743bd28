"""Loading a Hugging Face model already partitioned for ZeRO-3.

Under ZeRO-3 each data-parallel rank keeps only its shard of every parameter. Loaded the ordinary
way, every rank would first build the whole model in host memory (``world_size`` full copies on a
node) and DeepSpeed would partition it afterwards. Loaded with :func:`load_partitioned`, transformers
builds the model under DeepSpeed's ``zero.Init`` (each parameter partitioned as it is created, on the
device ``offload_param`` names) and only rank 0 reads the checkpoint's values: it gathers one module's
parameters at a time, fills them and hands every rank its shard. The values are those of the ordinary
load (``tests/test_partitioned_load.py``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn


@contextlib.contextmanager
def zero3_loading(ds_config: Mapping[str, Any]) -> Iterator[None]:
    """Inside, transformers builds and loads models partitioned as ``ds_config`` says (it holds the
    configuration by a weak reference while it is alive); outside, as ordinary models again, so a
    later load in this process (a rollout engine, an engine of another kind) is not affected."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    held = HfDeepSpeedConfig(copy.deepcopy(dict(ds_config)))  # it may rewrite the mapping it parses
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del held


def load_partitioned(
    load: Callable[..., nn.Module],
    model_path: str,
    ds_config: Mapping[str, Any],
    *,
    head: str,
    dtype: str,
    attn_implementation: str | None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """``load(model_path, dtype=..., attn_implementation=..., trust_remote_code=...)`` (a loader of
    :func:`core_rl.roles.hf.loaders_for_head`) under :func:`zero3_loading`: every parameter of
    the returned model is a ZeRO-3 partition. A value or score head the directory does not hold is
    zeroed with its parameters gathered (``GatheredParameters``: written on rank 0, re-partitioned)."""
    import deepspeed

    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "attn_implementation": attn_implementation,
        "trust_remote_code": trust_remote_code,
    }
    if head != "lm":
        kwargs["gathered"] = lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    with zero3_loading(ds_config):
        return load(model_path, **kwargs)
