"""The ``actor.engine`` section of ``fsdp``: its own options, what it refuses in the run's other
sections and on the machine at hand (with the key path of each problem), and backend resolution."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from core_rl.config.checks import EnvironmentContext, MachineInfo, SectionContext
from core_rl.config.loader import structure
from core_rl.config.schema import ActorConfig, OptimizerConfig, RunConfig
from core_rl.errors import ConfigError
from core_rl_fsdp.config import FSDPConfig
from core_rl_fsdp.distributed import resolve_backend


def _config(**options: object) -> FSDPConfig:
    return structure(options, FSDPConfig, path="actor.engine")


def _run(dtype: str, optimizer: str = "adamw") -> RunConfig:
    return RunConfig(actor=ActorConfig(dtype=dtype, optimizer=OptimizerConfig(name=optimizer)))


def test_float16_weights_with_adamw_are_refused() -> None:
    def problems(dtype: str, optimizer: str = "adamw") -> list[str]:
        return _config().check_config(SectionContext(path="actor.engine", run=_run(dtype, optimizer), name="fsdp"))

    (problem,) = problems("float16")
    assert problem.startswith("actor.dtype: float16 weights with adamw turn to NaN at the first optimizer step")
    assert problems("bfloat16") == [] and problems("float32") == [] and problems("float16", "sgd") == []


def test_flash_attention_in_float32_is_refused() -> None:
    """flash-attn has no float32 kernels: asked for by name, it needs a bfloat16 or float16 forward."""

    def problems(dtype: str, **options: object) -> list[str]:
        context = SectionContext(path="actor.engine", run=_run(dtype), name="fsdp")
        return _config(attn_implementation="flash_attention_2", **options).check_config(context)

    (problem,) = problems("float32")
    assert problem == (
        "actor.engine.attn_implementation: flash_attention_2 computes in bfloat16 or float16 only, and this engine's "
        "forward computes in float32 (actor.dtype, no param_dtype or autocast_dtype); set actor.engine.param_dtype: "
        "bfloat16, or use sdpa"
    )
    assert problems("bfloat16") == []
    assert problems("float32", param_dtype="bfloat16") == problems("float32", autocast_dtype="bfloat16") == []


def test_why_float16_adamw_is_refused() -> None:
    """What the check prevents: float16 parameters updated by AdamW become NaN (eps = 1e-8 is 0 in
    float16 and small squared gradients underflow, so the update divides 0 by 0)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16).to(torch.float16)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    layer(torch.randn(4, 16, dtype=torch.float16) * 1e-3).pow(2).mean().backward()
    optimizer.step()
    assert torch.isnan(layer.weight).any()


@pytest.mark.parametrize(
    ("options", "machine", "problem"),
    [
        ({}, MachineInfo(), None),
        ({"backend": "gloo"}, MachineInfo(), None),
        ({"backend": "nccl"}, MachineInfo(cuda_device_count=1), None),
        ({"backend": "nccl"}, MachineInfo(), "actor.engine.backend: nccl needs CUDA GPUs and this machine has none"),
        ({}, MachineInfo(cuda_device_count=2, local_world_size=3), "actor.engine: 3 processes on this node but only 2"),
        ({"attn_implementation": "sdpa"}, MachineInfo(), None),
        (
            {"attn_implementation": "flash_attention_2"},
            MachineInfo(),
            "actor.engine.attn_implementation: flash_attention_2 needs a CUDA GPU",
        ),
    ],
)
def test_environment(options: dict[str, object], machine: MachineInfo, problem: str | None) -> None:
    context = EnvironmentContext(path="actor.engine", run=RunConfig(), name="fsdp", machine=machine)
    problems = _config(**options).check_environment(context)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(problem)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed here")
def test_flash_attention_needs_its_package_on_a_gpu_machine() -> None:
    context = EnvironmentContext(path="actor.engine", run=RunConfig(), machine=MachineInfo(cuda_device_count=1))
    (problem,) = _config(attn_implementation="flash_attention_2").check_environment(context)
    assert problem == (
        "actor.engine.attn_implementation: flash_attention_2 needs the flash_attn package, which is not installed; "
        "install it or use sdpa"
    )


