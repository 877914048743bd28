"""The ``reasoning_gym`` data source: rows of reasoning-gym's procedural tasks.

Each task named in ``tasks`` gives ``size`` rows, made by ``reasoning_gym.create_dataset(task,
size=size, seed=seed, **task_options[task])``, in the task's index order, the tasks in the order
listed. A row is ``{"prompt": question, "answer": gold answer, "metadata": the task's metadata,
"task": the task's name}``, the metadata exactly the dict reasoning-gym made (tuples stay tuples:
some scorers, ``arc_agi``'s and ``rearc``'s among them, compare against them). The same options
make the same rows: reasoning-gym's datasets are a function of their seed and index.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

import attrs
from core_rl.config.validators import FieldValueError
from core_rl.data import DataSource
from core_rl.errors import ConfigError, did_you_mean

#: reasoning-gym's own mixture of tasks, which a task list here replaces
NOT_A_TASK = ("composite",)


def reasoning_gym() -> ModuleType:
    """``reasoning_gym``, imported without the ``SyntaxWarning`` s one of its dependencies
    (cellpylib) prints when its modules are compiled."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        import reasoning_gym
        import reasoning_gym.utils

    return reasoning_gym


def task_names() -> list[str]:
    """Every procedural task reasoning-gym registers (but its ``composite`` mixture), sorted."""
    return sorted(name for name in reasoning_gym().factory.DATASETS if name not in NOT_A_TASK)


def _tasks(_inst: Any, attribute: attrs.Attribute[Any], value: list[str]) -> None:
    if not value:
        raise FieldValueError(attribute.name, value, "must name at least one reasoning-gym task, e.g. [chain_sum]")
    known = task_names()
    for i, name in enumerate(value):
        if name not in known:
            close = did_you_mean(name, known)
            hint = f"did you mean {close!r}" if close else f"reasoning-gym's tasks: {', '.join(known)}"
            raise FieldValueError(f"{attribute.name}[{i}]", name, f"is no reasoning-gym task ({hint})")
    repeated = sorted({n for n in value if value.count(n) > 1})
    if repeated:
        raise FieldValueError(attribute.name, value, f"names {', '.join(repeated)} twice; list each task once")


def _positive(_inst: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 1:
        raise FieldValueError(attribute.name, value, "must be at least 1")


@attrs.define
class ReasoningGymSourceConfig:
    """The section of the ``reasoning_gym`` source: ``tasks`` (reasoning-gym task names), ``size``
    (rows per task), ``seed``, and ``task_options`` (a task's name -> keyword arguments of its
    dataset config, e.g. ``{chain_sum: {min_terms: 2, max_terms: 3}}``)."""

    tasks: list[str] = attrs.field(validator=_tasks)
    size: int = attrs.field(default=100, validator=_positive)
    seed: int = 0
    task_options: dict[str, dict[str, Any]] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        for name in self.task_options:
            if name not in self.tasks:
                raise FieldValueError(
                    f"task_options.{name}", self.task_options[name], f"is for a task not in tasks ({self.tasks})"
                )
            options = self.task_options[name]
            config_cls = reasoning_gym().factory.DATASETS[name][1]
            try:
                dataset_config = config_cls(**options)
                if callable(getattr(dataset_config, "validate", None)):
                    dataset_config.validate()
            except (TypeError, ValueError, AssertionError) as exc:
                raise FieldValueError(
                    f"task_options.{name}", options, f"is refused by reasoning-gym's {config_cls.__name__}: {exc}"
                ) from None


class ReasoningGymSource(DataSource):
    """See the module docstring."""

    def __init__(self, config: ReasoningGymSourceConfig) -> None:
        self.config = config

    def _dataset(self, name: str) -> Any:
        options = self.config.task_options.get(name, {})
        try:
            return reasoning_gym().create_dataset(name, size=self.config.size, seed=self.config.seed, **options)
        except (TypeError, ValueError, AssertionError) as exc:  # options its config refuses
            raise ConfigError(
                [f"data source 'reasoning_gym': task_options.{name}: reasoning-gym refuses {options}: {exc}"]
            ) from None

    def rows(self) -> Iterable[Mapping[str, Any]]:
        rows = []
        for name in self.config.tasks:
            dataset = self._dataset(name)
            for index in range(self.config.size):
                entry = dataset[index]
                rows.append(
                    {
                        "prompt": entry["question"],
                        "answer": entry["answer"],
                        "metadata": entry["metadata"],
                        "task": name,
                    }
                )
        return rows
