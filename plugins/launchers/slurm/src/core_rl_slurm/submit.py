"""``core-rl slurm render`` and ``core-rl slurm submit`` (and the launcher's ``launch``): the
script written where ``--output`` says, then handed to ``sbatch``."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from core_rl.errors import ConfigError, CoreRLError, stderr_line

from core_rl_slurm.config import SlurmLauncherConfig
from core_rl_slurm.script import render

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig

SBATCH_TIMEOUT_S = 120


def slurm_section(cfg: RunConfig) -> SlurmLauncherConfig:
    """The ``launcher`` section of ``cfg``, which must select ``slurm``."""
    if cfg.launcher.name != "slurm":
        raise ConfigError(
            [f"launcher.name: {cfg.launcher.name!r}; `core-rl slurm` needs launcher: {{name: slurm, ...}}"]
        )
    return cfg.launcher.config


def load(config_path: str, overrides: Sequence[str]) -> RunConfig:
    """The validated configuration, its placement checked against the allocation it asks for."""
    from core_rl.config import load_config
    from core_rl.launch import launcher_check
    from core_rl.plugins import PluginHost

    cfg = load_config(config_path, overrides, host=PluginHost())
    slurm_section(cfg)
    problems = launcher_check(cfg)
    if problems:
        raise ConfigError(problems, source=config_path)
    return cfg


def write_script(cfg: RunConfig, config_path: str, overrides: Sequence[str], output: str | None) -> Path | None:
    """Render the script into ``output`` (executable), or print it when ``output`` is ``None``."""
    text = render(cfg, slurm_section(cfg), config_path, overrides)
    if output is None:
        sys.stdout.write(text)
        return None
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)
    return path


def sbatch(script: Path) -> str:
    """Submit ``script`` with ``sbatch --parsable`` and return the job id."""
    exe = shutil.which("sbatch")
    if exe is None:
        raise CoreRLError(
            "sbatch is not on PATH: run `core-rl slurm submit` on a Slurm login node, or render the script with "
            f"`core-rl slurm render ... --output FILE` and submit it there ({script} is written)"
        )
    try:
        proc = subprocess.run(
            [exe, "--parsable", str(script)], capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise CoreRLError(f"sbatch {script}: no answer from Slurm within {SBATCH_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        raise CoreRLError(f"sbatch {script} failed with status {proc.returncode}: {proc.stderr.strip()}")
    job = proc.stdout.strip().split(";")[0]  # --parsable: "JOBID" or "JOBID;CLUSTER"
    if not job.isdigit():
        raise CoreRLError(f"sbatch {script}: expected a job id, got {proc.stdout.strip()!r}")
    return job


def default_script_path(cfg: RunConfig) -> Path:
    return Path(f"{cfg.experiment.name}.sbatch")


def submit(cfg: RunConfig, config_path: str, overrides: Sequence[str], output: str | None) -> int:
    script = write_script(cfg, config_path, overrides, output or str(default_script_path(cfg)))
    assert script is not None
    job = sbatch(script)
    print(f"submitted job {job} (script: {script}; log: {slurm_section(cfg).output.replace('%j', job)})")
    return 0


def run_command(args: argparse.Namespace) -> int:
    """``core-rl slurm render|submit CONFIG [KEY=VALUE...] [--output FILE]``."""
    cfg = load(args.config, args.overrides)
    if args.slurm_command == "render":
        path = write_script(cfg, args.config, args.overrides, args.output)
        if path is not None:
            stderr_line(f"wrote {path}; submit with: sbatch {path}")
        return 0
    return submit(cfg, args.config, args.overrides, args.output)


def add_command(subparsers: argparse._SubParsersAction) -> None:
    slurm = subparsers.add_parser(
        "slurm",
        help="render or submit a run's sbatch script",
        description="Write the sbatch script of a run whose config selects launcher: {name: slurm} (torchrun "
        "over the allocation's nodes, one srun task per node), or write it and submit it with sbatch.",
    )
    actions = slurm.add_subparsers(dest="slurm_command", required=True, metavar="ACTION")
    for name, text in (("render", "print or write the script"), ("submit", "write the script and run sbatch")):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument("config", help="path of the run's YAML file")
        action.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides, as for core-rl train")
        where = "stdout" if name == "render" else "./<experiment.name>.sbatch"
        action.add_argument("--output", "-o", default=None, metavar="FILE", help=f"the script's path (default {where})")
    slurm.set_defaults(run=run_command)
