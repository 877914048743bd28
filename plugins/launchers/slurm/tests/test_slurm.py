"""The ``slurm`` launcher: the rendered sbatch script (syntax, ``#SBATCH`` lines, the ``srun``
line, containers), the placement check against the allocation, ``core-rl slurm submit`` against a
fake ``sbatch`` (no Slurm cluster here), and the rendered script run for real with ``bash``, with
``srun`` and ``scontrol`` shims that start its tasks on this machine as Slurm would (2 "nodes" x
1 CPU rank), training the tiny example for 2 steps."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import attrs
import core_rl_slurm.plugin
import pytest
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.cli import main
from core_rl.testing import LauncherContract
from core_rl.testing.faults import build_task, merged
from core_rl.testing.launch import cpu_ranks_env, free_port

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

SLURM = {"name": "slurm", "nodes": 2, "ranks_per_node": 1, "partition": "cpu", "account": "proj", "time": "00:30:00"}

# srun: one task per node (--nodes=N), each with the variables Slurm gives a task; its own
# arguments are the leading --options; exits with the first failing task's status
SRUN = """#!/bin/bash
nodes=1
while [[ "$1" == --* ]]; do
  case "$1" in --nodes=*) nodes="${1#--nodes=}";; esac
  echo "srun option: $1" >> "$SHIM_LOG"
  shift
