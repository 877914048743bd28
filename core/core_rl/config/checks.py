"""Checks a plugin's config class can add to its own field validation, for core and third-party
plugins alike.

The core looks for these optional methods on the validated config instance of every selected
section (``actor.engine``, ``rollout.engine``, ``algorithm.advantage``, ``algorithm.loss``,
``algorithm.filters[i]``, ``reward``, ``loggers[i]``); the protocols below describe them:

- ``check_config(context: SectionContext) -> Iterable[str]``: problems involving other sections
  of the run, e.g. a group-relative advantage estimator needs ``rollout.sampling.n >= 2``. Called
  by every configuration load (``core-rl config validate`` included), once every section is valid.
- ``check_environment(context: EnvironmentContext) -> Iterable[str]``: problems with the machine
  the run is about to use (devices, process-group backends, optional packages), found by
  ``core-rl train`` before any model is loaded (:mod:`core_rl.loops.preflight`).
- ``required_columns() -> Sequence[str]`` (rewards): the data-row columns the reward reads. Before
  the run starts every row of ``data.train_files`` must hold each of them (and not null), or the
  run stops with the file and line of every row that does not.
- ``check_data(rows: Sequence[DataRow], context: SectionContext) -> Iterable[str]`` (e.g. a
  training loop reading columns of its own): problems with the rows of ``data.train_files``
  (:class:`~core_rl.data.files.DataRow`, each with its file and line), found by
  ``core-rl train`` (and ``core-rl config validate --preflight``) before any model is loaded, with
  the other data problems. Its lines name the file and line (``row.where``) and the config key
  that selects the column; they are shown as they are, without a key path prepended.

Each problem is one line that starts with the key path it is about (``context.key("device")`` is
``"rollout.engine.device"``; a check may name a key of another section, such as ``actor.dtype``),
then says what is wrong and what to do. A line that does not start with a key path gets the
section's path prepended. Checks must not raise for a bad configuration: they
return the problem; an exception is a bug and is shown with its traceback.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig
    from core_rl.data.files import DataRow


@attrs.frozen
class SectionContext:
    """Where a plugin section sits (``path``, e.g. ``"algorithm.advantage"``), the whole validated
    run configuration it belongs to, and the plugin name the section selects."""

    path: str
    run: RunConfig
    name: str = ""

    def key(self, *names: str) -> str:
        """The key path of an option of this section: ``key("eps")`` -> ``"algorithm.advantage.eps"``."""
        return ".".join((self.path, *names))

    def role_section(self) -> tuple[str, Any]:
        """For an engine section (``<role>.engine``): the role's name and its section (``actor``,
        ``critic``, ...; ``None`` where the run has none, or the path is no role's engine)."""
        role = self.path.removesuffix(".engine")
        return role, getattr(self.run, role, None)


#: device nodes a Linux machine has when it has a GPU torch could use (NVIDIA, AMD ROCm, WSL2)
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def visible_gpus() -> int:
    """The CUDA (or ROCm) devices torch sees (:attr:`MachineInfo.cuda_device_count`). 0 without
    importing torch (seconds of a CLI command such as ``config validate``) on a Linux machine that has
    none of :data:`GPU_DEVICE_NODES`."""
    if sys.platform == "linux" and not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@attrs.frozen
class MachineInfo:
    """What the machine offers, as the run's process sees it.

    ``cuda_device_count``: CUDA devices visible (0 without a usable GPU); ``mps_available``: Apple
    MPS; ``local_world_size``: processes started on this node (``LOCAL_WORLD_SIZE`` under
    ``torchrun``, else 1); ``world_size``: processes of the whole run, every node's (``WORLD_SIZE``).
    """

    cuda_device_count: int = 0
    mps_available: bool = False
    local_world_size: int = 1
    world_size: int = 1

    @property
    def processes(self) -> int:
        """The run's processes: ``world_size``, and at least this node's."""
        return max(self.world_size, self.local_world_size)

    @property
    def cuda_available(self) -> bool:
        return self.cuda_device_count > 0

    def runs_on_cpu(self, device: str = "auto") -> bool:
        """Whether a train engine with ``device`` (``auto``, ``cpu`` or ``cuda``) computes on the CPU
        here: ``cpu``, or ``auto`` without a CUDA GPU (the rule of
        :func:`core_rl.launch.distributed.pick_device`)."""
        return device == "cpu" or (device == "auto" and not self.cuda_available)

    def gpu_per_process_problems(self, path: str, device: str = "auto") -> list[str]:
        """A train engine section at ``path`` on ``device`` (``auto``, ``cpu`` or ``cuda``, as
        :func:`core_rl.launch.distributed.pick_device` takes it): a process per GPU when it
        runs on GPUs, and a GPU at all for ``cuda``."""
        if device == "cuda" and not self.cuda_available:
            return [f"{path}.device: cuda, but this machine has no CUDA GPU; use auto or cpu"]
        if not self.runs_on_cpu(device) and self.local_world_size > self.cuda_device_count:
            return [
                f"{path}: {self.local_world_size} processes on this node but only {self.cuda_device_count} CUDA "
                "devices; start at most one process per GPU (torchrun --nproc_per_node), or set device: cpu"
            ]
        return []


