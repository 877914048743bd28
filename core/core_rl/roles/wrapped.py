"""The Hugging Face model inside the wrappers engines put around it (torch alone: the protocol's
media helpers import it)."""

from __future__ import annotations

from torch import nn


def inner_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside engine wrappers: DeepSpeed's engine (``.module``) and peft's
    (``get_base_model()``); ``model`` itself when it is not wrapped (FSDP2 wraps in place). Its
    ``config``, ``forward`` signature and submodules are the model's own (DeepSpeed's engine has a
    ``config`` of its own)."""
    inner = model
    while True:
        if isinstance(getattr(inner, "module", None), nn.Module):
            wrapped = inner.module
        elif callable(getattr(inner, "get_base_model", None)):
            wrapped = inner.get_base_model()
        else:
            return inner
        if wrapped is inner:
            return inner
        inner = wrapped
