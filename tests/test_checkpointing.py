"""core_rl.checkpoint.files: safe state trees (safetensors + JSON, nothing unpickled) and RNG snapshots
(its atomic writes: tests/test_atomic_files.py)."""

from __future__ import annotations

import enum
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from core_rl.checkpoint import files as ckpt
from hypothesis import given, settings
from hypothesis import strategies as st


def test_tree_roundtrip_keeps_types_tensors_and_specials(tmp_path: Path) -> None:
    tree = {
        "step": 3,
        "lr": 1e-3,
        "name": "adamw",
        "flag": True,
        "nothing": None,
        "betas": (0.9, 0.999),
        "nan": math.nan,
        "inf": -math.inf,
        "by_id": {0: {"exp_avg": torch.arange(4.0)}, 1: {"step": torch.tensor(2.0)}},
        "groups": [{"params": ["a.weight", "b.weight"], "lr": 0.1}],
        "rng": torch.ByteTensor([1, 2, 3]),
        "bf16": torch.ones(2, 3, dtype=torch.bfloat16),
        "view": torch.arange(10.0)[::2],  # a non-contiguous view
        "__tensor__": "a key that looks like a marker",
    }
    ckpt.save_tree(tmp_path, "state", tree)
    back = ckpt.load_tree(tmp_path, "state")
    assert back["step"] == 3 and back["lr"] == 1e-3 and back["name"] == "adamw" and back["flag"] is True
    assert back["nothing"] is None and back["betas"] == (0.9, 0.999)
    assert math.isnan(back["nan"]) and back["inf"] == -math.inf
    assert set(back["by_id"]) == {0, 1}
    assert torch.equal(back["by_id"][0]["exp_avg"], torch.arange(4.0))
    assert back["groups"] == [{"params": ["a.weight", "b.weight"], "lr": 0.1}]
    assert back["rng"].dtype == torch.uint8 and back["rng"].tolist() == [1, 2, 3]
    assert back["bf16"].dtype == torch.bfloat16
    assert torch.equal(back["view"], torch.arange(10.0)[::2])
    assert back["__tensor__"] == "a key that looks like a marker"
    # the JSON side is plain data: nothing there could run code on load
    json.loads((tmp_path / "state.json").read_text())


class _Kind(enum.Enum):
    FLAT = 1
    NESTED = "nested"


class _Level(enum.IntEnum):
    LOW = 0
    HIGH = 1


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**60), 2**60),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=4).map(torch.tensor),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]),
    st.lists(st.integers(0, 2**40), max_size=4).map(torch.Size),
    st.sampled_from(list(_Kind)),
)
_tree = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=5), children, max_size=3),
        st.dictionaries(st.integers(0, 9), children, max_size=3),
    ),
    max_leaves=12,
)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=60, deadline=None)
@given(tree=_tree)
def test_any_tree_roundtrips(tmp_path_factory: pytest.TempPathFactory, tree) -> None:
    directory = tmp_path_factory.mktemp("tree")
    ckpt.save_tree(directory, "t", tree)
    assert _same(tree, ckpt.load_tree(directory, "t"))


def test_optimizer_metadata_roundtrips(tmp_path: Path) -> None:
    """What real optimizers keep beside tensors: a distributed optimizer keys its buffers by
    ``(param_dtype, grad_dtype)`` tuples; states hold devices, shapes and enum members."""
    tree = {
        "buffers": {0: {(torch.bfloat16, torch.float32): [{"param": torch.ones(3), "numel": 3}]}},
        "device": torch.device("cuda", 0),
        "shape": torch.Size([4, 8]),
        "kind": _Kind.NESTED,
        "level": _Level.HIGH,  # an IntEnum is an int too: it must come back as the member
        "dtypes": [torch.float16, torch.int8],
    }
    ckpt.save_tree(tmp_path, "opt", tree)
    back = ckpt.load_tree(tmp_path, "opt")
    ((key, value),) = back["buffers"][0].items()
    assert key == (torch.bfloat16, torch.float32) and torch.equal(value[0]["param"], torch.ones(3))
    assert back["device"] == torch.device("cuda", 0)
    assert type(back["shape"]) is torch.Size and back["shape"] == torch.Size([4, 8])
    assert back["kind"] is _Kind.NESTED and back["level"] is _Level.HIGH
    assert back["dtypes"] == [torch.float16, torch.int8]


def test_an_enum_of_a_module_not_imported_is_a_format_error(tmp_path: Path) -> None:
    # loading never imports a module (that would run its code): the member's module must be loaded already
    (tmp_path / "e.json").write_text(json.dumps({"k": {"__enum__": ["some_plugin.states", "Kind", "A"]}}))
    with pytest.raises(ckpt.CheckpointFormatError, match="some_plugin.states is not imported"):
        ckpt.load_tree(tmp_path, "e")
    (tmp_path / "e.json").write_text(json.dumps({"k": {"__enum__": ["json", "JSONDecoder", "A"]}}))
    with pytest.raises(ckpt.CheckpointFormatError, match="json.JSONDecoder.A is not an enum member"):
        ckpt.load_tree(tmp_path, "e")


def test_objects_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="at /opt/fn"):
        ckpt.save_tree(tmp_path, "bad", {"opt": {"fn": print}})


@pytest.mark.parametrize(
    "damage",
    ["missing", "garbage_json", "truncated_tensors", "missing_tensor"],
)
def test_damaged_files_raise_a_format_error_naming_the_file(tmp_path: Path, damage: str) -> None:
    ckpt.save_tree(tmp_path, "s", {"w": torch.ones(64), "b": torch.zeros(2)})
    tensors = tmp_path / "s.safetensors"
    if damage == "missing":
        (tmp_path / "s.json").unlink()
    elif damage == "garbage_json":
        (tmp_path / "s.json").write_bytes(b"\x80\x81 not json")
    elif damage == "truncated_tensors":
        tensors.write_bytes(tensors.read_bytes()[:40])
    else:
        (tmp_path / "s.json").write_text(json.dumps({"w": {"__tensor__": "/nope"}}))
    with pytest.raises(ckpt.CheckpointFormatError, match=r"s\.(json|safetensors)"):
        ckpt.load_tree(tmp_path, "s")


def test_rng_roundtrip_through_files(tmp_path: Path) -> None:
    state = ckpt.capture_rng()
    ckpt.save_tree(tmp_path, "rng", state)
    want = (random.random(), torch.rand(2), np.random.rand())
    random.seed(7)
    torch.manual_seed(7)
    np.random.seed(7)
    ckpt.restore_rng(ckpt.load_tree(tmp_path, "rng"))
    assert random.random() == want[0] and torch.equal(torch.rand(2), want[1]) and np.random.rand() == want[2]


def test_generator_state_roundtrip(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    torch.rand(3, generator=gen)
    ckpt.save_tree(tmp_path, "g", ckpt.generator_state(gen))
    want = torch.rand(4, generator=gen)
    other = torch.Generator().manual_seed(99)
    ckpt.set_generator_state(other, ckpt.load_tree(tmp_path, "g"))
    assert torch.equal(torch.rand(4, generator=other), want)
