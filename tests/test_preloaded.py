"""Processes forked from a preloaded interpreter (core_rl/testing/preloaded.py) behave as
``subprocess`` children of a fresh ``python`` do, where the tests rely on it: exit statuses,
output, environment, directory, signals, sessions, timeouts, and the interpreter keyed by the
environment its imports read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from core_rl.testing import preloaded

SCRIPT = """
import os, sys, json
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "flag": os.environ.get("PRELOADED_TEST_FLAG"),
                  "torch": "torch" in sys.modules, "frozen": __import__("gc").get_freeze_count(),
                  "core_rl": [m for m in sys.modules if m.split(".")[0] == "core_rl"], "name": __name__,
                  "pgid": os.getpgid(0), "pid": os.getpid(), "ppid": os.getppid()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def test_a_script_runs_as_main_with_its_argv_env_cwd_and_status(tmp_path: Path, script: Path) -> None:
    import json

    env = {**os.environ, "PRELOADED_TEST_FLAG": "yes"}
    work = tmp_path / "work"
    work.mkdir()
    proc = preloaded.run([sys.executable, script, "3"], env=env, cwd=work, capture_output=True, text=True)
    seen = json.loads(proc.stdout)
    assert proc.returncode == 3 and proc.stderr == "to stderr\n"
    assert seen["argv"] == [str(script), "3"] and seen["cwd"] == str(work) and seen["flag"] == "yes"
    assert seen["name"] == "__main__"
    assert seen["torch"], "the child starts with torch already imported"
    assert set(preloaded.PRELOAD_CORE_RL) <= set(seen["core_rl"]), "and the modules of a core-rl run"
    assert seen["frozen"] > 100_000, "which the garbage collector no longer walks"
    assert seen["pgid"] == seen["pid"], "a process group of its own"


#: run with ``python -c``: imports the modules of ``argv[1]`` (JSON), then, with ``os.environ``
#: recording every read, those of ``argv[2]``; prints ``{variable: where it was read}`` as JSON
ENVIRONMENT_READS = """
import importlib, json, os, sys
from collections.abc import MutableMapping

class Recording(MutableMapping):
    def __init__(self, real):
        self.real, self.read = real, {}

    def _note(self, name):
        frame = sys._getframe(2)
        while frame.f_code.co_filename == "<string>" or "_collections_abc" in frame.f_code.co_filename:
            frame = frame.f_back
        self.read.setdefault(name, f"{frame.f_code.co_filename}:{frame.f_lineno}")

    def __getitem__(self, name):
        self._note(name)
        return self.real[name]

    def __setitem__(self, name, value):
        self.real[name] = value

    def __delitem__(self, name):
        del self.real[name]

    def __iter__(self):
        self._note("(every variable)")
        return iter(self.real)

    def __len__(self):
        return len(self.real)

for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
os.environ = recording = Recording(os.environ)
for name in json.loads(sys.argv[2]):
    importlib.import_module(name)
print(json.dumps(recording.read))
"""


def environment_read_at_import(before: Sequence[str], modules: Sequence[str], path: str = "") -> dict[str, str]:
    """The variables importing ``modules`` (after ``before``) reads, in a fresh interpreter, each
    with where it was first read; those that key a preloaded interpreter left out."""
    import json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-c", ENVIRONMENT_READS, json.dumps(list(before)), json.dumps(list(modules))],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = json.loads(proc.stdout.splitlines()[-1])
    keys = dict(preloaded.import_time_environment(dict.fromkeys(read, "")))
    return {k: v for k, v in read.items() if k not in keys}


def test_the_preloaded_core_rl_modules_read_no_environment_at_import(tmp_path: Path) -> None:
    """A child sets its environment after the fork: what the preloaded core-rl modules (and every
    module they import) computed at import must not depend on a variable that does not key the
    interpreter (:func:`preloaded.import_time_environment`), however indirectly they read it."""
    reads = environment_read_at_import(preloaded.PRELOAD, preloaded.PRELOAD_CORE_RL)
    assert reads == {}, f"importing the preloaded core-rl modules reads the environment: {reads}"

    (tmp_path / "reads_at_import.py").write_text(
        "import os\n\n\ndef spec():\n    return os.environ.get('CORE_RL_SOMETHING')\n\n\nSPEC = spec()\n"
    )
    reads = environment_read_at_import(preloaded.PRELOAD, ["reads_at_import"], path=str(tmp_path))
    assert reads == {"CORE_RL_SOMETHING": f"{tmp_path / 'reads_at_import.py'}:5"}, "the check sees indirect reads"


