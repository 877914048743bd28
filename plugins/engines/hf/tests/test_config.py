"""The ``rollout.engine`` section of the ``hf`` engine, validated as the core loader does."""

from __future__ import annotations

import pytest
import torch
from core_rl.config.checks import EnvironmentContext, MachineInfo
from core_rl.config.loader import structure
from core_rl.config.schema import RunConfig
from core_rl.errors import ConfigError
from core_rl_hf.config import HFRolloutConfig, resolve_device


def _load(**options: object) -> HFRolloutConfig:
    return structure(options, HFRolloutConfig, path="rollout.engine")


def test_defaults() -> None:
    cfg = _load()
    assert (cfg.dtype, cfg.device, cfg.max_batch_size, cfg.seed) == ("float32", "auto", 256, None)


def test_valid_options() -> None:
    cfg = _load(dtype="bfloat16", device="cuda:1", max_batch_size=8, seed=3)
    assert (cfg.dtype, cfg.device, cfg.max_batch_size, cfg.seed) == ("bfloat16", "cuda:1", 8, 3)
    assert _load(seed=None).seed is None
    assert _load().autocast_dtype is None
    assert _load(autocast_dtype="bfloat16").autocast_dtype == "bfloat16"
    assert (_load().host_memory, _load(host_memory="release").host_memory) == (None, "release")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": "float64"}, "rollout.engine.dtype: must be one of"),
        ({"device": "gpu0"}, "rollout.engine.device: must be 'auto', 'cpu', 'cuda', 'cuda:<index>' or 'mps'"),
        ({"device": "meta"}, "rollout.engine.device: must be 'auto', 'cpu'"),
        ({"max_batch_size": 0}, r"rollout.engine.max_batch_size: must be in \[1, 1048576\]"),
        ({"seed": -1}, r"rollout.engine.seed: must be in \[0, "),
        ({"seed": "seven"}, "rollout.engine.seed"),
        ({"max_batch_size": 2.5}, "rollout.engine.max_batch_size: expected an integer"),
        ({"autocast_dtype": "float16"}, "rollout.engine.autocast_dtype: must be one of 'bfloat16'"),
        ({"cuda_graphs": "yes"}, "rollout.engine.cuda_graphs: expected true or false"),
        ({"sync_every": 0}, r"rollout.engine.sync_every: must be in \[1, "),
        ({"host_memory": "trim"}, "rollout.engine.host_memory: must be one of 'reuse', 'release'"),
    ],
)
def test_invalid_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(**options)


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.parametrize(
    ("device", "machine", "problem"),
    [
        ("auto", MachineInfo(), None),
        ("cpu", MachineInfo(), None),
        ("cuda", MachineInfo(), "rollout.engine.device: 'cuda' but this machine has no CUDA GPU"),
        ("cuda:0", MachineInfo(), "rollout.engine.device: 'cuda:0' but this machine has no CUDA GPU"),
        ("cuda:1", MachineInfo(cuda_device_count=2), None),
        ("cuda:2", MachineInfo(cuda_device_count=2), "rollout.engine.device: 'cuda:2' but this machine has 2 CUDA"),
        ("mps", MachineInfo(mps_available=True), None),
        ("mps", MachineInfo(), "rollout.engine.device: 'mps' but Apple MPS is not available here"),
    ],
)
def test_device_checked_against_the_machine(device: str, machine: MachineInfo, problem: str | None) -> None:
    context = EnvironmentContext(path="rollout.engine", run=RunConfig(), name="hf", machine=machine)
    problems = _load(device=device).check_environment(context)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(problem)


def test_cuda_graphs_and_sync_every() -> None:
    assert (_load().cuda_graphs, _load().sync_every) == (None, None)
    assert (_load(cuda_graphs=False, sync_every=8).cuda_graphs, _load(sync_every=8).sync_every) == (False, 8)
    context = EnvironmentContext(path="rollout.engine", run=RunConfig(), name="hf", machine=MachineInfo())
    (problem,) = _load(device="cpu", cuda_graphs=True).check_environment(context)
    assert problem.startswith("rollout.engine.cuda_graphs: true needs a CUDA device but rollout.engine.device is 'cpu'")
    assert _load(device="cpu", cuda_graphs=False).check_environment(context) == []


def test_engine_resolves_graphs_and_sync_every(make_engine) -> None:
    """On a CPU: no graphs unless asked (then a clear error), the finished count read every token."""
    engine = make_engine()
    assert engine.graphs is None and engine.sync_every == 1
    assert make_engine(sync_every=4).sync_every == 4
    with pytest.raises(ConfigError, match="rollout.engine.cuda_graphs: true, but the engine generates on cpu"):
        make_engine(device="cpu", cuda_graphs=True)
