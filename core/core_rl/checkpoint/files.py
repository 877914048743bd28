"""Safe, atomic checkpoint files: what every train engine and the trainer use to save state.

**Atomic directories.** A checkpoint directory is written beside its final place and moved there
only when complete (:mod:`core_rl.checkpoint.atomic`, whose functions this module re-exports).

**Nothing executes on load.** Tensors are stored with safetensors; everything else is JSON. A state
*tree* (nested dicts, lists, tuples, numbers, strings, booleans, ``None`` and tensors, e.g. an
optimizer state dict or the RNG states) is written by :func:`save_tree` as ``NAME.safetensors`` (its
tensors, keyed by their path in the tree) plus ``NAME.json`` (the tree with each tensor replaced by a
reference) and read back by :func:`load_tree`, which never unpickles anything. Besides those, a tree
may hold the plain metadata real optimizers keep in their state dicts: ``torch.dtype``,
``torch.device``, ``torch.Size`` and members of :class:`enum.Enum` classes (restored only from a
module the loading process has already imported, so loading imports and runs nothing).
"""

from __future__ import annotations

import enum
import json
import math
import random
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

# the atomic writes, re-exported: engines and the trainer write checkpoints through this module
from core_rl.checkpoint.atomic import commit_partial as commit_partial
from core_rl.checkpoint.atomic import discard_partial as discard_partial
from core_rl.checkpoint.atomic import partial_path as partial_path
from core_rl.checkpoint.atomic import prepare_partial as prepare_partial
from core_rl.checkpoint.atomic import write_text_atomic as write_text_atomic
from core_rl.errors import CoreRLError

# JSON encoding of what JSON cannot hold directly
_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_ITEMS = "__items__"  # a dict with non-string keys, as [key, value] pairs
_FLOAT = "__float__"  # nan, inf, -inf
_DTYPE = "__dtype__"  # torch.float32 -> "float32"
_DEVICE = "__device__"  # torch.device("cuda", 0) -> "cuda:0"
_SIZE = "__size__"  # torch.Size([2, 3]) -> [2, 3]
_ENUM = "__enum__"  # an enum member -> ["module", "Qual.Name", "MEMBER"]
_MARKERS = frozenset({_TENSOR, _TUPLE, _ITEMS, _FLOAT, _DTYPE, _DEVICE, _SIZE, _ENUM})


class CheckpointFormatError(ValueError):
    """A checkpoint file does not hold what :func:`load_tree` expects (corrupt or foreign)."""


class OptimizerStateLeftOut(CoreRLError):
    """A resume asked for the optimizer state of a checkpoint saved without it
    (``saver.save_optimizer: false``; :func:`core_rl_train_kit.state.restores_optimizer`)."""


