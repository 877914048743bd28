"""Multi-node without Ray: ``core-rl train --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT`` on
each "node" (two launcher processes on this machine, one CPU rank each) trains like one node with
two ranks (``--nproc-per-node 2``): the same metrics, step by step."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml
from core_rl.testing import preloaded
from core_rl.testing.faults import build_task, merged, stable_metrics
from core_rl.testing.launch import cpu_ranks_env, free_port

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

COMPARED = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy", "response_length/mean")


TIMEOUT_2S = "launcher={name: local, rdzv_timeout_s: 2}"


def _train(config: Path, name: str, *options: str, overrides: Sequence[str] = ()) -> subprocess.Popen:
    """``core-rl train OPTIONS CONFIG experiment.name=NAME OVERRIDES`` on CPU ranks."""
    env = cpu_ranks_env({**cpu_ranks_env(), "OMP_NUM_THREADS": "1"})
    return preloaded.Popen(
        [sys.executable, "-m", "core_rl.cli", "train", *options, str(config), f"experiment.name={name}", *overrides],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
    return err


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("multinode")
    config = merged(build_task(root), trainer={"total_steps": 2}, saver={"every_n_steps": 0})
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, root / "runs"


def test_two_nodes_match_two_ranks_on_one_node(task: tuple[Path, Path]) -> None:
    config, runs = task
    _finish(_train(config, "one_node", "--nproc-per-node", "2"))
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        _train(config, "two", "--nnodes", "2", "--node-rank", str(r), "--rdzv-endpoint", endpoint)
        for r in (1, 0)  # node 1 first: it waits for node 0's store
    ]
    for node in nodes:
        _finish(node)
    one, two = stable_metrics(runs / "one_node"), stable_metrics(runs / "two")
    assert sorted(one) == sorted(two) == [1, 2]
    for step in one:
        for key in COMPARED:  # a zero-signal step (every advantage 0) has no actor/entropy, on both
            assert (key in two[step]) == (key in one[step]), (step, key)
            if key in one[step]:
                assert two[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-6), (step, key)


def test_a_node_whose_node_0_never_comes_stops_with_a_message(task: tuple[Path, Path]) -> None:
    config, _ = task
    endpoint = f"127.0.0.1:{free_port()}"
    proc = _train(
        config, "alone", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint, overrides=[TIMEOUT_2S]
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in err and "frame #" not in err, err[-3000:]
    assert f"node 1 of 2: the rendezvous at {endpoint} did not complete within 2 s (node 0 does not answer" in err
