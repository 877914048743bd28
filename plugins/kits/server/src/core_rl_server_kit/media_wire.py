"""Pixel inputs as JSON, for an inference server in its own environment.

A prompt's pixel inputs (:attr:`core_rl.protocol.Sample.media`: ``pixel_values``,
``image_grid_thw``) travel as ``{key: {"dtype": "float32", "shape": [...], "data": base64 of the
little-endian bytes}}`` (:func:`encode_tensors`), decoded back to the same tensors on the server
(:func:`decode_tensors`). This module imports only the standard library at load time (torch and
numpy where it encodes or decodes), so a server-side file can load it by its path without core-rl
installed."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any


def encode_tensors(media: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each tensor of ``media`` as its dtype, shape and base64 little-endian bytes (taken on the CPU,
    contiguous; bfloat16, which numpy lacks, as float32: exact)."""
    import torch

    out = {}
    for key, tensor in media.items():
        t = tensor.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            t = t.float()
        array = t.numpy()
        out[key] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": base64.b64encode(array.astype(array.dtype.newbyteorder("<")).tobytes()).decode(),
        }
    return out


def decode_tensors(encoded: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The tensors :func:`encode_tensors` encoded, by key."""
    import numpy as np
    import torch

    out = {}
    for key, value in encoded.items():
        raw = base64.b64decode(value["data"])
        array = np.frombuffer(raw, dtype=np.dtype(value["dtype"]).newbyteorder("<")).reshape(value["shape"])
        out[key] = torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))
    return out
