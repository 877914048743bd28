"""Soft reference updates (``algorithm.reference_reset_alpha`` < 1): the weights of a new reference
mixed from the policy's and the current reference's safetensors files.

For every weight name ``k`` of the policy's export, with ``d`` the reference's dtype (the ``dtype``
of its role section: what its engine holds) and ``f32`` a cast to float32::

    new[k] = d( f32(alpha) * f32(policy[k]) + f32(1 - alpha) * f32(d(reference[k])) )   (floating k)
    new[k] = policy[k]                                                                   (any other)

``d(reference[k])`` is the reference exactly as its engine held it (a file in another dtype, e.g. the
original model's, is cast as the engine cast it when loading), the mix is computed in float32 (each
product and the sum rounded to float32, no fused operations), and the result is stored in ``d``, so
the next reference engine loads exactly these values. Non-floating tensors (integer buffers) come
from the policy. A policy weight the reference's files lack, or of another shape, is an error.

Both sides are read tensor by tensor from memory-mapped files (``safetensors.safe_open``): the host
holds the mixed tensors of one output file (at most one model in ``d``) plus one tensor of each input.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from core_rl.errors import CoreRLError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(directory: Path) -> dict[str, Path]:
    """Each weight name of the Hugging Face directory ``directory`` -> the safetensors file holding it
    (``model.safetensors``, or the files ``model.safetensors.index.json`` maps names to); a
    :class:`~core_rl.errors.CoreRLError` when it holds neither."""
    from safetensors import safe_open

    index = directory / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise CoreRLError(f"{directory} holds no safetensors weights ({SINGLE_FILE} or {INDEX_FILE})")


def weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Each weight name of ``directory`` (:func:`weight_files`) -> its shape, read from the
    safetensors headers alone (no tensor is loaded)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_files(directory).items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in names})
    return shapes


def mismatch(policy_dir: Path, reference_dir: Path) -> str | None:
    """Why the policy of ``policy_dir`` cannot be mixed with the reference of ``reference_dir``: the
    first policy weight the reference lacks or holds in another shape (``None``: none)."""
    reference = weight_shapes(reference_dir)
    for name, shape in weight_shapes(policy_dir).items():
        if name not in reference:
            return f"the policy's weight {name!r} is not in the reference {reference_dir}"
        if reference[name] != shape:
            return (
                f"the policy's weight {name!r} has shape {shape}, the reference's in {reference_dir} {reference[name]}"
            )
    return None


def mix_tensor(policy: torch.Tensor, reference: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """``d(f32(alpha) * f32(policy) + f32(1 - alpha) * f32(d(reference)))`` with ``d`` = ``dtype`` for a
    floating ``policy``; ``policy`` itself otherwise (see the module docstring)."""
    if not policy.is_floating_point():
        return policy
    a = torch.tensor(alpha, dtype=torch.float32)
    b = torch.tensor(1.0 - alpha, dtype=torch.float32)
    ref = reference.to(dtype).to(torch.float32)
    return (a * policy.to(torch.float32) + b * ref).to(dtype)


def mix_into(policy_dir: Path, reference_dir: Path, alpha: float, dtype: torch.dtype) -> None:
    """Rewrite the safetensors weights of the Hugging Face directory ``policy_dir`` (the policy's
    export, not yet in place) as the mix with the reference in ``reference_dir`` (see the module
    docstring); each file is replaced by a complete new one (written beside it, then renamed). The
    other files of ``policy_dir`` (config, tokenizer) are kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    previous = weight_files(reference_dir)
    files = sorted(set(weight_files(policy_dir).values()))
    sizes: dict[str, int] = {}
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}
        for file in files:
            mixed: dict[str, torch.Tensor] = {}
            with safe_open(str(file), framework="pt") as policy:
                metadata = policy.metadata()
                for name in policy.keys():
                    if name not in previous:
                        raise CoreRLError(
                            f"algorithm.reference_reset_alpha: the policy's weight {name!r} is not in the reference "
                            f"{reference_dir}; soft updates need the same model in both (set reference_reset_alpha: 1)"
                        )
                    source = previous[name]
                    if source not in opened:
                        opened[source] = stack.enter_context(safe_open(str(source), framework="pt"))
                    p, r = policy.get_tensor(name), opened[source].get_tensor(name)
                    if p.shape != r.shape:
                        raise CoreRLError(
                            f"algorithm.reference_reset_alpha: the policy's weight {name!r} has shape "
                            f"{tuple(p.shape)}, the reference's in {reference_dir} {tuple(r.shape)}; soft updates "
                            "need the same model in both (set reference_reset_alpha: 1)"
                        )
                    mixed[name] = mix_tensor(p, r, alpha, dtype)
            sizes.update({name: t.numel() * t.element_size() for name, t in mixed.items()})
            tmp = file.with_name(f".{file.name}.mixing")
            save_file(mixed, str(tmp), metadata=metadata)
            os.replace(tmp, file)
            del mixed
    index = policy_dir / INDEX_FILE
    if index.is_file():  # its total size follows the stored dtype
        content = json.loads(index.read_text())
        content.setdefault("metadata", {})["total_size"] = sum(sizes.values())
        index.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
