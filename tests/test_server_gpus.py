"""``rollout.engine.server.gpus``: which GPUs the servers core-rl starts run on (core_rl.launch.gpus).

The shares are checked against hand-written lists and, with hypothesis, against their invariants;
the placement's choice through the resolution the trainer runs (a :class:`MachineInfo` standing for
a machine with GPUs); and the ``CUDA_VISIBLE_DEVICES`` of real started server processes (the fake
HTTP server of test_servers.py, read back from ``/proc/PID/environ``). No GPU is needed: only the
variable is set, and a CPU process ignores it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from core_rl.config.checks import MachineInfo
from core_rl.config.loader import structure
from core_rl.errors import ConfigError, CoreRLError
from core_rl.launch.gpus import placed_gpus, resolve_server_gpus, servers_gpus, visible_devices
from core_rl.testing.processes import environment_of
from core_rl_server_kit.remote import ServerOptions
from core_rl_server_kit.remote.weights import auto_weight_backend
from hypothesis import given
from hypothesis import strategies as st
from test_remote import FakeEngine
from test_servers import SERVER


def test_shares_in_order_and_around_a_shorter_list() -> None:
    assert servers_gpus([2, 3], 2, 1) == [[2], [3]]
    assert servers_gpus([4, 5, 6, 7], 2, 2) == [[4, 5], [6, 7]]
    assert servers_gpus([0], 3, 1) == [[0], [0], [0]]  # three servers share the one GPU
    assert servers_gpus([0, 1], 3, 1) == [[0], [1], [0]]
    assert servers_gpus([0, 1], 2, 2) == [[0, 1], [0, 1]]


@pytest.mark.parametrize(
    ("gpus", "num_servers", "per_server", "message"),
    [
        ([1, 1], 2, 1, "lists a GPU twice"),
        ([0], 1, 2, r"holds 1 GPU\(s\), but one server takes 2"),
        ([0, 1, 2], 1, 2, r"num_servers to 1|list 2"),
        ([0, 1, 2, 3], 1, 2, "raise rollout.engine.server.num_servers to 2"),
    ],
)
def test_shares_that_cannot_work_name_the_key(gpus, num_servers, per_server, message) -> None:
    with pytest.raises(CoreRLError, match=message) as caught:
        servers_gpus(gpus, num_servers, per_server)
    assert "rollout.engine.server.gpus" in str(caught.value)


@given(
    gpus=st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True),
    num_servers=st.integers(1, 6),
    per_server=st.integers(1, 4),
)
def test_share_invariants(gpus: list[int], num_servers: int, per_server: int) -> None:
    """Each server holds ``per_server`` distinct GPUs of the list, every GPU listed is used, and
    the shares walk the list in order."""
    if len(gpus) < per_server or len(gpus) > num_servers * per_server:
        with pytest.raises(CoreRLError):
            servers_gpus(gpus, num_servers, per_server)
        return
    shares = servers_gpus(gpus, num_servers, per_server)
    assert len(shares) == num_servers
    assert all(len(set(s)) == per_server and set(s) <= set(gpus) for s in shares)
    assert {g for s in shares for g in s} == set(gpus)
    walked = [g for s in shares for g in s]
    assert walked == [gpus[k % len(gpus)] for k in range(num_servers * per_server)]


def test_placement_chooses_after_the_trainer_or_its_own() -> None:
    assert placed_gpus("split", 1, 1, 1, 2) == [1]
    assert placed_gpus("split", 2, 2, 2, 8) == [2, 3, 4, 5]
    assert placed_gpus("colocate", 2, 1, 2, 2) == [0, 1]  # one TP-2 server over both trainer GPUs
    assert placed_gpus("colocate", 2, 4, 1, 2) == [0, 1]  # four servers, two per trainer GPU
    assert placed_gpus("colocate", 0, 2, 1, 4) == [0, 1]  # a CPU trainer: the first GPUs
    with pytest.raises(CoreRLError, match="need 3 GPUs, but this machine has 2"):
        placed_gpus("split", 2, 1, 1, 2)
    with pytest.raises(CoreRLError, match="one server takes 2 GPUs .* the trainer has 1"):
        placed_gpus("colocate", 1, 1, 2, 8)


def test_visible_devices_count_the_gpus_this_process_sees() -> None:
    assert visible_devices([1, 2], parent="") == "1,2"
    assert visible_devices([0, 2], parent="5, 6,7") == "5,7"
    assert visible_devices([0], parent="GPU-aa,GPU-bb") == "GPU-aa"  # UUIDs pass through
    with pytest.raises(CoreRLError, match=r"GPU\(s\) \[2\] do not exist here: this process sees 2"):
        visible_devices([2], parent="3,4")


def test_a_gpu_listed_twice_or_negative_is_a_config_error() -> None:
    assert structure({"gpus": [1, 0]}, ServerOptions).gpus == [1, 0]
    for bad in ([0, 0], [-1]):
        with pytest.raises(ConfigError, match="gpus"):
            structure({"gpus": bad}, ServerOptions)


@pytest.mark.parametrize(
    ("options", "variant", "backend"),
    [
        ({"gpus": [1]}, "cuda", "nccl"),  # a GPU other than rank 0's
        ({"gpus": [0]}, "cuda", "gloo"),  # on rank 0's GPU
        ({"gpus": [1, 0]}, "cuda", "gloo"),
        ({"gpus": [1]}, "cpu", "gloo"),
    ],
)
def test_weight_sync_auto_follows_the_servers_gpus(options, variant, backend) -> None:
    assert auto_weight_backend(ServerOptions(**options), variant) == backend


# -- the placement's choice, as the trainer resolves it -----------------------------------------


def _run_config(tmp_path: Path, overrides: list[str]) -> Any:
    from core_rl.config import load_config
    from core_rl.plugins.host import PluginHost

    config = tmp_path / "run.yaml"
    config.write_text(
        "actor: {model_path: /models/none}\n"
        "data: {train_files: [/data/none.jsonl]}\n"
        "rollout: {weight_sync: disk, engine: {name: vllm, server: {env_variant: cuda}}}\n"
        "algorithm: {name: grpo}\n"
        "reward: {name: char_match}\n"
    )
    return load_config(str(config), overrides, host=PluginHost())


@pytest.mark.parametrize(
    ("overrides", "machine", "gpus"),
    [
        (["placement.mode=split"], MachineInfo(cuda_device_count=2, local_world_size=1), [1]),
        (
            ["placement.mode=split", "rollout.engine.server.num_servers=2", "rollout.engine.tensor_parallel_size=2"],
            MachineInfo(cuda_device_count=8, local_world_size=4),
            [4, 5, 6, 7],
        ),
        ([], MachineInfo(cuda_device_count=2, local_world_size=2), [0]),  # colocate: rank 0's GPU
        (
            ["rollout.engine.server.num_servers=2"],
            MachineInfo(cuda_device_count=2, local_world_size=2),
            [0, 1],  # one per trainer GPU
        ),
        ([], MachineInfo(cuda_device_count=1, local_world_size=1), [0]),
    ],
)
def test_the_placement_chooses_the_servers_gpus(tmp_path: Path, overrides, machine, gpus) -> None:
    cfg = _run_config(tmp_path, overrides)
    engine_config, note = resolve_server_gpus(cfg, machine)
    assert engine_config.server.gpus == gpus
    assert note is not None and f"rollout.engine.server.gpus: [] -> {gpus}" in note
    assert cfg.rollout.engine.config.server.gpus == []  # the run's config itself is left as it was


@pytest.mark.parametrize(
    ("overrides", "machine"),
    [
        (["rollout.engine.server.gpus=[3]"], MachineInfo(cuda_device_count=8)),  # chosen by the user
        (["rollout.engine.server.env.CUDA_VISIBLE_DEVICES='2'"], MachineInfo(cuda_device_count=8)),
        (["rollout.engine.server.env_variant=cpu"], MachineInfo(cuda_device_count=8)),  # CPU servers
        ([], MachineInfo(cuda_device_count=0)),  # no GPU the trainer sees
    ],
)
def test_nothing_is_chosen_where_the_user_chose_or_there_is_no_gpu(tmp_path: Path, overrides, machine) -> None:
    cfg = _run_config(tmp_path, overrides)
    engine_config, note = resolve_server_gpus(cfg, machine)
    assert note is None and engine_config is cfg.rollout.engine.config


def test_too_few_gpus_for_a_split_placement_is_a_preflight_problem(tmp_path: Path) -> None:
    from core_rl.loops.preflight import server_gpu_problems

    cfg = _run_config(tmp_path, ["placement.mode=split"])
    (problem,) = server_gpu_problems(cfg, MachineInfo(cuda_device_count=1, local_world_size=1))
    assert "placement.mode: split" in problem and "need 2 GPUs, but this machine has 1" in problem
    assert server_gpu_problems(cfg, MachineInfo(cuda_device_count=2, local_world_size=1)) == []


# -- real started servers get their share -------------------------------------------------------


@attrs.define
class _Config:
    """What the engine asks of its plugin config here: a server's GPU count."""

    per_server: int

    def gpus_per_server(self) -> int:
        return self.per_server


