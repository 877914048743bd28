"""Runs first inside the sandbox's fresh user, mount, network and PID namespaces (started by
``unshare``, see :mod:`core_rl_reward_code.sandbox`), as that user namespace's root, before any
untrusted code:

1. bind-mounts the private work directory onto itself (its own mount, left writable);
2. remounts every other mount read-only (a mount that cannot be made read-only aborts the run);
3. sets the resource limits (CPU time, address space, file size, processes, open files, no core);
4. executes ``setpriv`` to drop every capability (bounding and inheritable sets) and set
   no-new-privileges, which then executes the program.

Usage (by the sandbox only): ``python -I launcher.py SPEC_JSON``. Exit status 125 with a message on
stderr if the sandbox could not be set up. Standard library only.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
_OPTION_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, flags: int) -> None:
    src = source.encode() if source is not None else None
    if _libc.mount(src, target.encode(), None, ctypes.c_ulong(flags), None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of this mount namespace's visible mounts: where several
    are stacked on one point only the top one (the last listed) can be reached."""
    top: dict[str, set[str]] = {}
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            top.pop(point, None)
            top[point] = set(fields[5].split(","))
    return list(top.items())


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def make_read_only(workdir: str) -> None:
    """Every mount read-only except ``workdir`` (and ``/proc``, this PID namespace's own)."""
    _mount(workdir, workdir, MS_BIND | MS_REC)
    for point, options in _mounts():
        if _inside(point, workdir) or _inside(point, "/proc") or "ro" in options:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in options:
            flags |= _OPTION_FLAGS.get(option, 0)
        _mount(None, point, flags)
    still_writable = [p for p, o in _mounts() if "rw" in o and not _inside(p, workdir) and not _inside(p, "/proc")]
    if still_writable:
        raise OSError(f"mounts still writable: {still_writable}")


def set_limits(limits: dict[str, int]) -> None:
    """Hard and soft limits (the program cannot raise them again)."""
    table = {
        "cpu_s": resource.RLIMIT_CPU,
        "address_space_bytes": resource.RLIMIT_AS,
        "file_size_bytes": resource.RLIMIT_FSIZE,
        "processes": resource.RLIMIT_NPROC,
        "open_files": resource.RLIMIT_NOFILE,
    }
    for key, which in table.items():
        resource.setrlimit(which, (limits[key], limits[key]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        make_read_only(spec["workdir"])
        set_limits(spec["limits"])
        os.chdir(spec["workdir"])
    except OSError as exc:
        print(f"sandbox setup failed: {exc}", file=sys.stderr)
        sys.exit(SETUP_FAILED)
    setpriv = spec["setpriv"]
    drop = ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    os.execv(setpriv, [setpriv, *drop, *spec["argv"]])


if __name__ == "__main__":
    main()
