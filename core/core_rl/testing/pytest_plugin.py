"""The testing kit's pytest plugin (entry point ``pytest11``: ``core_rl``), loaded by pytest wherever
core-rl is installed: it registers the markers the kit's contract classes carry, so a third-party
plugin's test run knows them without declaring them itself (and ``--strict-markers`` passes).

- ``server_env(name)``: needs an inference server's own environment (``core-rl server-env create
  NAME``); the server contract class (:mod:`core_rl.testing.server_contract`) carries it.
- ``gpu``: needs a CUDA GPU (:func:`core_rl.testing.sleep.gpu_marks` adds the skip).
- ``slow``: takes more than ~30 s.
"""

from __future__ import annotations

import pytest

#: ``(marker, description)`` as ``pytest --markers`` lists them
MARKERS = (
    ("server_env(name)", "needs an inference server's own environment (core-rl server-env create NAME)"),
    ("gpu", "needs a CUDA GPU (skipped without one)"),
    ("slow", "takes more than ~30 s"),
)


def pytest_configure(config: pytest.Config) -> None:
    for marker, description in MARKERS:
        config.addinivalue_line("markers", f"{marker}: {description}")
