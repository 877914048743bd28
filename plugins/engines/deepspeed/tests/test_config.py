"""The engine's config section, its checks against the machine and the DeepSpeed configuration built
from it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from core_rl.config.checks import EnvironmentContext, MachineInfo
from core_rl.config.loader import structure
from core_rl.config.schema import ActorConfig, RunConfig
from core_rl.errors import ConfigError
from core_rl_deepspeed import config as ds_config_module
from core_rl_deepspeed.config import DeepSpeedConfig, cpu_has_float16
from core_rl_deepspeed.ds_config import build_ds_config


def test_config_section_and_errors() -> None:
    assert structure({}, DeepSpeedConfig) == DeepSpeedConfig()
    cfg = structure({"zero_stage": 3, "offload_param": True, "mixed_precision": "bfloat16"}, DeepSpeedConfig)
    assert (cfg.zero_stage, cfg.offload_param, cfg.mixed_precision) == (3, True, "bfloat16")
    with pytest.raises(ConfigError, match=r"actor\.engine\.zero_stage: must be one of 1, 2, 3, got 4"):
        structure({"zero_stage": 4}, DeepSpeedConfig, path="actor.engine")
    with pytest.raises(ConfigError, match=r"actor\.engine\.offload_param: needs zero_stage: 3"):
        structure({"zero_stage": 2, "offload_param": True}, DeepSpeedConfig, path="actor.engine")
    with pytest.raises(ConfigError, match=r"actor\.engine\.overlap_comm: needs zero_stage 2 or 3"):
        structure({"zero_stage": 1, "overlap_comm": True}, DeepSpeedConfig, path="actor.engine")
    with pytest.raises(ConfigError, match="mixed_precision"):
        structure({"mixed_precision": "int8"}, DeepSpeedConfig, path="actor.engine")


def test_generated_deepspeed_config() -> None:
    actor = ActorConfig(grad_clip=0.5)
    options = DeepSpeedConfig(
        zero_stage=3,
        offload_optimizer=True,
        offload_param=True,
        mixed_precision="bfloat16",
        config_overrides={"zero_optimization": {"stage3_max_live_parameters": 123}, "steps_per_print": 10},
    )
    ds = build_ds_config(actor, options, on_cuda=False)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_max_live_parameters"] == 123  # merged, not replaced
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert build_ds_config(actor, options, on_cuda=True)["zero_optimization"]["offload_param"]["pin_memory"] is True
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    assert ds["gradient_clipping"] == 0.5 and ds["steps_per_print"] == 10
    # the engine owns accumulation and the schedule: one optimizer step per step() call
    assert ds["managed_gradient_accumulation"] is False and ds["gradient_accumulation_steps"] == 1
    assert "scheduler" not in ds and "optimizer" not in ds
    plain = build_ds_config(ActorConfig(), DeepSpeedConfig(zero_stage=1), on_cuda=False)
    assert "offload_optimizer" not in plain["zero_optimization"] and "bf16" not in plain


FLOAT16_REFUSED = "actor.engine.mixed_precision: float16 on the CPU, which DeepSpeed refuses here"


@pytest.mark.parametrize(
    ("options", "machine", "cpu_float16", "refused"),
    [
        ({"mixed_precision": "float16"}, MachineInfo(), False, True),
        ({"mixed_precision": "float16", "device": "cpu"}, MachineInfo(cuda_device_count=1), False, True),
        ({"mixed_precision": "float16"}, MachineInfo(cuda_device_count=1), False, False),  # on the GPU
        ({"mixed_precision": "float16"}, MachineInfo(), True, False),  # a CPU with oneDNN float16
        ({"mixed_precision": "bfloat16"}, MachineInfo(), False, False),
    ],
)
def test_float16_on_a_cpu_without_it_is_refused(
    monkeypatch: pytest.MonkeyPatch, options: dict, machine: MachineInfo, cpu_float16: bool, refused: bool
) -> None:
    monkeypatch.setattr(ds_config_module, "cpu_has_float16", lambda: cpu_float16)
    context = EnvironmentContext(path="actor.engine", run=RunConfig(), name="deepspeed", machine=machine)
    problems = structure(options, DeepSpeedConfig, path="actor.engine").check_environment(context)
    assert any(p.startswith(FLOAT16_REFUSED) for p in problems) is refused, problems


def test_the_float16_probe_agrees_with_deepspeed() -> None:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    assert cpu_has_float16() is bool(CPU_Accelerator().is_fp16_supported())


def test_train_refuses_float16_on_this_cpu_before_loading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where DeepSpeed would stop the run with ``ValueError: Type fp16 is not supported on your
    device`` after loading the model, preflight says which key, with exit status 2."""
    import torch
    from core_rl.cli import main
    from core_rl.testing.faults import build_task, merged

    if torch.cuda.is_available() or cpu_has_float16():
        pytest.skip("this machine runs DeepSpeed in float16")
    cfg = merged(build_task(tmp_path), actor={"engine": {"name": "deepspeed", "mixed_precision": "float16"}})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert FLOAT16_REFUSED in err and "Traceback" not in err, err
    assert not (Path(cfg["experiment"]["output_dir"]) / cfg["experiment"]["name"] / "metrics.jsonl").exists()


