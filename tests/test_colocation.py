"""``rollout.sleep_while_training``: what the configuration refuses (exit status 2, the key named),
how ``auto`` resolves, and, in a real synchronous run (fsdp + hf, tiny model, this process), where
the trainer releases and restores the rollout engine's memory relative to generation, training and
the weight update. Sleeping needs a GPU, which this machine lacks: the run here forces it on (the
hf engine's release is then a real call that has nothing to free on a CPU); the GPU tests of the
engines (``test_gpu_sleep.py``) check that memory is given back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.cli import main
from core_rl.config import load_config
from core_rl.launch.placement import sleep_problems, sleeps_while_training
from core_rl.testing.faults import build_task, merged, run_dir
from core_rl.testing.tiny import build_tiny_model
from fault_helpers import train_here

ROOT = Path(__file__).resolve().parents[1]
VLLM_EXAMPLE = ROOT / "examples" / "server_grpo" / "vllm.yaml"
KEY = "rollout.sleep_while_training"


def _validate(capsys: pytest.CaptureFixture[str], *overrides: str, preflight: bool = False) -> tuple[int, str]:
    args = ["config", "validate", *(["--preflight"] if preflight else []), str(VLLM_EXAMPLE), *overrides]
    status = main(args)
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["placement.mode=split"],
            "rollout.sleep_while_training: true, but placement.mode is split: the rollout servers run on GPUs of "
            "their own, so no GPU memory is shared with the trainer; set it to auto or false",
        ),
        (
            ["placement.mode=external", "rollout.engine.server.urls=[http://127.0.0.1:1]"],
            "rollout.sleep_while_training: true, but placement.mode is external: the rollout servers are someone "
            "else's",
        ),
        (
            ["rollout.controller.max_head_offpolicyness=2"],
            "rollout.sleep_while_training: true, but rollout.controller.max_head_offpolicyness is 2: generation goes "
            "on while the trainer trains",
        ),
        (
            ["rollout.engine.server.env_variant=cpu"],
            "rollout.sleep_while_training: true, but the rollout engine generates on cpu "
            "(rollout.engine.server.env_variant: cpu): only GPU memory is given back",
        ),
    ],
)
def test_true_where_it_cannot_work_is_a_config_error(capsys, overrides: list[str], message: str) -> None:
    status, err = _validate(capsys, f"{KEY}=true", *overrides)
    assert status == 2 and message in err, err


def test_not_a_switch_is_a_config_error(capsys) -> None:
    status, err = _validate(capsys, f"{KEY}=sometimes")
    assert status == 2 and "rollout.sleep_while_training: expected true, false or 'auto', got 'sometimes'" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_true_on_a_machine_without_a_gpu_fails_preflight(capsys, tmp_path: Path) -> None:
    """The device is the machine's choice (``env_variant`` empty): known at preflight, which names
    the key and exits 2 before any model or server is loaded."""
    root = tmp_path  # the example's layout: <output_dir>/model_warm and <output_dir>/data/train.jsonl
    build_tiny_model(root / "model_warm", num_heads=2)
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text(json.dumps({"prompt": "ab=", "answer": "ba"}) + "\n")
    overrides = [f"experiment.output_dir={root}", f"{KEY}=true"]
    assert _validate(capsys, *overrides)[0] == 0  # valid as configuration: a GPU machine would run it
    status, err = _validate(capsys, *overrides, preflight=True)
    assert status == 2, err
    assert (
        "rollout.sleep_while_training: true, but the rollout engine generates on cpu (this machine has no CUDA GPU)"
        in err
    )


def test_an_engine_that_cannot_release_memory_refuses_true(tmp_path, minimal_config, host) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(minimal_config))
    with pytest.raises(Exception, match="rollout engine 'gen' cannot give back its memory"):
        load_config(path, [f"{KEY}=true"], host=host)
    assert not sleeps_while_training(load_config(path, host=host), releases_memory=False, cuda_available=True)


@pytest.mark.parametrize(
    ("overrides", "cuda", "expected"),
    [
        ([], True, True),  # colocate (auto), synchronous, the server variant the machine's: CUDA
        ([], False, False),  # no GPU: nothing to give back
        ([f"{KEY}=false"], True, False),
        (["rollout.controller.max_head_offpolicyness=1"], True, False),  # generation overlaps training
        (["placement.mode=split"], True, False),
        (["placement.mode=external", "rollout.engine.server.urls=[http://127.0.0.1:1]"], True, False),
        (["rollout.engine.server.env_variant=cpu"], True, False),
    ],
)
def test_auto_is_on_for_a_synchronous_engine_on_the_trainers_gpus(host, overrides, cuda: bool, expected) -> None:
    cfg = load_config(VLLM_EXAMPLE, overrides, host=host)
    assert sleeps_while_training(cfg, releases_memory=True, cuda_available=cuda) is expected
    assert sleep_problems(cfg, cuda_available=cuda) == []  # auto and false are never refused


def test_auto_leaves_an_embedded_engine_awake(host) -> None:
    """The ``hf`` engine (no servers) can sleep (``true``), but ``auto`` keeps its graphs."""
    embedded = ["rollout.engine={name: hf}", "rollout.weight_sync=memory"]
    cfg = load_config(VLLM_EXAMPLE, embedded, host=host)
    assert not sleeps_while_training(cfg, releases_memory=True, cuda_available=True)
    forced = load_config(VLLM_EXAMPLE, [*embedded, f"{KEY}=true"], host=host)
    assert sleeps_while_training(forced, releases_memory=True, cuda_available=True)


# -- in a run ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return merged(
        build_task(tmp_path_factory.mktemp("colocation")),
        trainer={"total_steps": 2, "torch_threads": 1},
        saver={"every_n_steps": 0, "at_end": False, "export_hf": False},
    )


def _record_calls(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    """Record the calls the trainer makes on the hf rollout engine and the fsdp train engine."""
    from core_rl_fsdp.engine import FSDPEngine
    from core_rl_hf.engine import HFRolloutEngine

    def recorded(cls: type, name: str, label: Any) -> None:
        original = getattr(cls, name)

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            events.append(label(*args, **kwargs) if callable(label) else label)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, call)

    recorded(HFRolloutEngine, "generate", "generate")
    recorded(HFRolloutEngine, "release_memory", "release")
    recorded(HFRolloutEngine, "restore_memory", lambda parts=("weights", "kv_cache"): f"restore {','.join(parts)}")
    recorded(HFRolloutEngine, "update_weights_from_buckets", "load weights")
    recorded(FSDPEngine, "train_step", "train")


def _squeezed(events: list[str]) -> list[str]:
    return [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]


@pytest.mark.parametrize("sleep", [True, False])
def test_the_engine_sleeps_from_generation_to_the_weight_update(task, host, monkeypatch, sleep: bool) -> None:
    import core_rl.rollout.colocation

    events: list[str] = []
    _record_calls(monkeypatch, events)
    # torch's cached blocks go back to the driver before the engine takes memory back
    monkeypatch.setattr(core_rl.rollout.colocation, "release_cached_memory", lambda: events.append("release cache"))
    if sleep:  # as auto resolves on a GPU with the engine on the trainer's devices
        monkeypatch.setattr(core_rl.rollout.colocation, "sleeps_while_training", lambda *a, **k: True)
    config = merged(task, experiment={"name": f"sleep{sleep}"})
    train_here(config, host)
    step = ["generate", "release", "train", "release cache", "restore weights", "load weights"] if sleep else None
    if sleep:
        assert _squeezed(events) == [*step, "release cache", "restore kv_cache", *step]
    else:
        assert _squeezed(events) == ["generate", "train", "load weights"] * 2
    rows = read_metrics(run_dir(config) / "metrics.jsonl")
    for row in rows:
        timings = {"timing/rollout_release_s", "timing/rollout_restore_s"}
        assert timings <= set(row) if sleep else not timings & set(row)
        # what the engine gave back, in device memory: only where it sleeps on a GPU (a CPU reports none)
        assert ("memory/rollout_released_gib" in row) == (sleep and torch.cuda.is_available())


def test_a_rank_without_the_engine_gives_back_its_cache_where_the_engine_sleeps(host, monkeypatch) -> None:
    """A colocated server may wake on another rank's GPU: that rank gives back torch's cached
    memory before each weight update where the run's engine sleeps, and does nothing otherwise."""
    import core_rl.rollout.colocation as colocation

    calls: list[str] = []
    monkeypatch.setattr(colocation, "release_cached_memory", lambda: calls.append("release cache"))
    cfg = load_config(str(VLLM_EXAMPLE), [], host=host)
    for sleeps in (False, True):
        monkeypatch.setattr(colocation, "sleeps_while_training", lambda *a, sleeps=sleeps, **k: sleeps)
        peer = colocation.peer_rollout_sleep(cfg, host)
        assert peer.before_weight_update() == {} and not peer.enabled
        assert calls == (["release cache"] if sleeps else [])


