"""The start-up warning of torch threads that need more cores than are free
(core_rl.loops.cpu_threads): the decision on given machines, the cgroup quota read from real
files laid out as the kernel does, and the line a real run prints when its CPU affinity leaves one
core for two threads."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from core_rl.loops import building
from core_rl.loops.cpu_threads import CpuBudget, cgroup_cpu_limit, thread_warning
from core_rl.testing.launch import train_command, write_grpo_config
from core_rl.testing.tiny import build_tiny_model


def test_threads_that_fit_the_free_cores_pass():
    idle = CpuBudget(cores=8, machine_cores=8, load=0.3)
    assert thread_warning(8, 8, 1, idle) is None
    assert thread_warning(4, 4, 2, idle) is None  # 4 threads x 2 ranks
    # a fraction of a core either way is noise: 2 threads on 2 cores with a little load pass
    assert thread_warning(2, 2, 1, CpuBudget(cores=2, machine_cores=2, load=0.4)) is None


def test_one_thread_per_process_is_never_warned_of():
    swamped = CpuBudget(cores=2, machine_cores=2, load=12.0)
    assert thread_warning(1, 1, 1, swamped) is None
    assert thread_warning(1, 0, 4, swamped) is None  # torch's default resolved to 1 (OMP_NUM_THREADS=1)


def test_two_threads_on_a_busy_two_core_machine_are_warned_of():
    line = thread_warning(2, 2, 1, CpuBudget(cores=2, machine_cores=2, load=2.6))
    assert line == (
        "core-rl: warning: trainer.torch_threads: 2 on about 0.0 free of 2 cores (load average 2.60 on 2 "
        "cores): threads waiting for a core slow generation and training several times; set "
        "trainer.torch_threads: 1"
    )
    assert "\n" not in line


def test_torchs_default_and_local_ranks_count():
    budget = CpuBudget(cores=16, machine_cores=16, load=8.0)  # half the machine busy: 8 free
    line = thread_warning(16, 0, 1, budget)
    assert line is not None and "trainer.torch_threads: 0 (torch's default: 16 threads) on about 8.0 free" in line
    assert line.endswith("set trainer.torch_threads: 8")
    line = thread_warning(4, 4, 4, budget)  # 4 ranks x 4 threads = 16 on 8 free
    assert line is not None and "trainer.torch_threads: 4 x 4 processes = 16 threads" in line
    assert line.endswith("set trainer.torch_threads: 2")
    assert thread_warning(2, 2, 4, budget) is None


def test_a_quota_is_its_share_of_the_machines_load():
    # a 2-core quota on a 64-core machine with 32 busy: about 1 of the 2 cores free
    budget = CpuBudget(cores=2, machine_cores=64, load=32.0)
    line = thread_warning(2, 2, 1, budget)
    assert line is not None and "about 1.0 free of 2 cores" in line and line.endswith("torch_threads: 1")
    assert thread_warning(2, 2, 1, CpuBudget(cores=2, machine_cores=64, load=8.0)) is None  # 1.75 free
    no_load = CpuBudget(cores=2.5, machine_cores=4, load=None)  # the quota alone
    assert thread_warning(3, 3, 1, no_load) is None
    assert "about 2.5 free of 2.5 cores: " in (thread_warning(4, 4, 1, no_load) or "")


def test_cgroup_v2_quota_is_the_tightest_over_the_ancestors(tmp_path):
    root = tmp_path / "cgroup"
    (root / "a" / "b").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "a" / "cpu.max").write_text("150000 100000\n")
    (root / "a" / "b" / "cpu.max").write_text("400000 100000\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/a/b\n")
    assert cgroup_cpu_limit(proc, root) == 1.5
    proc.write_text("0::/\n")  # a container's own namespace: the root's file
    assert cgroup_cpu_limit(proc, root) is None


def test_cgroup_v1_quota_and_hybrid_layouts(tmp_path):
    root = tmp_path / "cgroup"
    cpu = root / "cpu,cpuacct" / "docker" / "x"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text("250000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    (root / "unified").mkdir()  # v2 mounted beside, without the cpu controller
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/docker/x\n2:cpu,cpuacct:/docker/x\n0::/\n")
    assert cgroup_cpu_limit(proc, root) == 2.5
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(proc, root) is None
    assert cgroup_cpu_limit(tmp_path / "missing", root) is None


def test_only_a_nodes_first_process_prints_it(monkeypatch, capsys):
    monkeypatch.setattr("core_rl.loops.cpu_threads.cpu_budget", lambda: CpuBudget(cores=1, machine_cores=1, load=0.0))
    monkeypatch.setattr("torch.get_num_threads", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    building.warn_of_busy_cores(4)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    building.warn_of_busy_cores(4)
    assert capsys.readouterr().err.startswith("core-rl: warning: trainer.torch_threads: 4 on about 1.0 free of 1 core")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_a_run_on_one_core_with_two_threads_says_so(tmp_path):
    model = build_tiny_model(tmp_path / "model", alphabet="abcd=", seed=0)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s}) + "\n" for s in ("ab", "ba")))
    config = write_grpo_config(tmp_path, model, [str(data)], trainer={"total_steps": 1, "torch_threads": 2})
    one_core = {min(os.sched_getaffinity(0))}
    proc = subprocess.run(
        train_command(config, "saver.export_hf=false"),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: os.sched_setaffinity(0, one_core),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if line.startswith("core-rl: warning: trainer.torch_threads")]
    assert len(warned) == 1, proc.stderr[-3000:]
    assert warned[0].startswith("core-rl: warning: trainer.torch_threads: 2 on about ")
    assert " free of 1 core " in warned[0] and warned[0].endswith("set trainer.torch_threads: 1")