@attrs.frozen
class ModelInfo:
    """What the model directory's ``config.json`` says (read without loading weights).

    ``path``: the local directory; ``vocab_size`` / ``max_position_embeddings`` / ``model_type``:
    from the config (``None`` when it does not say); ``rope_factor``: the ``factor`` of the config's
    RoPE scaling (1 without one).
    """

    path: str
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    model_type: str | None = None
    rope_factor: float = 1.0

    @property
    def context_length(self) -> int | None:
        """Positions a sequence may span: ``max_position_embeddings x rope_factor`` (``None`` when
        the config does not say). A scaled RoPE extends the context by its factor, as inference
        servers count it; the product is never smaller than the model's real limit."""
        if self.max_position_embeddings is None:
            return None
        return int(self.max_position_embeddings * max(self.rope_factor, 1.0))


@attrs.frozen
class EnvironmentContext(SectionContext):
    """A :class:`SectionContext` plus the machine and the model the run will use (``model`` is
    ``None`` when the model directory itself has problems, which are reported separately)."""

    machine: MachineInfo = attrs.field(factory=MachineInfo)
    model: ModelInfo | None = None


@runtime_checkable
class ChecksConfig(Protocol):
    def check_config(self, context: SectionContext) -> Iterable[str]: ...


@runtime_checkable
class ChecksEnvironment(Protocol):
    def check_environment(self, context: EnvironmentContext) -> Iterable[str]: ...


@runtime_checkable
class ChecksData(Protocol):
    def check_data(self, rows: Sequence[DataRow], context: SectionContext) -> Iterable[str]: ...


@runtime_checkable
class DeclaresColumns(Protocol):
    def required_columns(self) -> Sequence[str]: ...


def _lines(result: Any, owner: object, method: str, path: str | None) -> list[str]:
    """The problem lines of ``result``, each prefixed by ``path`` unless it names a key (or ``path``
    is ``None``)."""
    if isinstance(result, str) or not isinstance(result, Iterable):
        raise TypeError(f"{type(owner).__qualname__}.{method} must return an iterable of strings, got {result!r}")
    lines = []
    for item in result:
        if not isinstance(item, str):
            raise TypeError(f"{type(owner).__qualname__}.{method} returned a non-string problem {item!r}")
        lines.append(item if path is None or _names_a_key(item) else f"{path}: {item}")
    return lines


def _names_a_key(line: str) -> bool:
    """Whether ``line`` starts with a key path of the run configuration (``actor.dtype: ...``)."""
    from core_rl.config.schema import RunConfig

    match = re.match(r"([A-Za-z_]\w*)[.\[:]", line)
    return match is not None and match.group(1) in attrs.fields_dict(RunConfig)


def config_problems(config: Any, context: SectionContext) -> list[str]:
    """Run ``config.check_config(context)`` if the config class defines it."""
    if not isinstance(config, ChecksConfig):
        return []
    return _lines(config.check_config(context), config, "check_config", context.path)


def environment_problems(config: Any, context: EnvironmentContext) -> list[str]:
    """Run ``config.check_environment(context)`` if the config class defines it."""
    if not isinstance(config, ChecksEnvironment):
        return []
    return _lines(config.check_environment(context), config, "check_environment", context.path)


def data_problems(config: Any, rows: Sequence[DataRow], context: SectionContext) -> list[str]:
    """Run ``config.check_data(rows, context)`` if the config class defines it (its lines as they are)."""
    if not isinstance(config, ChecksData):
        return []
    return _lines(config.check_data(rows, context), config, "check_data", None)


def required_columns(config: Any) -> list[str]:
    """The columns a reward's config declares it reads (``[]`` if it declares none)."""
    if not isinstance(config, DeclaresColumns):
        return []
    columns = config.required_columns()
    if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
        raise TypeError(f"{type(config).__qualname__}.required_columns must return a list of strings, got {columns!r}")
    return list(columns)


def group_size_problems(context: SectionContext, *, allowed: bool, option: str | None) -> list[str]:
    """For a component that compares the samples of each prompt's group (group-relative advantages,
    group filters): a problem when ``rollout.sampling.n`` is 1, since every group then holds one
    sample and carries no signal, unless ``allowed`` (the section's ``option``, named in the
    message; ``None`` when the component offers no way to run anyway)."""
    n = context.run.rollout.sampling.n
    if n >= 2 or allowed:
        return []
    escape = f", or {context.key(option)}=true to run anyway" if option else ""
    return [
        f"{context.path}: {context.name!r} compares the samples of each prompt's group, but rollout.sampling.n is "
        f"{n}, so every group holds one sample and nothing would train; set rollout.sampling.n to 2 or more{escape}"
    ]