# --------------------------------------------------------------------------------------------
# state trees: safetensors + JSON


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = path or "<root>"
        # safetensors needs contiguous tensors that share no storage
        tensors[key] = value.detach().to("cpu").contiguous().clone()
        return {_TENSOR: key}
    if isinstance(value, enum.Enum):  # before int/str: IntEnum and StrEnum members are ints and strings too
        cls = type(value)
        return {_ENUM: [cls.__module__, cls.__qualname__, value.name]}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {_DEVICE: str(value)}
    if isinstance(value, torch.Size):
        return {_SIZE: list(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else {_FLOAT: repr(value)}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not (_MARKERS & set(value)):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
        return {
            _ITEMS: [
                [_encode(k, f"{path}/#key{i}", tensors), _encode(v, f"{path}/#{i}", tensors)]
                for i, (k, v) in enumerate(value.items())
            ]
        }
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    raise TypeError(
        f"cannot store {type(value).__name__} at {path or '<root>'} in a checkpoint: only dicts, lists, "
        "tuples, numbers, strings, booleans, None, tensors, torch dtypes, devices and sizes, and enum members "
        "are allowed"
    )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        key = value[_TENSOR]
        if key not in tensors:
            raise CheckpointFormatError(f"{where}: tensor {key!r} is missing from the safetensors file")
        return tensors[key]
    if _TUPLE in value:
        return tuple(_decode(v, tensors, where) for v in value[_TUPLE])
    if _ITEMS in value:
        return {_hashable(_decode(k, tensors, where)): _decode(v, tensors, where) for k, v in value[_ITEMS]}
    if _FLOAT in value:
        return float(value[_FLOAT])
    if _DTYPE in value:
        dtype = getattr(torch, str(value[_DTYPE]), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointFormatError(f"{where}: {value[_DTYPE]!r} is not a torch dtype")
        return dtype
    if _DEVICE in value:
        return torch.device(value[_DEVICE])
    if _SIZE in value:
        return torch.Size(value[_SIZE])
    if _ENUM in value:
        return _enum_member(value[_ENUM], where)
    return {k: _decode(v, tensors, where) for k, v in value.items()}


def _enum_member(ref: list[str], where: str) -> enum.Enum:
    """The enum member ``ref`` (module, qualified class name, member name) names, from a module
    this process has already imported: loading a checkpoint never imports (runs) code."""
    module_name, qualname, member = ref
    owner: Any = sys.modules.get(module_name)
    if owner is None:
        raise CheckpointFormatError(
            f"{where}: holds a member of {module_name}.{qualname}, but {module_name} is not imported; "
            "import it before loading this checkpoint"
        )
    for part in qualname.split("."):
        owner = getattr(owner, part, None)
    if not (isinstance(owner, type) and issubclass(owner, enum.Enum) and member in owner.__members__):
        raise CheckpointFormatError(f"{where}: {module_name}.{qualname}.{member} is not an enum member")
    return owner[member]


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def save_tree(directory: Path, name: str, tree: Any) -> None:
    """Write ``tree`` as ``directory/name.json`` (+ ``directory/name.safetensors`` when it holds
    tensors). See the module docstring for what a tree may contain."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(tree, "", tensors)
    directory.mkdir(parents=True, exist_ok=True)
    if tensors:
        save_file(tensors, str(directory / f"{name}.safetensors"))
    (directory / f"{name}.json").write_text(json.dumps(skeleton), encoding="utf-8")


def load_tree(directory: Path, name: str) -> Any:
    """Read what :func:`save_tree` wrote. Raises :class:`CheckpointFormatError` (naming the file)
    for a missing, truncated or malformed file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    json_file = directory / f"{name}.json"
    try:
        skeleton = json.loads(json_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointFormatError(f"{json_file}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(f"{json_file}: not valid JSON ({exc})") from None
    tensor_file = directory / f"{name}.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    if tensor_file.exists():
        try:
            tensors = load_file(str(tensor_file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointFormatError(f"{tensor_file}: cannot be read ({exc})") from None
    return _decode(skeleton, tensors, str(json_file))


# --------------------------------------------------------------------------------------------
# random number generators


def capture_rng() -> dict[str, Any]:
    """The global RNG states of Python, NumPy (if installed), torch CPU and every CUDA device, as a
    state tree (:func:`save_tree` stores it)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:
        pass
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng` returned (CUDA only if it was captured and is present)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
            torch.cuda.set_rng_state_all(list(state["cuda"]))
        else:
            warnings.warn("checkpoint holds CUDA RNG states for a different set of devices; not restored", stacklevel=2)
    if "numpy" in state:
        try:
            import numpy as np

            np_state = state["numpy"]
            np.random.set_state(
                (
                    np_state["kind"],
                    np_state["keys"].numpy().astype(np.uint32),
                    np_state["pos"],
                    np_state["has_gauss"],
                    np_state["cached_gaussian"],
                )
            )
        except ImportError:
            pass


def generator_state(generator: torch.Generator) -> dict[str, Any]:
    """The state of one ``torch.Generator`` (its device and state tensor) as a state tree."""
    return {"device": str(generator.device), "state": generator.get_state()}


def set_generator_state(generator: torch.Generator, state: Mapping[str, Any]) -> None:
    """Restore what :func:`generator_state` returned."""
    generator.set_state(state["state"])