def test_config_section() -> None:
    assert structure({}, FSDPConfig) == FSDPConfig()
    cfg = structure({"wrap": "root", "param_dtype": "bfloat16", "cpu_offload": True}, FSDPConfig)
    assert (cfg.wrap, cfg.param_dtype, cfg.cpu_offload) == ("root", "bfloat16", True)
    with pytest.raises(ConfigError, match="param_dtype"):
        structure({"param_dtype": "int8"}, FSDPConfig, path="actor.engine")
    assert structure({"autocast_dtype": "bfloat16"}, FSDPConfig).autocast_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="autocast_dtype"):  # float16 autocast would need loss scaling
        structure({"autocast_dtype": "float16"}, FSDPConfig, path="actor.engine")
    with pytest.raises(ConfigError, match="backend"):
        structure({"backend": "mpi"}, FSDPConfig, path="actor.engine")


def test_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend("auto", torch.device("cpu")) == "gloo"
    # with CUDA present a CPU engine's group also carries NCCL, so GPU engines of the process can share it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend("auto", torch.device("cpu")) == "cuda:nccl,cpu:gloo"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "cuda:nccl,cpu:gloo"
    assert resolve_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ValueError, match="nccl needs CUDA"):
        resolve_backend("nccl", torch.device("cpu"))


def test_flash_attention_reads_the_dtype_of_its_own_role() -> None:
    """A critic's engine section is checked against the critic's dtype, not the actor's."""
    from core_rl.config.schema import CriticConfig

    def problems(actor_dtype: str, critic_dtype: str) -> list[str]:
        run = RunConfig(actor=ActorConfig(dtype=actor_dtype), critic=CriticConfig(model_path="c", dtype=critic_dtype))
        context = SectionContext(path="critic.engine", run=run, name="fsdp")
        return _config(attn_implementation="flash_attention_2").check_config(context)

    assert problems("bfloat16", "bfloat16") == []
    (problem,) = problems("bfloat16", "float32")
    assert problem == (
        "critic.engine.attn_implementation: flash_attention_2 computes in bfloat16 or float16 only, and this "
        "engine's forward computes in float32 (critic.dtype, no param_dtype or autocast_dtype); set "
        "critic.engine.param_dtype: bfloat16, or use sdpa"
    )


def test_sequence_parallelism_is_checked_against_the_other_settings(tmp_path) -> None:
    """``sequence_parallel_size`` with ``compile``, with an attention Ulysses cannot run, and with a
    model whose key/value heads it does not divide (read from ``config.json`` before any load)."""
    from core_rl.testing.tiny import build_tiny_model

    run = _run("float32")
    context = SectionContext(path="actor.engine", run=run, name="fsdp")
    assert _config(sequence_parallel_size=2, attn_implementation="auto").check_config(context) == []
    (compiled,) = _config(sequence_parallel_size=2, compile=True).check_config(context)
    assert compiled.startswith("actor.engine.compile: true with actor.engine.sequence_parallel_size: 2")
    (flex,) = _config(sequence_parallel_size=2, attn_implementation="flex_attention").check_config(context)
    assert flex.startswith("actor.engine.sequence_parallel_size: 2 runs attention as one of sdpa, eager")
    with pytest.raises(ConfigError, match=r"actor\.engine\.sequence_parallel_size: must be > 0"):
        _config(sequence_parallel_size=0)

    model = build_tiny_model(tmp_path / "model", seed=0, num_kv_heads=2)
    run = RunConfig(actor=ActorConfig(model_path=str(model)))

    def environment(size: int) -> list[str]:
        env = EnvironmentContext(path="actor.engine", run=run, name="fsdp", machine=MachineInfo())
        return _config(sequence_parallel_size=size).check_environment(env)

    assert environment(2) == [] and environment(1) == []
    (heads,) = environment(4)
    assert heads == (
        f"actor.engine.sequence_parallel_size: 4 must divide the model's key/value heads (2, {model}/config.json); "
        "choose a divisor of 2"
    )
