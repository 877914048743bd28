"""The ``launcher:`` section of the ``slurm`` launcher."""

from __future__ import annotations

import re

import attrs
from core_rl.config.validators import MAX_COUNT, FieldValueError, each, in_range, not_empty, one_of

#: how the job's tasks run in a container: none, pyxis (``srun --container-image``), apptainer
CONTAINER_RUNTIMES = ("pyxis", "apptainer")


def _slurm_time(_inst: object, attribute: attrs.Attribute, value: str) -> None:
    """Slurm's time formats: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``."""
    if value and not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", value):
        raise FieldValueError(attribute.name, value, "must be a Slurm time such as 04:00:00 or 2-00:00:00")


def _no_newline(_inst: object, attribute: attrs.Attribute, value: list[str]) -> None:
    for i, line in enumerate(value):
        if "\n" in line:
            raise FieldValueError(f"{attribute.name}[{i}]", line, "must be one line")


@attrs.define
class ContainerConfig:
    """``image``: the container image every task runs in (empty: none); ``runtime``: ``pyxis``
    (``srun --container-image=IMAGE --container-mounts=...``) or ``apptainer`` (``apptainer exec
    --bind ... IMAGE``); ``mounts``: ``SRC:DST[:FLAGS]`` entries; ``workdir``: the directory tasks
    start in inside the container (empty: the job's directory)."""

    image: str = ""
    runtime: str = attrs.field(default="pyxis", validator=one_of(CONTAINER_RUNTIMES))
    mounts: list[str] = attrs.field(factory=list, validator=each(not_empty()))
    workdir: str = ""


@attrs.define
class SlurmLauncherConfig:
    """The allocation and how the job starts.

    - ``nodes``, ``gpus_per_node``, ``cpus_per_node`` (0: Slurm's default, not checked): what the job
      asks for, and what ``placement:`` is checked against;
    - ``ranks_per_node``: trainer ranks per node when ``placement.actor.gpus`` is 0 (CPU ranks);
      with GPUs, one rank per GPU of ``placement.actor.gpus``;
    - ``partition``, ``account``, ``time``, ``qos``, ``job_name`` (empty: ``experiment.name``),
      ``output`` (the job's log; Slurm's ``%x`` is the job name, ``%j`` its id);
    - ``sbatch_lines``: more ``#SBATCH`` options, e.g. ``--mail-type=END``; ``srun_args``: more
      ``srun`` arguments, e.g. ``--mpi=none``;
    - ``setup``: shell lines run on the first node before ``srun`` (``module load``, ``source
      venv/bin/activate``); ``env``: variables exported for every task;
    - ``python``: the interpreter tasks run (empty: this one, or ``python`` in a container);
    - ``container``: :class:`ContainerConfig`;
    - ``rdzv_port``: the port on the first node where the trainer's nodes meet; ``interface``: the
      network interface gloo and NCCL use between nodes (``GLOO_SOCKET_IFNAME`` and
      ``NCCL_SOCKET_IFNAME``; empty: their own choice).
    """

    nodes: int = attrs.field(default=1, validator=in_range(1, MAX_COUNT))
    gpus_per_node: int = attrs.field(default=0, validator=in_range(0, 1024))
    cpus_per_node: int = attrs.field(default=0, validator=in_range(0, MAX_COUNT))
    ranks_per_node: int = attrs.field(default=1, validator=in_range(1, 1024))
    partition: str = ""
    account: str = ""
    time: str = attrs.field(default="", validator=_slurm_time)
    qos: str = ""
    job_name: str = ""
    output: str = "slurm-%x-%j.out"
    sbatch_lines: list[str] = attrs.field(factory=list, validator=_no_newline)
    srun_args: list[str] = attrs.field(factory=list)
    setup: list[str] = attrs.field(factory=list, validator=_no_newline)
    env: dict[str, str] = attrs.field(factory=dict)
    python: str = ""
    container: ContainerConfig = attrs.field(factory=ContainerConfig)
    rdzv_port: int = attrs.field(default=29500, validator=in_range(1, 65535))
    interface: str = ""
