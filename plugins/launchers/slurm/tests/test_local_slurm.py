"""``core-rl slurm submit`` against a real one-node Slurm on this machine (:mod:`local_slurm`:
Debian's ``slurmctld``/``slurmd``/``munge``, node ``localhost``): the job the launcher renders and
submits trains the tiny example, 2 CPU ranks on the node, 2 steps; then ``core-rl train`` with
``launcher: slurm`` submits a second run the same way. Skipped, with the reason, where the packages
are not installed (``scripts/test.sh`` installs them where it runs as root with apt)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.testing.faults import build_task, merged
from core_rl.testing.launch import cpu_ranks_env, free_port
from local_slurm import local_slurm, missing, wait_for_job

# scripts/test.sh may be installing Slurm's packages in the background
pytestmark = pytest.mark.after_setup("slurm-packages")

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

#: a job's own time on a loaded 2-core machine: two `core-rl train` start-ups and 2 steps
JOB_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    why = missing()
    if why:
        pytest.skip(why)
    with local_slurm(tmp_path_factory.mktemp("slurm_cluster")) as env:
        yield env


def _submit(command: str, config: Path, env: dict[str, str]) -> str:
    """``core-rl COMMAND CONFIG`` (``slurm submit`` or ``train``) from the config's directory; the job id."""
    argv = [sys.executable, "-m", "core_rl.cli", *command.split(), str(config)]
    proc = subprocess.run(argv, cwd=config.parent, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = re.search(r"submitted job (\d+)", proc.stdout)
    assert found, proc.stdout
    return found.group(1)


@pytest.mark.parametrize("command", ["slurm submit", "train"])
def test_a_submitted_job_trains_the_tiny_example(slurm: dict[str, str], tmp_path: Path, command: str) -> None:
    name = f"slurm_{command.split()[-1]}"
    config = merged(
        build_task(tmp_path),
        experiment={"name": name},
        trainer={"total_steps": 2},
        saver={"every_n_steps": 0},
        launcher={
            "name": "slurm",
            "nodes": 1,
            "ranks_per_node": 2,
            "partition": "cpu",
            "time": "00:10:00",
            "rdzv_port": free_port(),
            "env": {"OMP_NUM_THREADS": "1"},
        },
        placement={"actor": {"nodes": 1}},
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = cpu_ranks_env({**os.environ, **slurm})
    job = _submit(command, path, env)
    state = wait_for_job(job, slurm, JOB_TIMEOUT_S)
    log = tmp_path / f"slurm-{name}-{job}.out"
    output = log.read_text(errors="replace") if log.exists() else "(no job output file)"
    assert state == "COMPLETED", output[-4000:]
    rows = read_metrics(tmp_path / "runs" / name / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    assert "--nproc-per-node 2" in (tmp_path / f"{name}.sbatch").read_text()  # the script Slurm ran
