"""Runs through ``core-rl train --ray-address`` on a real two-node Ray cluster (conftest.py):

- 2 Ray ranks log the same metrics as 2 ``torchrun`` ranks (the tolerance of
  ``tests/test_train_e2e.py::test_two_ranks_match_one_rank``);
- a trainer rank's actor killed mid-run: with ``recover.mode: auto`` the launcher restarts every
  actor, the run resumes from its checkpoint and ends as a straight run does, leaving no process;
- the tiny GRPO example with 2 trainer ranks and a vLLM CPU server as actors of their own: in
  ``split`` (weights over a gloo collective at rank 0's node address) every step samples with
  exactly the weights being trained, as in the local run that shows the reward rising
  (``tests/test_server_grpo.py``); in ``colocate`` (weights through the shared run directory) it trains 4 steps, then
  the server's actor is killed: the run ends with an error naming the actor and its node, the
  checkpoint it saved before intact, and no process left;
- a rank stuck inside a step (told to sleep there): the progress watchdogs of the actors' processes
  write the hang file and stop the run, and the driver's message quotes the diagnosis;
- a node lost mid-run (its raylet and every process on it killed; the module's last test, as the
  cluster has one node after it): the run ends with an error naming the actor that died and its
  node, the checkpoint intact, no process left.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.reliability.progress import STALL_VARIABLE
from core_rl.testing.faults import build_task, checkpoint, finish, merged, run_dir, state_digest, wait_for_steps
from core_rl.testing.launch import cpu_ranks_env
from core_rl.testing.processes import ancestors

pytest.importorskip("ray")
pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "tiny_grpo"
#: a fault test's run ends within this (launcher.stop_grace_s plus the actors' clean-up)
FAULT_TIMEOUT_S = 90


def _ray_train(address: str, config: Path | str, *overrides: str) -> subprocess.Popen:
    """``core-rl train --nproc-per-node 2 --ray-address ADDRESS CONFIG OVERRIDES`` on CPU ranks."""
    cmd = [sys.executable, "-m", "core_rl.cli", "train", "--nproc-per-node", "2", "--ray-address", address]
    log = tempfile.NamedTemporaryFile(prefix="core-rl-ray-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [*cmd, str(config), *overrides],
        env=cpu_ranks_env({**os.environ, "OMP_NUM_THREADS": "1"}),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proc.log = Path(log.name)  # type: ignore[attr-defined]
    log.close()
    return proc


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    """Wait at most ``timeout`` s for a run started by :func:`_ray_train`; its output (the
    driver's and, forwarded by Ray, the actors'; its file is removed). A pipe would fill up and
    stall the driver."""
    finish(proc, timeout)
    output = proc.log.read_text(errors="replace")  # type: ignore[attr-defined]
    proc.log.unlink()  # type: ignore[attr-defined]
    return output


def _leftovers(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a run's own temporary path, which
    servers started for the run carry in their ``--model`` argument)."""
    found, mine = [], set(ancestors(os.getpid()))  # the test runner is never a leftover
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def _no_leftovers(marker: str, within: float = 60.0) -> list[str]:
    deadline = time.monotonic() + within
    while (left := _leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _kill_actor(suffix: str, run_name: str) -> str:
    """Kill the named actor of run ``run_name`` ending in ``suffix``; its name."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    (name,) = [n for n in names if n.startswith(f"{run_name}-") and n.endswith(suffix)]
    ray.kill(ray.get_actor(name, namespace="core-rl"), no_restart=True)
    return name


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ray_task")
    cfg = merged(build_task(root), launcher={"name": "ray", "stop_grace_s": 30, "poll_s": 0.2})
    return {"root": root, "cfg": cfg}


def _write(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_two_ray_ranks_match_two_torchrun_ranks(ray_cluster, tmp_path, capsys):
    """Through ``benchmarks/ray_overhead.py --smoke`` (its smoke test too): 3 steps of the tiny task
    with 2 ranks under each launcher."""
    bench = runpy.run_path(str(ROOT / "benchmarks" / "ray_overhead.py"), run_name="benchmark")
    figures = tmp_path / "figures.json"
    args = ["--smoke", "--ray-address", ray_cluster, "--work", str(tmp_path), "--json", str(figures)]
    assert bench["main"](args) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "same metrics: True" in out
    print(out)
    runs = {name: Path(r["run_dir"]) for name, r in json.loads(figures.read_text()).items()}
    local, ray_run = (read_metrics(runs[k] / "metrics.jsonl") for k in ("local", "ray"))
    assert [r["step"] for r in local] == [r["step"] for r in ray_run] == [1, 2, 3]
    for a, b in zip(local, ray_run):
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy"):
            assert (key in b) == (key in a), key  # a zero-signal step (every advantage 0) has no actor/entropy
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert state_digest(checkpoint(runs["ray"], 3)) == state_digest(checkpoint(runs["local"], 3))


def test_a_killed_trainer_actor_is_restarted_and_the_run_resumes(ray_cluster, task):
    steps = 8
    cfg = merged(
        task["cfg"],
        experiment={"name": "killrank"},
        trainer={"total_steps": steps},
        recover={"mode": "auto", "retries": 1},
    )
    config = _write(cfg, task["root"] / "killrank.yaml")
    run = run_dir(cfg)
    proc = _ray_train(ray_cluster, config)
    assert wait_for_steps(run, proc, 3, timeout=240), _finish(proc, 5)[-4000:]
    killed = _kill_actor("/rank-1", "killrank")
    started = time.monotonic()
    err = _finish(proc, FAULT_TIMEOUT_S + 120)
    assert proc.returncode == 0, err[-4000:]
    assert f"actor {killed} (pid" in err and "on node 127.0.0.1" in err and "died" in err, err[-4000:]
    assert "restarting every actor from the newest valid checkpoint" in err
    rows = read_metrics(run / "metrics.jsonl")
    assert sorted({r["step"] for r in rows}) == list(range(1, steps + 1))
    assert time.monotonic() - started < FAULT_TIMEOUT_S + 120
    assert _no_leftovers(str(task["root"])) == []


def test_a_rank_stuck_inside_a_step_is_diagnosed_and_the_driver_names_it(ray_cluster, task):
    """Rank 1's process is told to sleep inside its ``train_step`` of step 2 (the test hook, through
    ``launcher.env``); rank 0's waits for it in the update's all_reduce. The watchdogs of the two
    actors' processes share progress through rank 0's store: within the bound the run ends with
    status 1, the hang file holds both ranks, and the driver's own message quotes the diagnosis."""
    cfg = merged(
        task["cfg"],
        experiment={"name": "stuckrank"},
        trainer={"total_steps": 8, "collective_timeout_s": 600, "watchdog": {"timeout_s": 15}},
        launcher={"env": {STALL_VARIABLE: "1:2:train_step"}},
    )
    config = _write(cfg, task["root"] / "stuckrank.yaml")
    run = run_dir(cfg)
    proc = _ray_train(ray_cluster, config)
    assert wait_for_steps(run, proc, 1, timeout=240), _finish(proc, 5)[-4000:]
    started = time.monotonic()
    err = _finish(proc, FAULT_TIMEOUT_S)
    assert time.monotonic() - started < FAULT_TIMEOUT_S
    assert proc.returncode == 1, err[-4000:]
    (hang,) = run.glob("hang-*.txt")
    stuck = "no progress for 1"  # 15 s and a little more
    diagnosis = "rank 1 is stuck in update of step 2, in train engine 'fsdp'"
    (driver,) = [line for line in err.splitlines() if line.startswith("core-rl: error: trainer rank")]
    assert re.match(r"core-rl: error: trainer rank \d \(actor stuckrank-\w+/rank-\d \(pid \d+ on node", driver), driver
    assert f"exited with status 1: {stuck}" in driver and diagnosis in driver, driver
    assert driver.endswith(f"Every thread's stack on every rank: {hang}")
    text = hang.read_text()
    assert "== rank 0 " in text and "== rank 1 " in text and "blocked in a collective" in text
    assert _no_leftovers(str(task["root"])) == []