GIB = 2**30


def test_colocated_budget_is_what_the_trainer_leaves_less_a_reserve() -> None:
    from core_rl.rollout.colocated_memory import SharedGPU

    # 70 GiB free, 6 GiB of optimiser state still to come, 5% of 80 GiB kept back
    assert SharedGPU("cuda:0", total=80 * GIB, free=70 * GIB, pending=6 * GIB).budget == 60 * GIB
    assert SharedGPU("cuda:0", total=80 * GIB, free=70 * GIB, pending=6 * GIB, servers=2).budget == 30 * GIB


class _OnGPU:
    """A train engine as the budget sees it: on a CUDA device (no GPU is touched: the figures are given)."""

    device = "cuda:0"


@pytest.mark.parametrize(
    ("server", "local_world_size", "share"),
    [
        ({"gpus": [0]}, 1, 0.75),  # on rank 0's GPU: 60 of 80 GiB
        ({"gpus": [0], "num_servers": 2}, 1, 0.375),  # two servers share it
        ({"gpus": [0, 1], "num_servers": 2}, 2, 0.75),  # one on each trainer GPU
        ({"gpus": [1]}, 1, 0.0),  # a GPU of its own: vLLM's default stands
        ({}, 1, 0.0),  # GPUs chosen by server.env or not at all: nothing known to share
    ],
)
def test_vllm_on_the_trainers_gpu_is_sized_from_its_free_memory(monkeypatch, server, local_world_size, share) -> None:
    import core_rl.rollout.colocated_memory as colocated
    import torch
    from core_rl.config.checks import MachineInfo
    from core_rl.config.schema import ActorConfig
    from core_rl.roles.built_engines import BuiltEngine
    from core_rl_server_kit.remote import ServerOptions
    from core_rl_vllm.config import VLLMConfig

    released: list[bool] = []
    monkeypatch.setattr(colocated, "release_cached_memory", lambda: released.append(True))
    monkeypatch.setattr(colocated, "free_bytes", lambda device: 70 * GIB)
    monkeypatch.setattr(colocated, "pending_bytes", lambda built, device: 6 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * GIB, 80 * GIB))
    built = [BuiltEngine("actor", ActorConfig(), _OnGPU(), trainable=True)]
    machine = MachineInfo(cuda_device_count=2, local_world_size=local_world_size)
    config = VLLMConfig(server=ServerOptions(**server))
    shared = colocated.shared_gpu(config, built, machine)
    fitted, note = colocated.fit_colocated_memory(config, shared)
    assert fitted.gpu_memory_utilization == share
    assert (note is not None) == bool(share) == bool(released) == (shared is not None)
    if shared is not None:
        assert shared.pending == 6 * GIB  # what the servers' start leaves to the trainer
    cpu_built = [BuiltEngine("actor", ActorConfig(), object(), trainable=True)]  # a CPU trainer shares no GPU
    assert colocated.shared_gpu(config, cpu_built, machine) is None
    assert colocated.fit_colocated_memory(config, None) == (config, None)


