"""The ray launcher without a cluster: its registration and configuration (conformance), the
placement group it plans for each placement, and the devices each rank's process is given."""

from __future__ import annotations

import subprocess
import sys

import pytest
from core_rl.config.placement import RolePlacement
from core_rl.launch.launchers import Launcher
from core_rl.launch.placement import ClusterResources
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import LAUNCHER
from core_rl_ray.config import RayLauncherConfig
from core_rl_ray.launcher import RayLauncher, node_layout
from core_rl_ray.placement import Slot, plan
from hypothesis import given
from hypothesis import strategies as st


def test_registered_as_the_ray_launcher_and_light_to_load():
    host = PluginHost()
    entry = host.get(LAUNCHER, "ray")
    assert entry.distribution == "core-rl-ray" and entry.config_cls is RayLauncherConfig
    assert isinstance(entry.factory(RayLauncherConfig()), Launcher)
    # every core-rl command loads launcher plugins to build its command line: no ray import there
    code = "import sys; from core_rl.cli import build_parser; build_parser(); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_train_takes_ray_address_and_a_bad_strategy_is_a_config_error(tmp_path):
    from core_rl.cli import build_parser

    args = build_parser().parse_args(["train", "--ray-address", "10.0.0.1:6379", "run.yaml"])
    assert args.ray_address == "10.0.0.1:6379" and "ray_address" in args.launcher_options
    config = tmp_path / "run.yaml"
    config.write_text("launcher: {name: ray, strategy: TIGHT}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "core_rl.cli", "config", "validate", str(config)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "launcher.strategy" in proc.stderr and "Traceback" not in proc.stderr


def test_split_gives_servers_bundles_of_their_own():
    p = plan(
        "split",
        RolePlacement(gpus=2, cpus=8, nodes=2),
        RolePlacement(gpus=2, cpus=4, nodes=1),
        cpu_ranks_per_node=0,
        num_servers=2,
    )
    assert p.bundles == [{"CPU": 4.0, "GPU": 1.0}] * 4 + [{"CPU": 2.0, "GPU": 1.0}] * 2
    assert p.ranks == [Slot(i, 4.0, 1.0) for i in range(4)]
    assert p.servers == [Slot(4, 2.0, 1.0), Slot(5, 2.0, 1.0)]
    assert p.strategy == "SPREAD"  # the actor asks for 2 nodes
    assert p.totals() == {"CPU": 20.0, "GPU": 6.0}


def test_colocate_puts_servers_in_the_ranks_bundles():
    gpu = plan("colocate", RolePlacement(gpus=2), RolePlacement(gpus=2), cpu_ranks_per_node=0, num_servers=1)
    assert gpu.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert gpu.ranks == [Slot(0, 1.0, 0.5), Slot(1, 1.0, 0.5)]  # half a GPU each: Ray gives both the same one
    assert gpu.servers == [Slot(0, 0.0, 0.5)]
    assert gpu.strategy == "STRICT_PACK"
    cpu = plan("colocate", RolePlacement(), RolePlacement(), cpu_ranks_per_node=2, num_servers=3)
    assert cpu.bundles == [{"CPU": 1.0}] * 2 and cpu.ranks == [Slot(0, 1.0, 0.0), Slot(1, 1.0, 0.0)]
    assert [s.bundle for s in cpu.servers] == [0, 1, 0] and all(s.cpus == 0 for s in cpu.servers)
    hf = plan("colocate", RolePlacement(), RolePlacement(), cpu_ranks_per_node=2, num_servers=0)
    assert hf.servers == [] and hf.strategy == "STRICT_PACK"
    assert plan("split", RolePlacement(), RolePlacement(), cpu_ranks_per_node=1, num_servers=1).strategy == "PACK"
    given_strategy = plan(
        "colocate", RolePlacement(), RolePlacement(), cpu_ranks_per_node=1, num_servers=0, strategy="SPREAD"
    )
    assert given_strategy.strategy == "SPREAD"


@given(
    st.lists(st.tuples(st.sampled_from(["n1", "n2", "n3"]), st.integers(0, 7)), min_size=1, max_size=12, unique=True)
)
def test_each_gpu_rank_sees_its_nodes_ranks_gpus_and_its_own_at_local_rank(ranks):
    places = [{"node_id": node, "gpu_ids": [str(gpu)]} for node, gpu in ranks]
    layout = node_layout(places)
    for place, loc in zip(places, layout):
        visible = loc["CUDA_VISIBLE_DEVICES"].split(",")
        same_node = sorted(int(g) for p in places if p["node_id"] == place["node_id"] for g in p["gpu_ids"])
        assert [int(g) for g in visible] == same_node  # Ray's ids in numeric order: cuda:i is the i-th
        assert visible[int(loc["local_rank"])] == place["gpu_ids"][0]
        assert int(loc["local_world_size"]) == len(same_node)
    by_node: dict[str, list[int]] = {}
    for place, loc in zip(places, layout):
        by_node.setdefault(place["node_id"], []).append(int(loc["local_rank"]))
    assert all(sorted(v) == list(range(len(v))) for v in by_node.values())  # local ranks 0..n-1 per node


def test_cpu_ranks_see_no_gpu_and_count_locally():
    places = [{"node_id": n, "gpu_ids": []} for n in ("a", "b", "a", "a")]
    assert node_layout(places) == [
        {"local_rank": "0", "local_world_size": "3", "CUDA_VISIBLE_DEVICES": ""},
        {"local_rank": "0", "local_world_size": "1", "CUDA_VISIBLE_DEVICES": ""},
        {"local_rank": "1", "local_world_size": "3", "CUDA_VISIBLE_DEVICES": ""},
        {"local_rank": "2", "local_world_size": "3", "CUDA_VISIBLE_DEVICES": ""},
    ]


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        (ClusterResources(nodes=2, gpus_per_node=4, cpus_per_node=16, source="Ray"), []),
        (
            ClusterResources(nodes=1, gpus_per_node=4, cpus_per_node=16, source="Ray"),
            ["placement.rollout.gpus", "placement.rollout.nodes"],
        ),
    ],
)
def test_check_names_the_role_and_the_shortfall(tmp_path, resources, expected):
    from core_rl.config import load_config

    config = tmp_path / "run.yaml"
    config.write_text(
        "actor: {model_path: m}\nrollout: {engine: {name: vllm}, weight_sync: disk}\nalgorithm: {name: grpo}\n"
        "reward: {name: char_match}\ndata: {train_files: [d.jsonl]}\nlauncher: {name: ray, address: 'h:1'}\n"
        "placement: {mode: split, actor: {gpus: 4}, rollout: {gpus: 4}}\n"
    )
    pytest.importorskip("core_rl_vllm")
    cfg = load_config(str(config), [], host=PluginHost())
    problems = RayLauncher(cfg.launcher.config).check(cfg, resources)
    assert [p.split(":")[0] for p in problems] == expected
    gpus = [p for p in problems if p.startswith("placement.rollout.gpus")]
    assert all("4 GPUs for the actor" in p and "4 for rollout, 8 in all" in p and "offers 4" in p for p in gpus)