class StartedFakeEngine(FakeEngine):
    """:class:`FakeEngine` that starts its servers (test_servers.py's fake HTTP server)."""

    def __init__(self, options: ServerOptions, run_dir: Path, per_server: int) -> None:
        self.config = _Config(per_server)
        super().__init__("/models/none", options, run_dir)

    def server_command(self, python: str, port: int, index: int) -> list[str]:
        return [python, "-c", SERVER, str(port)]


def test_each_started_server_sees_its_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the trainer's own view: indices count it
    options = structure(
        {"python": sys.executable, "num_servers": 2, "gpus": [3, 1], "startup_timeout": 60}, ServerOptions
    )
    engine = StartedFakeEngine(options, tmp_path, per_server=1)
    try:
        seen = [environment_of(ep.server.pid)["CUDA_VISIBLE_DEVICES"] for ep in engine.endpoints]
    finally:
        engine.close()
    assert seen == ["7", "5"]


def test_gpus_and_an_env_cuda_visible_devices_together_are_refused(tmp_path: Path) -> None:
    options = structure(
        {"python": sys.executable, "gpus": [0], "env": {"CUDA_VISIBLE_DEVICES": "1"}, "startup_timeout": 60},
        ServerOptions,
    )
    with pytest.raises(CoreRLError, match="gpus and rollout.engine.server.env.CUDA_VISIBLE_DEVICES"):
        StartedFakeEngine(options, tmp_path, per_server=1)
