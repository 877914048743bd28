"""Process trees, their CPU use and their shared memory, read from ``/proc`` (Linux): what tests
and benchmarks measure of servers and trainers."""

from __future__ import annotations

import os
import time
from pathlib import Path


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (``None`` when it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def environment_of(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with (``/proc/PID/environ``; ``OSError`` when it is
    gone or not readable). Bytes that are not UTF-8 are replaced."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


def ancestors(pid: int) -> list[int]:
    """``pid``, its parent, and so on up to (not including) pid 1."""
    chain: list[int] = []
    current: int | None = pid
    while current is not None and current > 1 and current not in chain:
        chain.append(current)
        current = parent_of(current)
    return chain


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        ppid = parent_of(int(entry.name))
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def tree_usage(root: int | None) -> tuple[float, int]:
    """CPU seconds (user + system) used so far by the processes of ``root``'s tree, and their
    thread count ((0, 0) without a root)."""
    if root is None:
        return 0.0, 0
    tick = os.sysconf("SC_CLK_TCK")
    cpu, threads = 0.0, 0
    for pid in process_tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        threads += int(fields[17])
    return cpu, threads


def idle_cpu(root: int | None, seconds: float = 3.0) -> float:
    """The CPU use (cores) of ``root``'s tree over the next ``seconds``; for a server nobody
    sends requests to, anything above a few hundredths means it polls or spins."""
    before, _ = tree_usage(root)
    time.sleep(seconds)
    return (tree_usage(root)[0] - before) / seconds


def children_of(pid: int) -> list[int]:
    """Pids of ``pid``'s live child processes (Linux ``/proc``)."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and parent_of(int(entry)) == pid]


def shared_anonymous_kib(pid: int) -> int:
    """KiB of ``pid``'s anonymous memory (heap, no backing file) that another process also maps:
    the copy-on-write pages a forked child still shares with its parent. A process started with
    ``exec`` (``spawn``) shares none. Sum of ``Shared_Dirty`` over the anonymous mappings of
    ``/proc/PID/smaps``."""
    total, anonymous = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields:
            continue
        if not fields[0].endswith(":"):  # a mapping's header: address perms offset dev inode [path]
            anonymous = len(fields) < 6 or fields[5] == "[heap]"
        elif fields[0] == "Shared_Dirty:" and anonymous:
            total += int(fields[1])
    return total