def test_validate_checks_the_placement_against_the_cluster(ray_cluster, task):
    """``core-rl config validate`` with ``launcher.address`` judges the placement by the cluster's
    nodes (2 of 2 CPUs), naming the role, the need and the offer."""
    cfg = merged(task["cfg"], launcher={"address": ray_cluster}, placement={"actor": {"cpus": 3}})
    config = _write(cfg, task["root"] / "toolarge.yaml")
    cmd = [sys.executable, "-m", "core_rl.cli", "config", "validate", str(config)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"placement.actor.cpus: 3 CPU cores per node, but a node has 2 (the Ray cluster at {ray_cluster})" in (
        proc.stderr
    ), proc.stderr[-3000:]
    fits = _write(merged(cfg, placement={"actor": {"cpus": 2, "nodes": 2}}), task["root"] / "fits.yaml")
    proc = subprocess.run([*cmd[:-1], str(fits)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


# -- the tiny GRPO example through a vLLM server ---------------------------------------------------

STEPS = 3  # the weights' exactness shows at every step; the rise needs ~16 (README)


def _grpo(warm: dict[str, Path], name: str, *overrides: str) -> list[str]:
    return [
        str(EXAMPLE / "grpo.yaml"),
        f"experiment.output_dir={warm['root']}",
        f"experiment.name={name}",
        f"actor.model_path={warm['model']}",
        f"data.train_files=[{warm['data']}]",
        "actor.optimizer.lr=3e-3",
        "data.batch_size=64",
        "saver.at_end=false",
        "saver.export_hf=false",
        "rollout.engine.name=vllm",
        "rollout.engine.dtype=float32",
        "launcher={name: ray, stop_grace_s: 30, poll_s: 0.2}",
        "eval.before_train=false",  # grpo.yaml's evaluation after the last step only
        *overrides,
    ]


@pytest.mark.server_env("vllm")
def test_grpo_with_a_vllm_server_actor_samples_with_the_trained_weights_split(ray_cluster, tiny_grpo_warm):
    pytest.importorskip("core_rl_vllm")
    warm = tiny_grpo_warm
    name = "vllm-split"
    args = _grpo(warm, name, "placement.mode=split", "rollout.weight_sync=collective", f"trainer.total_steps={STEPS}")
    proc = _ray_train(ray_cluster, *args)
    err = _finish(proc, 600)
    assert proc.returncode == 0, err[-5000:]
    assert "running 2 trainer ranks and 1 rollout servers on Ray" in err
    rows = read_metrics(warm["root"] / name / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["weight_sync/bytes"] > 0 for r in rows)
    # the weight sync check (on by default) compared every synced tensor with the server's at every step
    assert all(r["weight_sync/checked_tensors"] > 0 and r["timing/sync_check_s"] > 0 for r in rows), rows
    assert rows[-1]["eval/samples"] == 64  # grpo.yaml's evaluation, by rank 0's actor through the server
    # the server samples with the weights being trained at every step: the k3 KL of the update's
    # policy to the behaviour log-probs is float32 rounding (tests/test_server_grpo.py); a step's
    # missed or partial update would put it at 0.24-1.6
    kl = [r["actor/approx_kl"] for r in rows if not r["actor/zero_signal_update"]]  # those skip the forward pass
    assert kl and max(kl) < 1e-8, kl
    log = warm["root"] / name / "ray" / "server-0" / "servers" / "vllm-0.log"
    assert log.is_file() and log.stat().st_size > 0
    assert _no_leftovers(str(warm["model"])) == []


@pytest.mark.server_env("vllm")
def test_colocated_then_a_killed_server_actor_ends_the_run_naming_it_with_the_checkpoint_intact(
    ray_cluster, tiny_grpo_warm
):
    """``colocate`` (weights through the run directory) trains 4 steps with its server actor, which is
    then killed: the run ends naming the actor and its node, with the checkpoint it saved intact.
    (The same placement over 20 steps: reward 0.32 -> 0.51, README; CI's time allows these 4.)"""
    pytest.importorskip("core_rl_vllm")
    from core_rl.checkpoint.store import latest_checkpoint, step_of
    from safetensors.torch import load_file

    warm = tiny_grpo_warm
    name = "vllm-colocate"
    args = _grpo(
        warm,
        name,
        "placement.mode=colocate",
        "rollout.weight_sync=disk",
        "trainer.total_steps=40",
        "saver.every_n_steps=2",
    )
    proc = _ray_train(ray_cluster, *args)
    run = warm["root"] / name
    assert wait_for_steps(run, proc, 4, timeout=300), _finish(proc, 5)[-4000:]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows[:4]] == [1, 2, 3, 4]
    assert all(r["weight_sync/bytes"] > 0 for r in rows[:4])
    assert all(r["weight_sync/checked_tensors"] > 0 for r in rows[:4])  # the sync check, by disk under Ray
    killed = _kill_actor("/server-0", name)
    started = time.monotonic()
    err = _finish(proc, FAULT_TIMEOUT_S)
    assert time.monotonic() - started < FAULT_TIMEOUT_S
    assert proc.returncode == 1, err[-4000:]
    assert "running 2 trainer ranks and 1 rollout servers on Ray" in err
    assert f"actor {killed} (pid" in err and "on node 127.0.0.1" in err and "died" in err, err[-4000:]
    latest = latest_checkpoint(run)
    assert latest is not None and step_of(latest) >= 2
    assert load_file(latest / "model.safetensors")  # whole and readable
    log = run / "ray" / "server-0" / "servers" / "vllm-0.log"
    assert log.is_file() and log.stat().st_size > 0
    assert _no_leftovers(str(warm["model"])) == []


def test_a_lost_node_ends_the_run_naming_it_with_the_checkpoint_intact(ray_test_cluster, task):
    """One rank per node; the second node is removed after step 3 (it saved step 2)."""
    from core_rl.checkpoint.store import latest_checkpoint, step_of
    from safetensors.torch import load_file

    workers = list(ray_test_cluster.worker_nodes)
    if not workers:
        pytest.skip("the cluster's second node did not register as a worker node of this Cluster object")
    cfg = merged(
        task["cfg"],
        experiment={"name": "lostnode"},
        trainer={"total_steps": 40},
        saver={"every_n_steps": 2},
        placement={"actor": {"cpus": 1, "nodes": 2}},
        launcher={"actor_timeout_s": 20},
    )
    config = _write(cfg, task["root"] / "lostnode.yaml")
    run = run_dir(cfg)
    proc = _ray_train(ray_test_cluster.address, config)
    assert wait_for_steps(run, proc, 3, timeout=240), _finish(proc, 5)[-4000:]
    ray_test_cluster.remove_node(workers[0], allow_graceful=False)
    started = time.monotonic()
    err = _finish(proc, FAULT_TIMEOUT_S)
    assert time.monotonic() - started < FAULT_TIMEOUT_S
    assert proc.returncode == 1, err[-4000:]
    assert "actor lostnode-" in err and "on node 127.0.0.1" in err, err[-4000:]
    # Ray declares the node dead after its health checks fail (a few seconds); until then the
    # actor is only "temporarily unavailable", and the launcher keeps asking
    assert "its node was lost" in err or "its node is probably lost" in err, err[-4000:]
    print(
        f"lost node: exit 1 after {time.monotonic() - started:.1f} s: "
        + next(line for line in err.splitlines() if "error:" in line and "lostnode-" in line)
    )
    latest = latest_checkpoint(run)
    assert latest is not None and step_of(latest) >= 2
    assert load_file(latest / "model.safetensors")
    assert _no_leftovers(str(task["root"])) == []
