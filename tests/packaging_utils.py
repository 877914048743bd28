"""Helpers for the tests that build and install distributions for real: find the projects of this
repository, build their wheels, make virtual environments and install targets, run the ``core-rl``
command in another environment.

pytest runs in importlib mode, which puts no test directory on ``sys.path``: test modules load this
file by its path (see the top of ``tests/test_packaging.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PLUGIN_DIR = REPO_ROOT / "examples" / "third_party_plugin"
ENTRY_POINT_PREFIX = "core_rl."
PLUGIN_ENV_VARS = ("CORE_RL_PLUGINS_ALLOW", "CORE_RL_PLUGINS_BLOCK")
# pip resolving and installing torch and the core dependencies can take minutes on a cold cache
PIP_TIMEOUT_S = 900
CLI_TIMEOUT_S = 300
# one short try, so an unreachable index is detected in seconds rather than after retries
PROBE_ARGS = ("--retries", "0", "--timeout", "20")


# -- the projects of this repository ----------------------------------------------------------------


def plugin_project_dirs() -> list[Path]:
    """Every plugin project (``plugins/<kind>/<name>/pyproject.toml``), sorted; new ones are found too."""
    return sorted(path.parent for path in REPO_ROOT.glob("plugins/*/*/pyproject.toml"))


def all_project_dirs() -> list[Path]:
    """The root project (``core-rl``) followed by every plugin project."""
    return [REPO_ROOT, *plugin_project_dirs()]


def read_pyproject(project_dir: Path) -> dict[str, Any]:
    with (project_dir / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def normalise(name: str) -> str:
    """A distribution name in PEP 503 normal form (``Core_RL.grpo`` -> ``core-rl-grpo``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution_name(project_dir: Path) -> str:
    return normalise(read_pyproject(project_dir)["project"]["name"])


def wheel_package(project_dir: Path) -> str:
    """The import package a project's wheel ships (the last part of its hatch ``packages`` entry)."""
    packages = read_pyproject(project_dir)["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    assert len(packages) == 1, f"{project_dir}: expected one wheel package, got {packages}"
    return Path(packages[0]).name


def declared_entry_points(project_dir: Path) -> set[tuple[str, str]]:
    """``(group, name)`` of every core-rl entry point a project declares in its pyproject.toml."""
    groups = read_pyproject(project_dir)["project"].get("entry-points", {})
    return {(group, name) for group, eps in groups.items() if group.startswith(ENTRY_POINT_PREFIX) for name in eps}


def find_provider(group: str, name: str) -> Path | None:
    """The plugin project of this repository that declares entry point ``name`` in ``group``."""
    for project_dir in plugin_project_dirs():
        if (group, name) in declared_entry_points(project_dir):
            return project_dir
    return None


# -- processes ----------------------------------------------------------------------------------------


def run(
    cmd: Sequence[str | Path], *, env: Mapping[str, str] | None = None, cwd: Path | None = None, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``, capturing its output as text."""
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False
    )


def check_run(
    cmd: Sequence[str | Path], *, env: Mapping[str, str] | None = None, cwd: Path | None = None, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on a non-zero exit fail with the command and the tail of its output."""
    proc = run(cmd, env=env, cwd=cwd, timeout=timeout)
    if proc.returncode != 0:
        shown = " ".join(str(c) for c in cmd)
        raise AssertionError(
            f"command failed with exit status {proc.returncode}: {shown}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
        )
    return proc


def install_modules(root: Path, distribution: str, version: str, modules: Mapping[str, str], entry_points: str) -> Path:
    """Install a distribution as pip would, without building it: ``modules`` (name -> source) and a
    ``.dist-info`` directory (its metadata and ``entry_points``, the text of ``entry_points.txt``)
    in ``root``, which then goes on ``PYTHONPATH`` (or ``sys.path``). Returns ``root``."""
    info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        sys.modules.pop(module, None)
    return root


def clean_env(*, pythonpath: Iterable[Path] = (), extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` with ``PYTHONPATH`` set to ``pythonpath`` only, without the core-rl plugin
    allow/block variables unless ``extra`` sets them, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV_VARS and k != "PYTHONPATH"}
    paths = [str(p) for p in pythonpath]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra or {})
    return env


def cli(
    python: Path | str,
    *args: str | Path,
    pythonpath: Iterable[Path] = (),
    extra_env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m core_rl.cli ARGS`` (the ``core-rl`` command) in a clean environment."""
    return run(
        [python, "-m", "core_rl.cli", *args],
        env=clean_env(pythonpath=pythonpath, extra=extra_env),
        timeout=CLI_TIMEOUT_S,
    )


def plugin_rows(proc: subprocess.CompletedProcess[str]) -> list[dict[str, str]]:
    """The rows printed by ``core-rl plugins --json`` (fails with its stderr if it did not succeed)."""
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert isinstance(rows, list)
    return rows


# -- building and installing ------------------------------------------------------------------------


#: builds each project given on the command line with its own PEP 517 backend (``build-system``
#: of its ``pyproject.toml``), in this one process; prints one JSON line per project
_BUILD_SCRIPT = """
import importlib, json, os, sys, tomllib
out = sys.argv[1]
for project in sys.argv[2:]:
    with open(os.path.join(project, "pyproject.toml"), "rb") as f:
        backend = importlib.import_module(tomllib.load(f)["build-system"]["build-backend"])
    os.chdir(project)
    try:
        wheel = backend.build_wheel(out)
    except Exception as exc:
        print(json.dumps({"project": project, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        sys.exit(1)
    print(json.dumps({"project": project, "wheel": wheel}), flush=True)
"""


def build_wheels(
    project_dirs: Sequence[Path], wheel_dir: Path, *, python: Path | str = sys.executable
) -> dict[str, Path]:
    """Build one wheel per project into ``wheel_dir``, as ``pip wheel --no-deps --no-build-isolation``
    would: each project's own build backend (hatchling), taken from ``python``'s environment so
    nothing is downloaded, called through its PEP 517 ``build_wheel`` hook, all in one process (one
    ``pip`` process per project cost ~1 s each). A failure names its project.

    Returns normalised distribution name -> wheel path.
    """
    wheel_dir.mkdir(parents=True, exist_ok=True)
    projects = {str(Path(d).resolve()): Path(d) for d in project_dirs}
    proc = run([python, "-c", _BUILD_SCRIPT, wheel_dir.resolve(), *projects], timeout=PIP_TIMEOUT_S)
    built: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):  # a backend's own output
            continue
        row = json.loads(line)
        if "error" in row:
            raise AssertionError(
                f"building the wheel of {row['project']} failed: {row['error']}\n{proc.stderr[-4000:]}"
            )
        built[row["project"]] = row["wheel"]
    if proc.returncode != 0 or len(built) != len(projects):
        missing = sorted(set(projects) - set(built))
        raise AssertionError(f"building wheels stopped before {missing}:\n{proc.stderr[-4000:]}")
    wheels: dict[str, Path] = {}
    for resolved, project_dir in projects.items():
        name, wheel = distribution_name(project_dir), wheel_dir / built[resolved]
        assert normalise(wheel.name.split("-")[0]) == name, f"building {name} ({project_dir}) gave {wheel.name}"
        wheels[name] = wheel
    return wheels


def install_into_target(wheels: Iterable[Path], target: Path, *, python: Path | str = sys.executable) -> Path:
    """``pip install --no-deps --target TARGET WHEELS``: a directory to put on ``PYTHONPATH``."""
    wheels = list(wheels)
    target.mkdir(parents=True, exist_ok=True)
    if wheels:
        check_run(
            [python, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target", target, *wheels],
            timeout=PIP_TIMEOUT_S,
        )
    return target


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def venv_script(venv: Path, name: str) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / (f"{name}.exe" if os.name == "nt" else name)


def make_venv(venv: Path) -> Path:
    """A new virtual environment without system site packages; returns its python.

    It has no pip of its own (``--without-pip`` saves ensurepip's ~10 s): :func:`pip` runs this
    environment's pip on it with ``--python``.
    """
    check_run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=PIP_TIMEOUT_S)
    return venv_python(venv)


def pip(python: Path, *args: str | Path, timeout: float = PIP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``pip ARGS`` acting on ``python``'s environment (pip's cache and configuration as usual)."""
    return check_run([sys.executable, "-m", "pip", "--python", python, *args], env=clean_env(), timeout=timeout)


def pip_install(python: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """``pip install ARGS`` into ``python``'s environment, without byte-compiling (much faster for
    torch; modules compile when first imported)."""
    return pip(python, "install", "--quiet", "--no-compile", *args)


def registry_problem(scratch: Path) -> str | None:
    """Why pip cannot download from its package index (None when it can).

    Downloads one small package, bypassing the cache, with one short try: a quick answer before the
    long installs that would otherwise wait out network timeouts.
    """
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--quiet", *PROBE_ARGS]
    proc = run([*download, "--dest", scratch, "pluggy"], env=clean_env(), timeout=120)
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"pip download exited with status {proc.returncode}"
