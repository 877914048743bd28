"""Registration of the ``verifiers`` environment (entry point group ``core_rl.environments``) and
the ``verifiers`` data source (``core_rl.data_sources``). Both run verifiers in a worker process
of its own venv (:mod:`core_rl_server_kit.worker`); the adapter it runs is :mod:`.adapter`.

.. code-block:: yaml

    data:
      sources:
        tasks: {name: verifiers, taskset: tiny-guess, python_path: [plugins/environments/verifiers/examples]}
      train_files: [source:tasks]
    rollout:
      workflow:
        name: environment
        environment: {name: verifiers, taskset: tiny-guess, python_path: [plugins/environments/verifiers/examples]}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
from core_rl.config.validators import FieldValueError
from core_rl.data import DataSource
from core_rl.hookspecs import Register, hookimpl
from core_rl_server_kit.worker import LibraryEnvOptions, WorkerEnvironment, WorkerSpec, shared_worker, worker_rows

ADAPTER = Path(__file__).with_name("adapter.py")
#: verifiers' own venv, unless ``requirements`` says otherwise
REQUIREMENTS = ["verifiers==0.4.*"]


def _taskset_id(_inst: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if not value.strip():
        raise FieldValueError(attribute.name, value, "must name a verifiers taskset (its package or module)")


@attrs.define
class VerifiersConfig(LibraryEnvOptions):
    """The section of the ``verifiers`` environment and data source (the same options serve both):
    ``taskset`` (a verifiers taskset id: an installed package or a module on ``python_path``),
    ``taskset_options`` (its config fields), ``env`` (a verifiers ``Env`` id; empty: the taskset's own,
    else verifiers' single-agent env), ``env_options`` (the ``Env`` config's fields), ``role`` (the
    ``Env`` role the policy plays; empty: its first), and the venv options of
    :class:`~core_rl_server_kit.worker.LibraryEnvOptions` (``requirements`` default ``verifiers==0.4.*``)."""

    taskset: str = attrs.field(validator=_taskset_id)
    taskset_options: dict[str, Any] = attrs.field(factory=dict)
    env: str = ""
    env_options: dict[str, Any] = attrs.field(factory=dict)
    role: str = ""
    requirements: list[str] = attrs.field(factory=lambda: list(REQUIREMENTS))

    def adapter_options(self) -> dict[str, Any]:
        return {
            "taskset": self.taskset,
            "taskset_options": self.taskset_options,
            "env": self.env,
            "env_options": self.env_options,
            "role": self.role,
        }


def worker_spec(config: VerifiersConfig, kind: str, key: str) -> WorkerSpec:
    """The worker of ``config`` as the ``verifiers`` ``kind`` (its venv built once)."""
    return config.worker_spec("verifiers", f"{kind} 'verifiers'", key, ADAPTER, config.adapter_options())


def make_environment(config: VerifiersConfig) -> WorkerEnvironment:
    return WorkerEnvironment(shared_worker(worker_spec(config, "environment", "rollout.workflow.environment")))


class VerifiersSource(DataSource):
    """The taskset's tasks as rows (``prompt``, ``verifiers_idx``, ``verifiers_key``), in its order
    (made once per process for the same options)."""

    def __init__(self, config: VerifiersConfig) -> None:
        self.config = config

    def rows(self) -> Iterable[Mapping[str, Any]]:
        return worker_rows(worker_spec(self.config, "data source", "data.sources.<verifiers source>"))


@hookimpl
def core_rl_register_environments(register: Register) -> None:
    register(
        "verifiers",
        make_environment,
        config_cls=VerifiersConfig,
        description="a verifiers taskset and Env played turn by turn (its rewards score), in verifiers' own venv",
    )


@hookimpl
def core_rl_register_data_sources(register: Register) -> None:
    register(
        "verifiers",
        VerifiersSource,
        config_cls=VerifiersConfig,
        description="a verifiers taskset's tasks as rows (for the verifiers environment), made in verifiers' own venv",
    )
