"""core-rl-train-kit keeps to core-rl's public surface (:mod:`core_rl.testing.public_api`) and every
module of it imports on CPU (that the core imports none of it: tests/test_import_graph.py)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import core_rl_train_kit
import pytest
from core_rl.testing.public_api import private_imports

KIT = Path(core_rl_train_kit.__file__).parent


def test_the_kit_imports_only_core_rls_public_surface() -> None:
    assert private_imports(KIT) == []


@pytest.mark.parametrize("module", sorted(m.name for m in pkgutil.iter_modules([str(KIT)])))
def test_every_module_imports(module: str) -> None:
    importlib.import_module(f"core_rl_train_kit.{module}")