done
pids=()
for ((i = 0; i < nodes; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_NNODES=$nodes SLURM_LOCALID=0 "$@" > "$SHIM_DIR/task$i.out" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] || exit 1
tr ',' '\\n' <<< "$3"
"""
SBATCH = """#!/bin/bash
echo "$@" > "$SHIM_DIR/sbatch.args"
echo "4242;cluster"
"""


def _shims(root: Path, **scripts: str) -> Path:
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir


@attrs.frozen
class Result:
    returncode: int
    stdout: str
    stderr: str


def _cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> Result:
    """``core-rl ARGS`` in this process (``main``), in ``cwd`` with ``env`` as its environment."""
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), Path.cwd()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.chdir(cwd or saved_cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("slurm")
    config = merged(
        build_task(root),
        trainer={"total_steps": 2},
        saver={"every_n_steps": 0},
        launcher={**SLURM, "rdzv_port": free_port()},
        placement={"actor": {"nodes": 2}},
    )
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _render(config: Path, *args: str, cwd: Path | None = None) -> str:
    proc = _cli("slurm", "render", str(config), *args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _sbatch_lines(script: str) -> dict[str, str]:
    return dict(line.removeprefix("#SBATCH --").split("=", 1) for line in script.splitlines() if "#SBATCH --" in line)


def _srun_words(script: str) -> list[str]:
    start = script.index("\nsrun ")
    return shlex.split(script[start:].replace("\\\n", " "))


def test_render_writes_a_valid_script_with_the_allocation_and_the_srun_line(task: Path, tmp_path: Path) -> None:
    script = _render(task, "trainer.total_steps=5", cwd=tmp_path)
    (tmp_path / "job.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0
    assert _sbatch_lines(script) == {
        "job-name": "run",
        "nodes": "2",
        "ntasks-per-node": "1",
        "partition": "cpu",
        "account": "proj",
        "time": "00:30:00",
        "output": "slurm-%x-%j.out",
        "chdir": str(tmp_path.resolve()),
    }
    words = _srun_words(script)
    assert words[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    command = words[words.index("node") + 1 :]
    assert command == [
        sys.executable,
        *("-m", "core_rl.cli", "train", "--nnodes", "2", "--rdzv-endpoint", "$HEAD_NODE:$RDZV_PORT"),
        *("--nproc-per-node", "1", str(task.resolve()), "trainer.total_steps=5", "launcher=local"),
    ]
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script


def test_render_containers_extra_lines_and_output_file(task: Path, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "job.sbatch"
    proc = _cli(
        "slurm",
        "render",
        str(task),
        "launcher.container={image: img.sqsh, mounts: ['/a:/b', '/c:/d']}",
        "launcher.sbatch_lines=['--exclusive', '--mail-type=END']",
        "launcher.srun_args=['--mpi=none']",
        "launcher.env={A: 'x y'}",
        "--output",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    script = out.read_text()
    assert os.access(out, os.X_OK) and f"sbatch {out}" in proc.stderr
    assert "#SBATCH --exclusive\n#SBATCH --mail-type=END\n" in script and "export A='x y'\n" in script
    words = _srun_words(script)
    assert words[4:7] == ["--container-image=img.sqsh", "--container-mounts=/a:/b,/c:/d", "--mpi=none"]
    assert words[words.index("node") + 1] == "python"  # the image's interpreter
    apptainer = _render(task, "launcher.container={image: img.sif, runtime: apptainer, mounts: ['/a:/b']}")
    words = _srun_words(apptainer)
    assert words[4:11] == ["apptainer", "exec", "--bind", "/a:/b", "img.sif", "bash", "-c"]


def test_an_allocation_too_small_is_refused_before_rendering(task: Path) -> None:
    proc = _cli("slurm", "render", str(task), "placement.actor.nodes=3", "placement.actor.gpus=1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "placement.actor.nodes: 3 nodes, but the launcher offers 2 (launcher.nodes," in proc.stderr
    assert "placement.actor.gpus: 1 GPUs per node, but a node has 0 (launcher.nodes" in proc.stderr
    proc = _cli("slurm", "render", str(task), "launcher=local")
    assert proc.returncode == 2 and "`core-rl slurm` needs launcher: {name: slurm, ...}" in proc.stderr


def test_submit_runs_sbatch_and_prints_the_job_id(task: Path, tmp_path: Path) -> None:
    """Against a fake ``sbatch`` (records its arguments, answers as ``--parsable`` does)."""
    bin_dir = _shims(tmp_path, sbatch=SBATCH)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SHIM_DIR": str(tmp_path)}
    proc = _cli("slurm", "submit", str(task), env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "submitted job 4242 (script: run.sbatch; log: slurm-%x-4242.out)" in proc.stdout
    assert (tmp_path / "sbatch.args").read_text().split() == ["--parsable", "run.sbatch"]
    assert _sbatch_lines((tmp_path / "run.sbatch").read_text())["nodes"] == "2"
    # `core-rl train` with launcher: slurm submits the same way
    proc = _cli("train", str(task), env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "submitted job 4242" in proc.stdout, proc.stderr
    # sbatch failing, or absent, is a message and status 2
    _shims(tmp_path, sbatch="#!/bin/bash\necho 'sbatch: error: invalid partition' >&2\nexit 1\n")
    proc = _cli("slurm", "submit", str(task), env=env, cwd=tmp_path)
    assert proc.returncode == 2 and "failed with status 1: sbatch: error: invalid partition" in proc.stderr
    proc = _cli("slurm", "submit", str(task), env={**env, "PATH": os.path.dirname(sys.executable)}, cwd=tmp_path)
    assert proc.returncode == 2 and "sbatch is not on PATH" in proc.stderr


def test_the_rendered_script_trains_on_two_nodes(task: Path, tmp_path: Path) -> None:
    """The script's body under ``bash``: ``srun`` starts 2 tasks (nodes 0 and 1) on this machine,
    which meet at the "first node" ``scontrol`` names and train 2 steps over 2 CPU ranks."""
    script = tmp_path / "job.sbatch"
    assert _cli("slurm", "render", str(task), "experiment.name=slurm_run", "-o", str(script)).returncode == 0
    bin_dir = _shims(tmp_path, srun=SRUN, scontrol=SCONTROL)
    env = cpu_ranks_env(
        {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "SHIM_DIR": str(tmp_path),
            "SHIM_LOG": str(tmp_path / "srun.log"),
            "SLURM_JOB_NODELIST": "localhost,localhost",
            "OMP_NUM_THREADS": "1",
        }
    )
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=400)
    outputs = {i: (tmp_path / f"task{i}.out").read_text() for i in (0, 1)}
    assert proc.returncode == 0, f"{proc.stderr[-2000:]}\n{outputs[0][-3000:]}\n{outputs[1][-3000:]}"
    rows = read_metrics(task.parent / "runs" / "slurm_run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    assert "srun option: --nodes=2" in (tmp_path / "srun.log").read_text()


def test_the_example_config_validates_and_renders(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "grpo.yaml"
    proc = _cli("config", "validate", str(example))
    assert proc.returncode == 0, proc.stderr
    script = _render(example, cwd=tmp_path)
    assert _sbatch_lines(script)["nodes"] == "2" and "--nnodes" in _srun_words(script)


class TestSlurmContract(LauncherContract):
    plugin = core_rl_slurm.plugin
    name = "slurm"
    distribution = "core-rl-slurm"
    options: ClassVar[dict] = {"nodes": 2, "gpus_per_node": 4}
