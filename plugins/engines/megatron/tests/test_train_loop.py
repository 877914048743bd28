"""The engine inside core-rl's RL loop (CPU, one rank, the test-only CUDA shim): the example config
validates as written (for 2 GPUs), and with CPU overrides a few GRPO steps run end to end: rollouts
from the ``hf`` engine, log-probs and updates from ``megatron``, new weights handed back in memory
and through disk, checkpoints and the final export. PPO with a megatron critic next to the fsdp
actor runs like PPO with the fsdp critic."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from core_rl.builtin.loggers import read_metrics
from core_rl.config.loader import load_config
from core_rl.plugins.host import PluginHost
from core_rl.testing import preloaded
from core_rl.testing.tiny import build_tiny_model

for dist in ("core_rl_hf", "core_rl_grpo", "core_rl_reward_match"):
    pytest.importorskip(dist)

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "megatron" / "grpo_megatron.yaml"
CPU = [  # what this machine can run: one rank, no GPU-only settings
    "actor.engine.tensor_model_parallel_size=1",
    "actor.engine.bf16=false",
    "actor.engine.ddp.use_distributed_optimizer=false",
    "actor.engine.ddp.overlap_param_gather=false",
    "actor.engine.make_vocab_size_divisible_by=8",
]


def test_example_config_validates() -> None:
    cfg = load_config(EXAMPLE, host=PluginHost())
    assert cfg.actor.engine.name == "megatron"
    engine = cfg.actor.engine.config
    assert (engine.tensor_model_parallel_size, engine.bf16, engine.ddp.use_distributed_optimizer) == (2, True, True)


def _task(root: Path) -> tuple[Path, Path]:
    """A tiny model and four prompts of the reversal task."""
    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    data = root / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{s}=", "answer": s[::-1]}) + "\n" for s in ("ab", "ba", "abc", "dca"))
    )
    return model, data


@pytest.mark.parametrize("weight_sync", ["memory", "disk"])
def test_grpo_steps_with_the_megatron_engine(tmp_path: Path, weight_sync: str) -> None:
    from core_rl.loops.run import train

    model, data = _task(tmp_path)
    overrides = [
        *CPU,
        f"experiment.output_dir={tmp_path / 'runs'}",
        f"actor.model_path={model}",
        f"data.train_files=[{data}]",
        "data.batch_size=2",
        "rollout.sampling.n=4",
        "rollout.sampling.max_new_tokens=4",
        f"rollout.weight_sync={weight_sync}",
        "trainer.total_steps=3",
        "trainer.torch_threads=1",
        "saver.every_n_steps=2",
        "loggers=[{name: console}]",
    ]
    result = train(load_config(EXAMPLE, overrides, host=PluginHost()), host=PluginHost())
    rows = read_metrics(result["metrics"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:  # a zero-signal step (every advantage 0) skips its forward pass: no entropy
        entropy = () if row["actor/zero_signal_update"] else ("actor/entropy",)
        for key in ("actor/loss", "actor/grad_norm", *entropy, "reward/mean", "timing/weight_sync_s"):
            assert key in row, key
    checkpoint = Path(result["checkpoint"])
    assert checkpoint.name == "step_00000003"
    assert json.loads((checkpoint / "meta.json").read_text())["engine"] == "megatron"
    assert (Path(result["export"]) / "config.json").is_file()


def test_a_megatron_critic_trains_like_the_fsdp_one(tmp_path: Path) -> None:
    """The critic role on megatron through the train-engine contract: next to the fsdp actor, 2 PPO
    steps (the critic alone in the first, warm-up; both in the second, 2 minibatches each) give the
    fsdp critic's values, value losses and gradient norms, and so the same actor update."""
    pytest.importorskip("core_rl_ppo")
    from core_rl.loops.run import train

    model, data = _task(tmp_path)
    ppo = EXAMPLE.parents[1] / "tiny_grpo" / "ppo.yaml"
    common = [
        f"experiment.output_dir={tmp_path / 'runs'}",
        f"actor.model_path={model}",
        f"critic.model_path={model}",
        f"data.train_files=[{data}]",
        "data.batch_size=4",
        "rollout.sampling.n=4",
        "rollout.sampling.max_new_tokens=4",
        "critic.warmup_steps=1",
        "algorithm.ppo_n_minibatches=2",
        "trainer.total_steps=2",
        "saver.every_n_steps=0",
        "saver.at_end=false",
        "saver.export_hf=false",
        "loggers=[]",
    ]
    critics = {
        "fsdp": "critic.engine={name: fsdp}",
        "megatron": "critic.engine={name: megatron, make_vocab_size_divisible_by: 8}",
    }
    rows = {}
    for name, engine in critics.items():
        overrides = [*common, f"experiment.name={name}", engine]
        result = train(load_config(ppo, overrides, host=PluginHost()), host=PluginHost())
        rows[name] = read_metrics(result["metrics"])
    fsdp, mega = rows["fsdp"], rows["megatron"]
    assert [r["step"] for r in mega] == [1, 2] and "actor/loss" not in mega[0] and "actor/loss" in mega[1]
    for a, b in zip(fsdp, mega):
        for key in ("critic/loss", "critic/values_mean", "critic/grad_norm", "actor/loss", "reward/mean"):
            if key in a:
                # the deepspeed critic's tolerance: the actor loss is a sum over centred advantages,
                # whose cancellations magnify the critic's last-bit differences (measured 1e-5 rel)
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", [["config", "validate", "--preflight"], ["train"]])
def test_without_cuda_a_run_is_refused_in_one_line(tmp_path: Path, command: list[str]) -> None:
    """Outside the test suite's CPU shim (a subprocess has none) megatron-core cannot run on a CPU:
    the run is refused before anything is built, naming the key and what to use instead."""
    model, data = _task(tmp_path)
    overrides = [*CPU, f"experiment.output_dir={tmp_path / 'runs'}", f"actor.model_path={model}"]
    overrides.append(f"data.train_files=[{data}]")
    proc = preloaded.run(
        [sys.executable, "-m", "core_rl.cli", *command, str(EXAMPLE), *overrides],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "actor.engine.name: megatron needs a CUDA GPU and this machine has none" in proc.stderr
    assert "fsdp or deepspeed" in proc.stderr and "Traceback" not in proc.stderr
