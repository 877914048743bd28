"""What the process does with host memory freed between generation and training
(``rollout.engine.host_memory``).

A process that alternates generation (a KV cache) and training (activations kept for backward)
frees and allocates much the same few hundred MB every step. Memory the C allocator hands back to
the operating system comes back as fresh pages, and the kernel zeroes each one on its first touch
(a minor page fault). Two policies, for glibc's allocator (other C libraries: neither does
anything):

- ``reuse`` (the default on a CPU device): freed memory stays mapped for the next allocations,
  whichever thread makes them. :func:`keep_freed_memory` sets glibc's mmap threshold to
  :data:`HEAP_BLOCK_LIMIT` (a block up to that size comes from the heap, instead of a mapping of
  its own that ``free`` unmaps; the threshold glibc adapts by itself starts at 128 KiB), its trim
  threshold to :data:`KEEP_FREE_TOP` (the heap's free top is not handed back), and its arena limit
  to one (a thread that allocates for the first time from then on shares an arena that exists
  instead of making its own, so the memory the update frees serves the generation, which may run
  on the rollout controller's thread, and the other way round; a thread's own arena hands a heap
  that has become free back to the OS). On the TRL benchmark's medium CPU workload (eager, 10
  steps after 3) this took the step's minor page faults from ~42k to ~1.2k and the step from 0.77
  to 0.71 s; resident memory stays at the run's high-water mark, ~10% above the ``release`` peak.
  The settings are the process's (every allocation in it follows them) and are made once, when
  the first engine with this policy is built.
- ``release`` (the default on a GPU, where little of a step's memory is the host's): before and
  after each ``generate``, :func:`release_host_memory` runs ``malloc_trim(0)`` (the free pages of
  every arena go back to the OS; about a millisecond a call) at most once per ``min_interval_s``
  seconds, so that runs of many tiny steps do not pay it every step. Resident memory drops between
  the phases: the KV cache is not allocated on top of the update's freed activations, and the
  update not on top of the freed cache; every step then faults its pages in again.

``reuse`` keeps what fragmentation leaves as well: where ``memory/host_rss_gib`` grows from step to
step (shapes that vary a lot), ``release`` bounds it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import time
from typing import Any

#: the policies of ``rollout.engine.host_memory``
HOST_MEMORY_POLICIES = ("reuse", "release")
#: the least time between two trims under ``release``
MIN_INTERVAL_S = 0.25
#: ``reuse``: blocks up to this size come from the heap (glibc's largest mmap threshold on 64-bit)
HEAP_BLOCK_LIMIT = 32 * 1024 * 1024
#: ``reuse``: free memory at the heap's top up to this size stays mapped (C ``int``'s largest value)
KEEP_FREE_TOP = 2**31 - 1
#: glibc's ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8

_last_trim = [float("-inf")]


@functools.cache
def _glibc() -> Any | None:
    """The C library when it is glibc on Linux (it has ``malloc_trim`` and ``mallopt``), else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim, libc.mallopt  # noqa: B018 - musl and other C libraries lack one or both
    except (OSError, AttributeError):
        return None
    return libc


def trim_supported() -> bool:
    """Whether the policies can do anything here (glibc on Linux)."""
    return _glibc() is not None


@functools.cache
def keep_freed_memory() -> bool:
    """The ``reuse`` policy: make glibc keep freed memory mapped for reuse (see the module
    docstring); once per process. ``True`` if every setting took."""
    libc = _glibc()
    if libc is None:
        return False
    settings = ((_M_MMAP_THRESHOLD, HEAP_BLOCK_LIMIT), (_M_TRIM_THRESHOLD, KEEP_FREE_TOP), (_M_ARENA_MAX, 1))
    return all([bool(libc.mallopt(parameter, value)) for parameter, value in settings])  # each, even after a refusal


def release_host_memory(min_interval_s: float = MIN_INTERVAL_S) -> bool:
    """The ``release`` policy: return the heap's free pages to the OS unless the last trim was less
    than ``min_interval_s`` seconds ago; ``True`` if it trimmed."""
    libc = _glibc()
    now = time.monotonic()
    if libc is None or now - _last_trim[0] < min_interval_s:
        return False
    libc.malloc_trim(0)
    _last_trim[0] = now
    return True
