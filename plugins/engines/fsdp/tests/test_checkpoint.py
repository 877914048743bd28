"""Atomic directory replacement and RNG snapshots, and the engine's config section."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl_fsdp import checkpoint as ckpt
from core_rl_fsdp.config import FSDPConfig
from core_rl_fsdp.distributed import resolve_backend


def _write(final: Path, text: str) -> None:
    tmp = ckpt.prepare_partial(final)
    (tmp / "data.txt").write_text(text)
    ckpt.commit_partial(final)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_commit_creates_and_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool) -> None:
    if not exchange:
        monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)
    final = tmp_path / "out"
    _write(final, "one")
    (final / "only-in-old.txt").write_text("x")
    _write(final, "two")
    assert sorted(p.name for p in final.iterdir()) == ["data.txt"]
    assert (final / "data.txt").read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_prepare_removes_a_stale_partial(tmp_path: Path) -> None:
    final = tmp_path / "out"
    stale = ckpt.partial_path(final)
    stale.mkdir()
    (stale / "junk").write_text("half written")
    tmp = ckpt.prepare_partial(final)
    assert tmp == stale and list(tmp.iterdir()) == []
    assert not final.exists()  # nothing appears at the destination before commit


def test_rng_roundtrip() -> None:
    state = ckpt.capture_rng()
    want = (random.random(), torch.rand(2))
    random.seed(7)
    torch.manual_seed(7)
    ckpt.restore_rng(state)
    assert random.random() == want[0] and torch.equal(torch.rand(2), want[1])


def test_config_section() -> None:
    assert structure({}, FSDPConfig) == FSDPConfig()
    cfg = structure({"wrap": "root", "param_dtype": "bfloat16", "cpu_offload": True}, FSDPConfig)
    assert (cfg.wrap, cfg.param_dtype, cfg.cpu_offload) == ("root", "bfloat16", True)
    with pytest.raises(ConfigError, match="param_dtype"):
        structure({"param_dtype": "int8"}, FSDPConfig, path="actor.engine")
    with pytest.raises(ConfigError, match="backend"):
        structure({"backend": "mpi"}, FSDPConfig, path="actor.engine")


def test_backend_resolution() -> None:
    assert resolve_backend("auto", torch.device("cpu")) == "gloo"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "cuda:nccl,cpu:gloo"
    assert resolve_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ValueError, match="nccl needs CUDA"):
        resolve_backend("nccl", torch.device("cpu"))