def test_the_trainers_pending_memory_is_held_while_the_servers_start(monkeypatch) -> None:
    """The bytes the trainer's first step still allocates are taken on its device for the servers'
    start (a server sizing itself from free memory leaves them) and given back after it, also when
    the start fails. (On this CPU machine the bytes are host memory; on a GPU the device's.)"""
    import weakref

    import core_rl.rollout.colocated_memory as colocated
    import torch

    released: list[bool] = []
    monkeypatch.setattr(colocated, "release_cached_memory", lambda: released.append(True))
    created: list[weakref.ref] = []
    real_empty = torch.empty

    def recording_empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        created.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(colocated.torch, "empty", recording_empty)
    shared = colocated.SharedGPU("cpu", total=8 * GIB, free=4 * GIB, pending=3 * 2**20)
    with colocated.held_for_trainer(shared):
        (held,) = created
        assert held() is not None and held().numel() == 3 * 2**20 and held().device.type == "cpu"
    assert held() is None and released == [True]
    with pytest.raises(RuntimeError, match="server failed"), colocated.held_for_trainer(shared):
        raise RuntimeError("server failed")
    assert created[1]() is None and released == [True, True]
    with colocated.held_for_trainer(None):
        pass
    assert len(created) == 2  # nothing held without a shared GPU


