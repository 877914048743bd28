"""vLLM asleep while the trainer trains, on a GPU (``rollout.sleep_while_training``; skipped without
CUDA, or without the vllm server environment where it cannot be built): a server started with
``--enable-sleep-mode`` gives back the GPU memory it holds when it sleeps, generates the same
greedy tokens after waking and reloading its weights
(:func:`core_rl.testing.sleep.check_sleep_round_trip`), and a colocated synchronous run (``auto``)
sleeps every step, by disk and by collective. Not yet run: the machines this was written on have
no GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.config.loader import structure
from core_rl.testing.faults import build_task, merged, run_dir
from core_rl.testing.sleep import GIB, check_sleep_round_trip, gpu_marks
from core_rl.testing.tiny import build_tiny_model
from core_rl_vllm.config import VLLMConfig
from core_rl_vllm.engine import VLLMRolloutEngine

pytestmark = gpu_marks("vllm")

#: the share of the GPU the server takes (the trainer shares the GPU)
UTILIZATION = 0.3
OPTIONS: dict[str, Any] = {
    "dtype": "bfloat16",
    "gpu_memory_utilization": UTILIZATION,
    "server": {"env_variant": "cuda", "weight_sync_backend": "gloo"},  # one GPU: no NCCL with itself
}


#: every choice left to the run (the share of the GPU, the server's GPU, the weight-sync backend)
DEFAULTS: dict[str, Any] = {"dtype": "bfloat16", "server": {"env_variant": "cuda"}}


def _held_bytes() -> float:
    """What the server may hold: its share of the GPU."""
    return UTILIZATION * torch.cuda.get_device_properties(0).total_memory


def test_a_sleeping_server_gives_back_its_memory_and_generates_after_waking(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", alphabet="abcd=", num_heads=2)
    engine = VLLMRolloutEngine(model, structure(OPTIONS, VLLMConfig, path="rollout.engine"), tmp_path, sleep=True)
    try:
        check_sleep_round_trip(engine, model, _held_bytes())
    finally:
        engine.close()


@pytest.mark.parametrize(("weight_sync", "defaults"), [("disk", False), ("collective", False), ("collective", True)])
def test_a_colocated_synchronous_run_sleeps_every_step(tmp_path: Path, weight_sync: str, defaults: bool) -> None:
    """``defaults``: the server's share of the GPU (``gpu_memory_utilization: 0``: what the trainer
    leaves), its GPU (``server.gpus``: the trainer's) and the weight-sync backend (``auto``: gloo
    on the trainer's GPU) as the run chooses them."""
    for plugin in ("core_rl_fsdp", "core_rl_grpo", "core_rl_reward_match"):
        pytest.importorskip(plugin)
    from core_rl.config import load_config
    from core_rl.loops import train
    from core_rl.plugins.host import PluginHost

    model = build_tiny_model(tmp_path / "model_h32", alphabet="abcd=", num_heads=2)  # a head size vLLM runs
    config = merged(
        build_task(tmp_path),
        experiment={"name": f"colocated_{weight_sync}"},
        actor={"model_path": str(model)},
        rollout={"engine": {"name": "vllm", **(DEFAULTS if defaults else OPTIONS)}, "weight_sync": weight_sync},
        trainer={"total_steps": 3, "torch_threads": 1},
        saver={"every_n_steps": 0, "at_end": False, "export_hf": False},
    )  # rollout.sleep_while_training: auto -> placement colocate, CUDA, synchronous: on
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    host = PluginHost(environ={})
    train(load_config(path, host=host), host=host)
    rows = read_metrics(run_dir(config) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    held = _held_bytes()
    if defaults:  # the share chosen from the trainer's free memory, on the command line the log records
        log = (run_dir(config) / "servers" / "vllm-0.log").read_text().splitlines()
        argv = next(line for line in log if line.startswith("=== core-rl starts")).split()
        share = float(argv[argv.index("--gpu-memory-utilization") + 1])
        assert 0.05 <= share < 0.9, share  # the trainer holds some of the GPU
        held = share * torch.cuda.get_device_properties(0).total_memory
    for row in rows:
        assert row["memory/rollout_released_gib"] > 0.5 * held / GIB, row["memory/rollout_released_gib"]
        assert row["timing/rollout_release_s"] >= 0 and row["timing/rollout_restore_s"] >= 0
        assert row["throughput/generated_tokens_per_s"] > 0  # generation worked after each wake-up