@pytest.mark.parametrize(
    ("code", "status", "says", "retriable"),
    [
        (-9, 1, "was killed by SIGKILL", True),
        (1, 1, "exited with status 1", True),
        (2, 2, "exited with status 2", False),  # a user's mistake: a restart cannot help
        (3, 3, "was stopped by a signal", False),
    ],
)
def test_a_ranks_exit_becomes_the_runs_outcome(code, status, says, retriable):
    from core_rl_ray.watch import _rank_exit

    outcome = _rank_exit(1, "actor run/rank-1 (pid 7 on node 10.0.0.2)", code)
    assert (outcome.code, outcome.retriable) == (status, retriable)
    assert outcome.message.startswith("trainer rank 1 (actor run/rank-1 (pid 7 on node 10.0.0.2))") and says in (
        outcome.message
    )
    if code >= 0:  # the line the rank's process ended with, quoted instead of pointing above
        assert outcome.message.endswith("(its message is above)")
        noted = _rank_exit(1, "actor run/rank-1", code, "no progress for 62 s (...)")
        assert noted.message.endswith(f"{says}: no progress for 62 s (...)") and noted.code == status


def test_server_gpus_are_refused_where_ray_places_the_servers(tmp_path):
    from core_rl.config import load_config

    config = tmp_path / "run.yaml"
    config.write_text(
        "actor: {model_path: m}\nrollout: {engine: {name: vllm, server: {gpus: [1]}}, weight_sync: disk}\n"
        "algorithm: {name: grpo}\nreward: {name: char_match}\ndata: {train_files: [d.jsonl]}\n"
        "launcher: {name: ray, address: 'h:1'}\nplacement: {mode: split, actor: {gpus: 1}, rollout: {gpus: 1}}\n"
    )
    pytest.importorskip("core_rl_vllm")
    cfg = load_config(str(config), [], host=PluginHost())
    resources = ClusterResources(nodes=1, gpus_per_node=2, cpus_per_node=16, source="Ray")
    (problem,) = RayLauncher(cfg.launcher.config).check(cfg, resources)
    assert problem.startswith("rollout.engine.server.gpus: [1], but under the ray launcher")
