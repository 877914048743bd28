"""The root conftest's wait for ``scripts/test.sh``'s background server-environment builds, the
steps it asks the script for (those the selected tests need), and the collection order that lets
them run while the other tests do."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hooks(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("root_conftest_copy", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv(module.BUILDS_ENV, str(tmp_path))
    monkeypatch.delenv(module.PLAN_ENV, raising=False)  # set where scripts/test.sh runs this test
    return module


def test_no_background_build_means_nothing_to_wait_for(hooks, monkeypatch, tmp_path):
    assert hooks._background_build_failure("vllm") is None  # no log: test.sh is not building it
    monkeypatch.delenv(hooks.BUILDS_ENV)
    (tmp_path / "vllm.log").write_text("building")
    assert hooks._background_build_failure("vllm") is None


def test_a_running_build_is_waited_for(hooks, tmp_path):
    (tmp_path / "sglang.log").write_text("building\n")

    def finish() -> None:
        time.sleep(1.5)
        (tmp_path / "sglang.rc").write_text("0\n")

    thread = threading.Thread(target=finish)
    start = time.monotonic()
    thread.start()
    assert hooks._background_build_failure("sglang") is None
    assert time.monotonic() - start >= 1.5
    thread.join()


def test_a_failed_build_names_its_status_and_log(hooks, tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "ERROR: no matching distribution\n")
    (tmp_path / "vllm.rc").write_text("1\n")
    failure = hooks._background_build_failure("vllm")
    assert failure.startswith(f"building the vllm server environment failed (status 1; {log})")
    assert failure.rstrip().endswith("ERROR: no matching distribution") and "line 50" not in failure


def test_a_build_that_never_ends_times_out(hooks, tmp_path, monkeypatch):
    (tmp_path / "vllm.log").write_text("building\n")
    monkeypatch.setattr(hooks, "SERVER_ENV_BUILD_TIMEOUT_S", 0)
    assert "did not end within 0 s" in hooks._background_build_failure("vllm")


def test_steps_wait_until_the_script_has_started_the_planned_ones(hooks, monkeypatch, tmp_path):
    plan = tmp_path / "plan"
    monkeypatch.setenv(hooks.PLAN_ENV, str(plan))
    monkeypatch.setattr(hooks, "SERVER_ENV_BUILD_TIMEOUT_S", 0)
    (tmp_path / "vllm.log").write_text("building\n")
    (tmp_path / "vllm.rc").write_text("0\n")
    assert "did not end within 0 s" in hooks._background_build_failure("vllm")  # not started yet
    hooks._background_step_status.cache_clear()
    (tmp_path / "plan.started").write_text("")
    assert hooks._background_build_failure("vllm") is None
    hooks._background_step_status.cache_clear()
    assert hooks._background_step_status("slurm-packages") is None  # not planned: nothing to wait for


def test_the_plan_holds_the_steps_the_selected_tests_need(hooks):
    slurm = _Item("test_s.py", False)
    slurm.after_setup = "slurm-packages"
    sglang = _Item("test_g.py", True)
    sglang.server = "sglang"
    items = [*_items(), slurm, sglang]
    assert hooks.background_steps(items) == ["after-setup slurm-packages", "server-env sglang", "server-env vllm"]
    assert hooks.background_steps([item for item in items if not item._server and not item.after_setup]) == []


def test_files_with_server_tests_are_collected_last(pytester_items):
    names = [item.path.name for item in pytester_items]
    assert names == ["test_d.py"] * 3 + ["test_a.py", "test_a.py", "test_c.py", "test_b.py", "test_b.py"]


def test_recorded_durations_send_the_longest_files_first(hooks, monkeypatch, tmp_path):
    """A file's recorded seconds order it; a file without a record counts as its tests times the
    recorded average per test (here (50 + 4) / 3 = 18 s a test: test_d.py's 3 tests 54 s); a
    server file stays behind the others however long it is."""
    durations = tmp_path / "file_durations.json"
    durations.write_text(json.dumps({"test_c.py": 50.0, "test_a.py": 4.0}))
    monkeypatch.setattr(hooks, "DURATIONS", durations)
    items = [*_items(), _Item("test_e.py", True)]
    hooks.pytest_collection_modifyitems(items)
    names = [item.path.name for item in items]
    assert names == ["test_d.py"] * 3 + ["test_c.py", "test_a.py", "test_a.py", "test_b.py", "test_b.py", "test_e.py"]


class _Item:
    def __init__(self, name: str, server: bool) -> None:
        self.path = Path(name)
        self.cls = None
        self._server = server
        self.server = "vllm"
        self.after_setup: str | None = None

    def get_closest_marker(self, name: str):
        if self._server and name == "server_env":
            return pytest.mark.server_env(self.server).mark
        return next(self.iter_markers(name), None)

    def iter_markers(self, name: str):
        if self.after_setup is not None and name == "after_setup":
            yield pytest.mark.after_setup(self.after_setup).mark


def _items() -> list[_Item]:
    items = [_Item("test_a.py", False), _Item("test_b.py", False), _Item("test_b.py", True)]
    return items + [_Item("test_a.py", False), _Item("test_c.py", False)] + [_Item("test_d.py", False)] * 3


@pytest.fixture
def pytester_items(hooks, monkeypatch, tmp_path):
    # test_b.py holds one server test, so both its tests move, in order, behind the others; with no
    # recorded durations the other files keep whole, those with more tests first
    monkeypatch.setattr(hooks, "DURATIONS", tmp_path / "none.json")
    items = _items()
    hooks.pytest_collection_modifyitems(items)
    return items
