"""Run an untrusted program in a sandbox made of Linux namespaces and resource limits.

``unshare`` (util-linux) starts the launcher (:mod:`core_rl_reward_code.launcher`) in new user,
mount, network and PID namespaces:

- **network**: a fresh network namespace with no interface up: every connection fails;
- **filesystem**: every mount read-only except a private temporary work directory (also ``HOME``
  and ``TMPDIR``), removed afterwards;
- **processes**: a fresh PID namespace with its own ``/proc``: the program sees no other process
  (so not the trainer's ``/proc/<pid>/environ``), and when its first process dies the kernel kills
  every process in the namespace; ``RLIMIT_NPROC`` stops fork bombs;
- **privileges**: the user namespace's root, with every capability dropped and no-new-privileges;
  when the trainer runs as root, the sandbox is started under a fresh unprivileged uid of its own
  (:func:`sandbox_uid`): the kernel never applies ``RLIMIT_NPROC`` to uid 0, and counts it per uid,
  so only a uid of its own makes ``max_processes`` bound exactly this sandbox's processes (where
  other users cannot run this Python, e.g. under ``/root``, it stays uid 0 and a warning says so);
- **limits**: CPU seconds, address space, file size (which also caps stdout and stderr, written to
  files), open files, no core dumps; a wall-clock timeout kills the whole process group, and
  :func:`run_sandboxed` returns only once no process of the sandbox is left;
- **environment**: only ``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` and two ``PYTHON*`` switches.

The program can still read what the trainer's user can read on disk (read-only).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
from core_rl.config.validators import positive
from core_rl.errors import CoreRLError

from core_rl_reward_code import launcher

UNSHARE_FLAGS = ["--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child"]
VERDICT_LIMIT = 1 << 16
#: uids a sandbox started by root runs under: above any a system allocates, one per run
SANDBOX_UID_BASE, SANDBOX_UID_SPAN = 1 << 20, 1 << 29
#: how long the processes of a killed sandbox may take to disappear
REAP_TIMEOUT_S = 30.0


class SandboxUnavailable(CoreRLError):
    """This machine cannot create the namespaces the sandbox needs."""


@attrs.define
class SandboxLimits:
    """Limits of one sandboxed run: ``timeout_s`` wall clock, ``cpu_s`` CPU time, ``memory_mb``
    address space, ``max_output_kb`` for stdout, stderr and each written file, ``max_processes``
    (threads count too), ``max_open_files``."""

    timeout_s: float = attrs.field(default=10.0, validator=positive())
    cpu_s: int = attrs.field(default=5, validator=positive())
    memory_mb: int = attrs.field(default=1024, validator=positive())
    max_output_kb: int = attrs.field(default=1024, validator=positive())
    max_processes: int = attrs.field(default=32, validator=positive())
    max_open_files: int = attrs.field(default=64, validator=positive())


@attrs.define
class RunResult:
    """How a sandboxed run ended: ``exit_code`` (negative: killed by that signal), whether it ran
    past ``timeout_s``, its output (each cut at the output limit) and what it wrote to the
    verdict descriptor (``verdict_fd`` of :func:`run_sandboxed`)."""

    exit_code: int
    timed_out: bool
    stdout: str
    stderr: str
    verdict: str


@functools.cache
def sandbox_problem() -> str | None:
    """Why the sandbox cannot run here (``None`` if it can): tried once per process."""
    tools = {name: shutil.which(name) for name in ("unshare", "setpriv")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        return f"{' and '.join(missing)} not found (install util-linux)"
    try:
        probe = subprocess.run(
            [*_as_user(sandbox_uid()), tools["unshare"], *UNSHARE_FLAGS, "--", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if probe.returncode != 0:
        return f"unshare cannot create user, network, mount and PID namespaces: {probe.stderr.strip()}"
    return None


def sandbox_uid() -> int | None:
    """A fresh uid for one sandbox when this process is root and other users can run this Python
    (see the module docstring), else ``None``: the sandbox runs as this process's user."""
    if os.geteuid() != 0 or not _other_users_can_run_python():
        return None
    return SANDBOX_UID_BASE + secrets.randbelow(SANDBOX_UID_SPAN)


