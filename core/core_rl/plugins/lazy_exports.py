"""A package's names imported on first access (PEP 562), so that importing the package stays cheap.

A registration module imports its package first; where the package's ``__init__`` re-exports
modules that need torch, every plugin load would import torch. With ::

    __all__, __getattr__ = lazy_exports(__name__, {"pkg.module": ("Name", ...), ...})

``pkg.Name`` imports ``pkg.module`` the first time it is read, and is then an ordinary attribute.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(package: str, modules: Mapping[str, Iterable[str]]) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` for ``package``: each name of ``modules[module]`` comes from that module."""
    exports = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later reads skip this function
        return value

    return sorted(exports), __getattr__
