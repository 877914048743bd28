"""A command's maximum resident set size as the OS reports it, read the way ``/usr/bin/time`` reads
it: ``wait4`` in a small parent process.

Not from the test process itself: a child's maximum resident set size starts from the memory of the
process it was spawned from (the copy that ``exec`` replaces is counted), and a test process that
has imported torch holds half a GiB. A small waiter process in between (a bare Python, about
10 MiB) spawns the command, so the figure is the command's own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

WAITER = """
import json, os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_pid, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"returncode": os.waitstatus_to_exitcode(status), "max_rss_kib": usage.ru_maxrss}, f)
"""


def run_measured(
    cmd: Sequence[str], report: Path, *, env: Mapping[str, str] | None = None, timeout: float = 600
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``cmd`` (its output captured) and return it with its maximum resident set size in GiB
    (Linux: ``ru_maxrss`` is in KiB). ``report``: a file the waiter writes; on a timeout the whole
    process group is killed and ``subprocess.TimeoutExpired`` raised."""
    waiter = subprocess.Popen(
        [sys.executable, "-c", WAITER, str(report), *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else dict(env),
        start_new_session=True,
    )
    try:
        out, err = waiter.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(waiter.pid, signal.SIGKILL)
        waiter.communicate()
        raise
    assert waiter.returncode == 0, err[-3000:]
    measured = json.loads(report.read_text())
    proc = subprocess.CompletedProcess(list(cmd), measured["returncode"], out, err)
    return proc, measured["max_rss_kib"] * 1024 / 2**30