def test_pending_memory_that_cannot_be_held_is_a_warning_not_a_failed_start(monkeypatch, capsys) -> None:
    """The pending figure is an estimate: where the device cannot give that much, the servers start
    without the hold, and the run says so."""
    import core_rl.rollout.colocated_memory as colocated
    import torch

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(colocated.torch, "empty", out_of_memory)
    started = []
    with colocated.held_for_trainer(colocated.SharedGPU("cuda:0", total=80 * GIB, free=4 * GIB, pending=6 * GIB)):
        started.append(True)
    assert started == [True]
    err = capsys.readouterr().err
    assert "could not hold 6.0 GiB on cuda:0" in err and "4.0 GiB free" in err


@pytest.mark.parametrize(
    ("env", "is_main", "holds"),
    [
        ({"GROUP_RANK": "0", "LOCAL_RANK": "1"}, False, True),  # rank 1, whose GPU gets server 1
        ({"GROUP_RANK": "0", "LOCAL_RANK": "0"}, True, False),  # rank 0 holds while it builds, not here
        ({"GROUP_RANK": "1", "LOCAL_RANK": "1"}, False, False),  # another node: no server starts there
    ],
)
def test_the_other_ranks_hold_their_pending_memory_while_rank_0_starts_servers_on_their_gpus(
    tmp_path, monkeypatch, env, is_main, holds
) -> None:
    """Colocated, 2 ranks and 2 servers (the placement puts server ``i`` on rank ``i``'s GPU)."""
    import core_rl.loops.preflight
    import core_rl.rollout.colocated_memory as colocated
    import torch
    from core_rl.config.checks import MachineInfo
    from core_rl.config.schema import ActorConfig
    from core_rl.roles.built_engines import BuiltEngine
    from test_server_gpus import _run_config

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(
        core_rl.loops.preflight, "detect_machine", lambda: MachineInfo(cuda_device_count=2, local_world_size=2)
    )
    monkeypatch.setattr(colocated, "release_cached_memory", lambda: None)
    monkeypatch.setattr(colocated, "free_bytes", lambda device: 70 * GIB)
    monkeypatch.setattr(colocated, "pending_bytes", lambda built, device: 6 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * GIB, 80 * GIB))
    held: list[tuple[int, str]] = []
    monkeypatch.setattr(colocated.torch, "empty", lambda n, dtype, device: held.append((n, device)) or torch.zeros(1))
    cfg = _run_config(tmp_path, ["rollout.engine.server.num_servers=2"])
    built = [BuiltEngine("actor", ActorConfig(), _OnGPU(), trainable=True)]
    with colocated.held_by_peer(cfg, built, is_main):
        pass
    assert held == ([(6 * GIB, torch.device("cuda:0"))] if holds else [])
