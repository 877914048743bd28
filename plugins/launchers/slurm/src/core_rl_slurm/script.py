"""The sbatch script of a run (:func:`render`): one ``srun`` task per trainer node, each running
``core-rl train`` with the ``local`` launcher over ``--nnodes`` nodes (torch's elastic agent, one
rank per GPU or ``ranks_per_node`` CPU ranks), meeting at the first node of the allocation
(``scontrol show hostnames``). Everything it does is in the script, to read and edit before
``sbatch``.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from core_rl_slurm.config import SlurmLauncherConfig

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig


def ranks_per_node(cfg: RunConfig, config: SlurmLauncherConfig) -> int:
    """Trainer ranks per node: one per GPU of ``placement.actor.gpus``, else ``ranks_per_node``."""
    return cfg.placement.actor.gpus or config.ranks_per_node


def _sbatch_options(cfg: RunConfig, config: SlurmLauncherConfig, workdir: Path) -> list[str]:
    options = {
        "job-name": config.job_name or cfg.experiment.name,
        "nodes": str(config.nodes),
        "ntasks-per-node": "1",
        "gpus-per-node": str(config.gpus_per_node) if config.gpus_per_node else "",
        "cpus-per-task": str(config.cpus_per_node) if config.cpus_per_node else "",
        "partition": config.partition,
        "account": config.account,
        "time": config.time,
        "qos": config.qos,
        "output": config.output,
        "chdir": str(workdir),
    }
    lines = [f"#SBATCH --{key}={value}" for key, value in options.items() if value]
    return lines + [f"#SBATCH {line}" for line in config.sbatch_lines]


def _task_prefix(config: SlurmLauncherConfig) -> tuple[list[str], list[str]]:
    """``(srun arguments, command prefix)`` that run a task in the configured container."""
    container = config.container
    if not container.image:
        return [], []
    if container.runtime == "pyxis":
        args = [f"--container-image={container.image}"]
        if container.mounts:
            args.append(f"--container-mounts={','.join(container.mounts)}")
        if container.workdir:
            args.append(f"--container-workdir={container.workdir}")
        return args, []
    prefix = ["apptainer", "exec"] + (["--nv"] if config.gpus_per_node else [])
    for mount in container.mounts:
        prefix += ["--bind", mount]
    if container.workdir:
        prefix += ["--pwd", container.workdir]
    return [], [*prefix, container.image]


def _continued(words: Sequence[str], indent: str = "    ") -> str:
    """Shell words, one argument group per line, joined with `` \\`` continuations."""
    return f" \\\n{indent}".join(words)


def render(
    cfg: RunConfig,
    config: SlurmLauncherConfig,
    config_path: str,
    overrides: Sequence[str],
    *,
    workdir: Path | None = None,
) -> str:
    """The sbatch script that runs ``core-rl train config_path overrides...`` as ``cfg`` and the
    ``launcher`` section ``config`` say (see the module docstring)."""
    workdir = (workdir or Path.cwd()).resolve()
    nodes = cfg.placement.actor.nodes
    srun_args, prefix = _task_prefix(config)
    python = config.python or ("python" if config.container.image else sys.executable)
    source = " ".join(shlex.quote(w) for w in ("core-rl", "slurm", "render", config_path, *overrides))
    lines = [
        "#!/bin/bash",
        f"# Rendered by: {source}",
        "# Edit freely, then submit with: sbatch THIS_FILE",
        *_sbatch_options(cfg, config, workdir),
        "set -euo pipefail",
        "",
        *config.setup,
    ]
    env = dict(config.env)
    if config.interface:
        env.setdefault("GLOO_SOCKET_IFNAME", config.interface)
        env.setdefault("NCCL_SOCKET_IFNAME", config.interface)
    lines += [f"export {key}={shlex.quote(value)}" for key, value in env.items()]
    lines += [
        "",
        "# The trainer's nodes meet at the first node of the allocation, where node 0's agent listens.",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"RDZV_PORT={config.rdzv_port}",
        "",
        f"# One task per trainer node: `core-rl train` with the local launcher over {nodes} node(s), "
        f"{ranks_per_node(cfg, config)} rank(s) each;",
        "# each task adds its node rank ($SLURM_NODEID) to the command.",
    ]
    srun = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", *srun_args]
    srun += [shlex.quote(arg) for arg in config.srun_args]
    task = " ".join(shlex.quote(w) for w in (*prefix, "bash", "-c", 'exec "$@" --node-rank "$SLURM_NODEID"', "node"))
    command = [
        " ".join(shlex.quote(w) for w in (python, "-m", "core_rl.cli", "train")),
        f"--nnodes {nodes}",
        '--rdzv-endpoint "$HEAD_NODE:$RDZV_PORT"',
        f"--nproc-per-node {ranks_per_node(cfg, config)}",
        shlex.quote(str(Path(config_path).resolve())),
        *(shlex.quote(o) for o in overrides),
        "launcher=local",
    ]
    lines.append(_continued([" ".join(srun), task, *command]))
    return "\n".join(lines) + "\n"
