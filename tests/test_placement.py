"""Placement (``placement:``) against what a launcher offers, the launcher kind, and the rendezvous
a launcher hands each rank: figures computed by hand, messages naming key and shortfall, and a
property test against a brute-force assignment of GPUs to roles."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import ClassVar

import attrs
import core_rl.builtin.launchers
import pytest
import yaml
from core_rl.config import load_config
from core_rl.errors import ConfigError
from core_rl.hookspecs import Register, hookimpl
from core_rl.launch.launchers import Launcher, LaunchRequest, build_launcher, launch_checked, launcher_check
from core_rl.launch.placement import ClusterResources, placement_mode, placement_problems
from core_rl.launch.rendezvous import Rendezvous
from core_rl.testing import LauncherContract, preloaded
from hypothesis import given, settings
from hypothesis import strategies as st

GPU_NODE = ClusterResources(nodes=2, gpus_per_node=2, cpus_per_node=64, source="launcher.nodes x gpus_per_node")


def _load(tmp_path: Path, config: dict, *overrides: str, host) -> object:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_config(path, overrides, host=host)


def _placed(tmp_path, minimal_config, host, **placement):
    return _load(tmp_path, {**minimal_config, "placement": placement}, host=host)


def test_split_counts_actor_and_rollout_and_names_the_shortfall(tmp_path, minimal_config, host):
    cfg = _placed(tmp_path, minimal_config, host, mode="colocate", actor={"gpus": 2, "nodes": 2}, rollout={"gpus": 2})
    assert placement_problems(cfg, GPU_NODE) == []  # colocate: max(2 x 2, 2 x 1) = 4 GPUs of 4
    cfg.placement.mode = "split"  # 4 + 2 = 6 GPUs of 4; 2 + 1 nodes of 2, and a node holds 2 GPUs, not 2 + 2
    assert placement_problems(cfg, GPU_NODE) == [
        "placement.rollout.gpus: split placement needs 4 GPUs for the actor (placement.actor.gpus x nodes = 2 x 2) "
        "and 2 for rollout, 6 in all; the launcher offers 4 (2 nodes x 2 per node: launcher.nodes x gpus_per_node)",
        "placement.rollout.nodes: split placement needs 2 nodes for the actor and 1 for rollout (3 in all: one node "
        "cannot hold a node's share of both); the launcher offers 2 (launcher.nodes x gpus_per_node)",
    ]
    cfg.placement.actor.nodes = 1  # 2 + 2 GPUs of 4, on 1 + 1 nodes of 2
    assert placement_problems(cfg, GPU_NODE) == []


def test_a_role_larger_than_a_node_or_the_cluster(tmp_path, minimal_config, host):
    cfg = _placed(tmp_path, minimal_config, host, actor={"gpus": 3, "cpus": 65, "nodes": 3})
    assert placement_problems(cfg, GPU_NODE) == [
        "placement.actor.nodes: 3 nodes, but the launcher offers 2 (launcher.nodes x gpus_per_node)",
        "placement.actor.gpus: 3 GPUs per node, but a node has 2 (launcher.nodes x gpus_per_node)",
        "placement.actor.cpus: 65 CPU cores per node, but a node has 64 (launcher.nodes x gpus_per_node)",
    ]


@settings(max_examples=150, deadline=None)
@given(
    mode=st.sampled_from(["colocate", "split"]),
    actor=st.tuples(st.integers(0, 4), st.integers(1, 3)),
    rollout=st.tuples(st.integers(0, 4), st.integers(1, 3)),
    nodes=st.integers(1, 4),
    per_node=st.integers(0, 4),
)
def test_gpu_fit_agrees_with_placing_roles_on_nodes(mode, actor, rollout, nodes, per_node):
    """Another formulation: try every choice of distinct nodes for each role's per-node share
    (split: the two roles' shares on one node add up; colocate: they share the node's GPUs)."""
    from core_rl.config.placement import PlacementConfig, RolePlacement
    from core_rl.config.schema import RunConfig

    placement = PlacementConfig(
        mode=mode,
        actor=RolePlacement(gpus=actor[0], nodes=actor[1]),
        rollout=RolePlacement(gpus=rollout[0], nodes=rollout[1]),
    )
    cfg = RunConfig(placement=placement)

    def fits_on(actor_nodes: tuple[int, ...], rollout_nodes: tuple[int, ...]) -> bool:
        used = [0] * nodes
        for (gpus, _), chosen in ((actor, actor_nodes), (rollout, rollout_nodes)):
            for node in chosen:
                used[node] = used[node] + gpus if mode == "split" else max(used[node], gpus)
        return all(u <= per_node for u in used)

    fits = any(
        fits_on(a, r)
        for a in itertools.combinations(range(nodes), actor[1])
        for r in itertools.combinations(range(nodes), rollout[1])
    )
    resources = ClusterResources(nodes=nodes, gpus_per_node=per_node, cpus_per_node=0)
    assert (placement_problems(cfg, resources) == []) == fits


def test_external_means_server_urls_and_split_means_servers(tmp_path, minimal_config, host):
    with pytest.raises(ConfigError) as info:
        _placed(tmp_path, minimal_config, host, mode="split")
    assert info.value.problems == [
        "placement.mode: split gives rollout servers GPUs or nodes of their own, but rollout engine 'gen' runs "
        "inside trainer rank 0; choose colocate, or a server-backed engine (vllm, sglang)"
    ]
    pytest.importorskip("core_rl_vllm")
    vllm = {
        **minimal_config,
        "rollout": {"engine": {"name": "vllm", "server": {"urls": ["http://10.0.0.2:8000"]}}, "weight_sync": "disk"},
    }
    with pytest.raises(ConfigError, match=r"rollout.engine.server.urls: servers someone else started make the "):
        _load(tmp_path, vllm, "placement.mode=colocate", host=host)
    auto = _load(tmp_path, vllm, host=host)  # the default mode, auto, is external when URLs are given
    assert auto.placement.mode == "auto" and placement_mode(auto) == "external"
    cfg = _load(tmp_path, vllm, "placement.mode=external", host=host)
    # external: the servers take nothing of the launcher's; only the actor's 2 GPUs count
    cfg.placement.actor.gpus = 2
    assert placement_problems(cfg, ClusterResources(1, 2, 8)) == []
    with pytest.raises(ConfigError, match=r"rollout.engine.server.urls: empty, but placement.mode is external"):
        _load(tmp_path, vllm, "rollout.engine.server.urls=[]", "placement.mode=external", host=host)


def test_other_roles_stay_with_the_actor(tmp_path, minimal_config, host):
    with pytest.raises(ConfigError) as info:
        _placed(tmp_path, minimal_config, host, critic={"gpus": 1})
    assert info.value.problems == ["placement.critic: there is no critic: section to place; remove placement.critic"]


def test_config_validate_names_the_shortfall_on_this_machine(tmp_path, minimal_config):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                **minimal_config,
                "rollout": {"engine": {"name": "hf"}},
                "actor": {"model_path": "/m", "engine": {"name": "fsdp"}},
                "algorithm": {"name": "grpo"},
                "reward": {"name": "char_match"},
                "placement": {"actor": {"cpus": 100000}},
            }
        )
    )
    proc = preloaded.run(
        [sys.executable, "-m", "core_rl.cli", "config", "validate", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert "placement.actor.cpus: 100000 CPU cores per node, but a node has" in proc.stderr
    assert "(this machine)" in proc.stderr and "Traceback" not in proc.stderr


@attrs.define
class CountingConfig:
    gpus_per_node: int = 8


class CountingLauncher(Launcher):
    """A site's launcher: offers ``gpus_per_node`` GPUs on one node and records what it launched."""

    name = "counting"

    launched: ClassVar[list[LaunchRequest]] = []  # every launch of any instance

    def __init__(self, config: CountingConfig) -> None:
        self.config = config

    def check(self, cfg, resources):
        return placement_problems(cfg, resources or ClusterResources(1, self.config.gpus_per_node, 16, "counting"))

    def launch(self, request: LaunchRequest) -> int:
        self.launched.append(request)
        return 0