FLASH_IN_FLOAT32 = (
    "actor.engine.attn_implementation: flash_attention_2 computes in bfloat16 or float16 only, and this engine's "
    "forward computes in float32 (actor.dtype, no mixed_precision); set actor.engine.mixed_precision: bfloat16, "
    "or use sdpa"
)


def test_flash_attention_with_a_float32_forward_is_refused_at_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """flash-attn has no float32 kernels: asked for by name with a float32 forward, ``config validate``
    refuses it (exit 2, the key to set) instead of the first forward failing on a GPU."""
    from core_rl.cli import main

    def validate(engine: dict, dtype: str = "float32") -> tuple[int, str]:
        cfg = {"actor": {"model_path": "m", "dtype": dtype, "engine": {"name": "deepspeed", **engine}}}
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
        status = main(["config", "validate", str(tmp_path / "run.yaml")])
        return status, capsys.readouterr().err

    status, err = validate({"attn_implementation": "flash_attention_2"})
    assert status == 2 and FLASH_IN_FLOAT32 in err and "Traceback" not in err, err
    for engine, dtype in [
        ({"attn_implementation": "flash_attention_2", "mixed_precision": "bfloat16"}, "float32"),
        ({"attn_implementation": "flash_attention_2"}, "bfloat16"),
        ({"attn_implementation": "sdpa"}, "float32"),
    ]:
        status, err = validate(engine, dtype)
        assert "attn_implementation" not in err, (engine, dtype, err)


@pytest.mark.parametrize(
    ("machine", "problem"),
    [
        (MachineInfo(), "actor.engine.attn_implementation: flash_attention_2 needs a CUDA GPU"),
        pytest.param(
            MachineInfo(cuda_device_count=1),
            "actor.engine.attn_implementation: flash_attention_2 needs the flash_attn package, which is not installed",
            marks=pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is here"),
        ),
    ],
)
def test_flash_attention_against_the_machine(machine: MachineInfo, problem: str) -> None:
    context = EnvironmentContext(path="actor.engine", run=RunConfig(), name="deepspeed", machine=machine)
    cfg = structure({"attn_implementation": "flash_attention_2", "mixed_precision": "bfloat16"}, DeepSpeedConfig)
    problems = cfg.check_environment(context)
    assert any(p.startswith(problem) for p in problems), problems


def test_sequence_parallelism_is_checked_like_fsdps(tmp_path: Path) -> None:
    """The shared checks of ``sequence_parallel_size``: the model's key/value heads (from its
    ``config.json``) and the attention implementation, with the key path."""
    from core_rl.config.checks import SectionContext
    from core_rl.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0, num_kv_heads=2)
    run = RunConfig(actor=ActorConfig(model_path=str(model)))

    def problems(**options: object) -> list[str]:
        section = structure(options, DeepSpeedConfig, path="actor.engine")
        context = SectionContext(path="actor.engine", run=run, name="deepspeed")
        env = EnvironmentContext(path="actor.engine", run=run, name="deepspeed", machine=MachineInfo())
        return section.check_config(context) + section.check_environment(env)

    assert problems(sequence_parallel_size=2) == []
    (heads,) = problems(sequence_parallel_size=4)
    assert heads.startswith("actor.engine.sequence_parallel_size: 4 must divide the model's key/value heads (2, ")
    (flex,) = problems(sequence_parallel_size=2, attn_implementation="flex_attention")
    assert flex.startswith("actor.engine.sequence_parallel_size: 2 runs attention as one of sdpa, eager")