@functools.cache
def _other_users_can_run_python() -> bool:
    """Whether an unprivileged uid can start this interpreter (not when it lives under a private
    home such as ``/root``); if not, a root trainer's sandboxes keep uid 0, whose process count the
    kernel does not limit, and that is said once."""
    uid = SANDBOX_UID_BASE + secrets.randbelow(SANDBOX_UID_SPAN)
    try:
        command = [*_as_user(uid), shutil.which("unshare") or "unshare", *UNSHARE_FLAGS, "--", sys.executable]
        probe = subprocess.run([*command, "-I", "-c", "pass"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if probe.returncode != 0:
        warnings.warn(
            f"reward 'code': running as root with a Python other users cannot run ({sys.executable}), so "
            "sandboxes keep uid 0, for which the kernel does not enforce sandbox.max_processes; install "
            "core-rl with a Python outside a private home directory to have it enforced",
            stacklevel=2,
        )
        return False
    return True


def _as_user(uid: int | None) -> list[str]:
    """The command prefix that starts the sandbox as ``uid`` (nothing for ``None``)."""
    if uid is None:
        return []
    return [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def _pid_namespace(pid: int) -> tuple[int, int] | None:
    """The identity (device, inode) of ``pid``'s PID namespace, ``None`` if it is gone."""
    try:
        st = os.stat(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _hold_launcher_namespace(unshare: subprocess.Popen) -> int | None:
    """A descriptor of the PID namespace of the sandbox ``unshare`` started (its child's), waiting
    briefly for the child to exist; ``None`` once ``unshare`` has ended. Holding it keeps the
    namespace's identity from being reused by another sandbox's before :func:`_reap` has run (an
    inode number alone would be: it is recycled as soon as the namespace dies). Never this
    process's own namespace."""
    deadline = time.monotonic() + 5.0
    pid, own = unshare.pid, _pid_namespace(os.getpid())
    while time.monotonic() < deadline and unshare.poll() is None:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return None
        for child in children:  # not a helper unshare may fork in our own namespace (to map user ids)
            try:
                fd = os.open(f"/proc/{child}/ns/pid", os.O_RDONLY)
            except OSError:
                continue
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != own:
                return fd
            os.close(fd)
        time.sleep(0.002)
    return None


def _reap(namespace_fd: int | None) -> None:
    """SIGKILL every process left in the held PID namespace until none is (the kernel kills them
    when its first process dies, but not at once), then let the namespace go; an error naming
    them after :data:`REAP_TIMEOUT_S`."""
    if namespace_fd is None:
        return
    try:
        st = os.fstat(namespace_fd)
        namespace = (st.st_dev, st.st_ino)
        deadline = time.monotonic() + REAP_TIMEOUT_S
        while left := [int(p.name) for p in Path("/proc").glob("[0-9]*") if _pid_namespace(int(p.name)) == namespace]:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"reward 'code': processes {left} of a sandbox outlived SIGKILL for {REAP_TIMEOUT_S} s"
                )
            time.sleep(0.01)
    finally:
        os.close(namespace_fd)


def require_sandbox() -> None:
    """Raise :class:`SandboxUnavailable` (with what to do) unless the sandbox can run here."""
    problem = sandbox_problem()
    if problem is not None:
        raise SandboxUnavailable(
            f"reward 'code' cannot sandbox programs on this machine: {problem}. It needs unprivileged "
            "user namespaces (sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0; "
            "in a container, a seccomp profile that allows unshare) or running as root"
        )


def _clean_env(work: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": work,
        "TMPDIR": work,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def _read_capped(path: Path, limit: int) -> str:
    with path.open("rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _drain(fd: int) -> str:
    os.set_blocking(fd, False)
    chunks, size = [], 0
    while size < VERDICT_LIMIT:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


def run_sandboxed(
    argv: Sequence[str],
    files: Mapping[str, str],
    limits: SandboxLimits,
    *,
    stdin: str = "",
    verdict_fd: bool = False,
) -> RunResult:
    """Run ``argv`` in a fresh sandbox whose work directory (the current directory) holds ``files``
    (name -> text). ``{verdict_fd}`` in ``argv`` is replaced by a descriptor the program may write
    a short verdict to (read back as ``RunResult.verdict``)."""
    require_sandbox()
    uid = sandbox_uid()
    with tempfile.TemporaryDirectory(prefix="core-rl-code-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir(mode=0o700)
        for name, text in files.items():
            (work / name).write_text(text, encoding="utf-8")
        if uid is not None:  # the sandbox's own user owns its work directory
            for path in (Path(tmp), work, *work.iterdir()):
                os.chown(path, uid, uid)
        (Path(tmp) / "stdin").write_text(stdin, encoding="utf-8")
        read_end, write_end = os.pipe() if verdict_fd else (-1, -1)
        args = [a.replace("{verdict_fd}", str(write_end)) for a in argv]
        spec = {
            "workdir": str(work),
            "setpriv": shutil.which("setpriv"),
            "argv": args,
            "limits": {
                "cpu_s": limits.cpu_s,
                "address_space_bytes": limits.memory_mb << 20,
                "file_size_bytes": limits.max_output_kb << 10,
                "processes": limits.max_processes,
                "open_files": limits.max_open_files,
            },
        }
        unshare = [shutil.which("unshare"), *UNSHARE_FLAGS, "--"]
        command = [*_as_user(uid), *unshare, sys.executable, "-I", launcher.__file__]
        timed_out = False
        try:
            with (
                (Path(tmp) / "stdin").open("rb") as fin,
                (Path(tmp) / "stdout").open("wb") as fout,
                (Path(tmp) / "stderr").open("wb") as ferr,
            ):
                proc = subprocess.Popen(
                    [*command, json.dumps(spec)],
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    cwd=work,
                    env=_clean_env(str(work)),
                    start_new_session=True,
                    pass_fds=(write_end,) if verdict_fd else (),
                )
            if verdict_fd:
                os.close(write_end)
                write_end = -1
            namespace = _hold_launcher_namespace(proc)
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the PID namespace takes everything in it along
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
                _reap(namespace)
            verdict = _drain(read_end) if verdict_fd else ""
        finally:
            for fd in (read_end, write_end):
                if fd >= 0:
                    os.close(fd)
        cap = limits.max_output_kb << 10
        stderr = _read_capped(Path(tmp) / "stderr", cap)
        if proc.returncode == launcher.SETUP_FAILED and stderr.startswith("sandbox setup failed"):
            raise RuntimeError(f"reward 'code': {stderr.strip()}")
        return RunResult(
            exit_code=proc.returncode,
            timed_out=timed_out,
            stdout=_read_capped(Path(tmp) / "stdout", cap),
            stderr=stderr,
            verdict=verdict,
        )
