"""Make ``core_rl_example_plugin`` importable when these tests run from a source checkout without the
plugin installed (core-rl's own test run). Installed (``pip install -e .``), the installed copy is
used and the contracts also check the entry points declared in ``pyproject.toml``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("core_rl_example_plugin") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
