"""Repository-wide test hooks.

``@pytest.mark.server_env("vllm")`` (or a test class with a ``name`` attribute and a bare
``server_env`` mark, as the server engines' conformance classes have) marks a test that needs an
inference server's own environment (``core-rl server-env create NAME``). Where that environment is
not built and no package index can be reached to build it (a GPU machine without network, say),
the test is skipped with that reason rather than failing on the first install step.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile

import pytest


@functools.cache
def _index_problem() -> str | None:
    """Why pip cannot download from its package index (``None`` if it can): one short try."""
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--quiet"]
        command += ["--retries", "0", "--timeout", "20", "--dest", scratch, "pluggy"]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return "pip download did not answer within 120 s"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"pip download exited with status {proc.returncode}"


@functools.cache
def _environment_missing(name: str) -> str | None:
    """Why the server environment ``name`` cannot be had here (``None`` if it is built, or can be)."""
    from core_rl import server_env

    try:
        if server_env.find(server_env.get_spec(name)) is not None:
            return None
    except Exception as exc:  # the plugin declaring it is absent or broken: the test reports that itself
        return None if "not installed" not in str(exc) else f"the {name} server plugin is not installed"
    problem = _index_problem()
    if problem is None:
        return None
    return f"the {name} server environment is not built and no package index is reachable to build it ({problem})"


def pytest_runtest_setup(item: pytest.Item) -> None:
    mark = item.get_closest_marker("server_env")
    if mark is None:
        return
    name = mark.args[0] if mark.args else getattr(item.cls, "name", None)
    if name is None:
        return
    reason = _environment_missing(name)
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def tiny_grpo_warm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny GRPO example's layout (``examples/tiny_grpo/warm_start.py``'s ``warm_task``) with a
    warm-started model of head size 32 (64 / 2 heads), the smallest vLLM's CPU attention runs:
    ``root``, ``model``, ``data``."""
    from pathlib import Path

    example = str(Path(__file__).resolve().parent / "examples" / "tiny_grpo")
    sys.path.insert(0, example)
    try:
        from warm_start import warm_task

        return warm_task(tmp_path_factory.mktemp("tiny_grpo"), num_heads=2)
    finally:
        sys.path.remove(example)