def test_a_module_runs_with_dash_m_and_an_uncaught_exception_exits_1_with_its_traceback(tmp_path: Path) -> None:
    package = tmp_path / "probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "boom.py").write_text("import sys\nprint(sys.argv[1:])\nraise ValueError('boom here')\n")
    proc = preloaded.run(
        [sys.executable, "-m", "probe_pkg.boom", "a", "b"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert proc.stdout == "['a', 'b']\n"
    assert "Traceback" in proc.stderr and "ValueError: boom here" in proc.stderr


def test_popen_streams_signals_and_a_session_of_its_own(tmp_path: Path) -> None:
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('got SIGTERM', flush=True), sys.exit(7)))\n"
        "print('ready', os.getsid(0) == os.getpid(), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = preloaded.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert isinstance(proc, preloaded.PreloadedPopen)
    assert proc.stdout.readline() == "ready True\n"
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7 and out == "got SIGTERM\n" and err is None


def test_a_timeout_kills_the_process_group_and_keeps_the_output(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        preloaded.run([sys.executable, str(script)], capture_output=True, text=True, timeout=20)
    assert time.monotonic() - start < 60
    grandchild = int(caught.value.output)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{grandchild}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    status = Path(f"/proc/{grandchild}/stat")
    assert not status.exists() or status.read_text().split()[2] == "Z", "the grandchild outlived the timeout"


def test_stdin_input_reaches_the_child(tmp_path: Path) -> None:
    script = tmp_path / "echo.py"
    script.write_text("import sys\nprint(sys.stdin.read().upper(), end='')\n")
    proc = preloaded.run([sys.executable, str(script)], input="hello", capture_output=True, text=True)
    assert proc.stdout == "HELLO" and proc.returncode == 0


def test_an_import_time_variable_gets_an_interpreter_of_its_own(script: Path) -> None:
    import json

    def parent(env: dict[str, str]) -> int:
        proc = preloaded.run([sys.executable, str(script), "0"], env=env, capture_output=True, text=True)
        return json.loads(proc.stdout)["ppid"]

    plain = {**os.environ}
    keyed = {**os.environ, "HF_HUB_OFFLINE": "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"}
    assert preloaded.import_time_environment(plain) != preloaded.import_time_environment(keyed)
    first = preloaded._interpreter(plain)
    assert preloaded._interpreter(plain) is first
    second = preloaded._interpreter(keyed)
    assert second is not first and not second.log.exists(), "a started interpreter leaves no file behind"
    assert parent(plain) == first.process.pid
    assert parent(keyed) == second.process.pid
    assert parent({**plain, "CORE_RL_SOMETHING": "else"}) == first.process.pid, "read later: not a key"


def test_other_commands_and_options_go_to_subprocess(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(preloaded.Popen(["true"]), subprocess.Popen)
    assert isinstance(preloaded.Popen([sys.executable, "-c", "pass"]), subprocess.Popen)
    assert isinstance(preloaded.Popen([sys.executable, "x.py"], close_fds=False), subprocess.Popen)
    env = {**os.environ, "CUDA_MODULE_LOADING": "marked-unforkable"}
    monkeypatch.setitem(preloaded._unforkable, preloaded.import_time_environment(env), "CUDA initialised")
    assert isinstance(preloaded.Popen([sys.executable, str(tmp_path / "x.py")], env=env), subprocess.Popen)
    (tmp_path / "ok.py").write_text("print('ran')\n")
    assert preloaded.run([sys.executable, str(tmp_path / "ok.py")], env=env, capture_output=True).stdout == b"ran\n"
    monkeypatch.setenv(preloaded.PRELOAD_ENV, "0")
    assert isinstance(preloaded.Popen([sys.executable, str(tmp_path / "x.py")]), subprocess.Popen)


def test_the_forked_childrens_cpu_is_counted(tmp_path: Path) -> None:
    script = tmp_path / "spin.py"
    script.write_text("import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n")
    before = preloaded.forked_cpu_seconds
    assert preloaded.run([sys.executable, str(script)]).returncode == 0
    assert preloaded.forked_cpu_seconds - before >= 0.5


#: each worker's line goes out in one write: torchrun runs its workers with ``-u``, where print() writes
#: the text and the newline apart, and the two workers' lines could interleave on the shared pipe
WORKER = """
import json, os, sys
seen = {"rank": int(os.environ["RANK"]), "torch": "torch" in sys.modules, "ppid": os.getppid(),
        "sid": os.getsid(0), "pid": os.getpid(), "agent": int(os.environ["AGENT"])}
os.write(1, (json.dumps(seen) + "\\n").encode())
import time
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)
"""

AGENT = """
import os, runpy, sys
os.environ["AGENT"] = str(os.getpid())
if os.environ.get("AGENT_SETS"):  # a variable the workers' imports would read, set by the agent
    os.environ.update([os.environ["AGENT_SETS"].split("=")])
sys.argv = ["torchrun", "--standalone", "--nproc_per_node=2", "--log-dir=" + sys.argv[1], *sys.argv[2:]]
runpy.run_module("torch.distributed.run", run_name="__main__")
"""


def _agent_env(**extra: str) -> dict[str, str]:
    """The environment the agent of :func:`_torchrun` runs with (which picks its interpreter)."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra}


def _torchrun(tmp_path: Path, status: int, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Two workers of ``WORKER`` under torch's elastic agent, itself forked from a preloaded
    interpreter; the agent's result and what each worker saw at its start."""
    import json

    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "agent.py").write_text(AGENT)
    proc = preloaded.run(
        [sys.executable, str(tmp_path / "agent.py"), str(tmp_path / "logs"), str(tmp_path / "worker.py"), str(status)],
        env=_agent_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    seen = sorted(
        (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), key=lambda s: s["rank"]
    )
    assert [s["rank"] for s in seen] == [0, 1], proc.stdout + proc.stderr
    return proc, seen


def test_an_elastic_agents_workers_are_forked_from_the_interpreter_and_report_their_status(tmp_path: Path) -> None:
    interpreter = preloaded._interpreter(_agent_env()).process.pid
    before = preloaded.forked_cpu_seconds
    proc, seen = _torchrun(tmp_path, 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for worker in seen:
        assert worker["torch"], "a worker starts with torch imported"
        assert worker["ppid"] == interpreter != worker["agent"], "forked by the interpreter, not the agent"
        assert worker["sid"] == worker["pid"], "a session of its own, as torch starts its workers"
    assert preloaded.forked_cpu_seconds - before >= 0.6, "the workers' CPU counts for the test that ran them"

    proc, _ = _torchrun(tmp_path, 5)
    assert proc.returncode != 0 and "exitcode  : 5" in proc.stderr, "the agent sees a worker's status"


@pytest.mark.parametrize(
    "env", [{"CORE_RL_TEST_PRELOAD": "0"}, {"AGENT_SETS": "HF_PRELOADED_TEST=1"}], ids=["told", "import-time"]
)
def test_an_agent_told_not_to_preload_or_with_other_import_time_variables_starts_its_workers_itself(
    tmp_path: Path, env: dict[str, str]
) -> None:
    proc, seen = _torchrun(tmp_path, 0, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for worker in seen:
        assert not worker["torch"] and worker["ppid"] == worker["agent"]


CLOSER = """
import os, signal, sys, time
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
handler = SubprocessHandler(sys.executable, (sys.argv[2],), {}, sys.argv[1], None, 0, None)
pid = handler.proc.pid
deadline = time.monotonic() + 60
while True:  # until the interpreter has reaped the worker: its process group is gone
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        break
    assert time.monotonic() < deadline, "the worker did not end"
    time.sleep(0.05)
handler.close(signal.SIGTERM)  # as the agent's close after a poll that came just before the exit
assert handler._stdout.closed
print("closed", type(handler.proc).__name__)
"""


def test_an_agent_closing_a_worker_the_interpreter_already_reaped_does_not_fail(tmp_path: Path) -> None:
    """The agent's ``close`` of a worker that exited (and that the interpreter reaped) after the
    agent last polled it: no ``ProcessLookupError`` from the signal to its gone process group (a
    ``subprocess`` child would still be a zombie there), and its log file closed as torch's close does."""
    (tmp_path / "closer.py").write_text(CLOSER)
    (tmp_path / "worker.py").write_text("")
    proc = preloaded.run(
        [sys.executable, str(tmp_path / "closer.py"), str(tmp_path / "out.log"), str(tmp_path / "worker.py")],
        env=_agent_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["closed", "PreloadedPopen"]