class CountingPlugin:
    @hookimpl
    def core_rl_register_launchers(self, register: Register) -> None:
        register("counting", CountingLauncher, description="test launcher", config_cls=CountingConfig)


def test_a_third_party_launcher_is_selected_and_checked(tmp_path, minimal_config, host):
    host.register_plugin(CountingPlugin(), distribution="test-counting", version="1")
    config = {
        **minimal_config,
        "launcher": {"name": "counting", "gpus_per_node": 2},
        "placement": {"actor": {"gpus": 2}},
    }
    cfg = _load(tmp_path, config, host=host)
    assert isinstance(build_launcher(cfg), CountingLauncher) and launcher_check(cfg) == []
    cfg.placement.actor.gpus = 3
    assert launcher_check(cfg) == ["placement.actor.gpus: 3 GPUs per node, but a node has 2 (counting)"]
    with pytest.raises(ConfigError, match=r"placement.actor.gpus: 3 GPUs per node, but a node has 2 \(counting\)"):
        launch_checked(LaunchRequest(config_path="run.yaml", overrides=[], cfg=cfg))
    cfg.placement.actor.gpus = 2
    request = LaunchRequest(config_path="run.yaml", overrides=["x=1"], cfg=cfg, options={"site": "a"})
    assert launch_checked(request) == 0 and CountingLauncher.launched == [request]
    with pytest.raises(ConfigError, match=r"launcher.gpus_per_nod: unknown key; did you mean 'gpus_per_node'"):
        _load(tmp_path, {**config, "launcher": {"name": "counting", "gpus_per_nod": 2}}, host=host)


def test_rendezvous_round_trips_through_the_environment():
    rdzv = Rendezvous(rank=3, world_size=4, local_rank=1, local_world_size=2, master_addr="10.0.0.1", master_port=29400)
    env = rdzv.env()
    assert env == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
    }
    assert Rendezvous.from_env(env) == rdzv and Rendezvous.from_env({}) is None
    with pytest.raises(ValueError, match=r"rank 4 is not in \[0, world_size 4\)"):
        attrs.evolve(rdzv, rank=4)


class TestLocalLauncherContract(LauncherContract):
    plugin = core_rl.builtin.launchers
    name = "local"
    distribution = "core-rl"
