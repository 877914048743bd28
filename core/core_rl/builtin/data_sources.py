"""Built-in data source ``function``: a plain Python function, from a file or a module, makes the rows.

.. code-block:: yaml

    data:
      sources:
        arithmetic: {name: function, path: tasks.py:make_rows, kwargs: {count: 200, seed: 1}}
      train_files: [source:arithmetic]

``path`` is ``file.py:function`` (relative to the working directory) or ``module:function``
(:mod:`core_rl.plugins.callables`); the function is called as ``function(**kwargs)`` and returns an
iterable of rows (mappings of column to value), which must be the same rows in the same order on
every call with the same ``kwargs`` (a resumed run calls it again): take any randomness from a seed
among ``kwargs``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from core_rl.config.validators import FieldValueError
from core_rl.data.sources import DataSource
from core_rl.errors import ConfigError
from core_rl.hookspecs import Register, hookimpl
from core_rl.plugins.callables import CALLABLE, CALLABLE_FORMS, LoadFailed, load_callable


def _reference(_inst: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if not CALLABLE.match(value):
        raise FieldValueError(attribute.name, value, f"must be {CALLABLE_FORMS}")


@attrs.define
class FunctionSourceConfig:
    """The section of the ``function`` data source: ``path`` (the function) and ``kwargs`` (passed by name)."""

    path: str = attrs.field(validator=_reference)
    kwargs: dict[str, Any] = attrs.field(factory=dict)


class FunctionSource(DataSource):
    """The rows ``function(**kwargs)`` returns (see the module docstring)."""

    def __init__(self, config: FunctionSourceConfig) -> None:
        self.config = config
        try:
            self.function = load_callable(config.path)
        except LoadFailed as exc:
            raise ConfigError([f"data source 'function': path {config.path!r}: {exc}"]) from None

    def rows(self) -> Iterable[Mapping[str, Any]]:
        return list(self.function(**self.config.kwargs))


@hookimpl
def core_rl_register_data_sources(register: Register) -> None:
    register(
        "function",
        FunctionSource,
        description="the rows a Python function (file.py:function or module:function) returns",
        config_cls=FunctionSourceConfig,
    )
