"""glibc's malloc, set for a process that moves multi-MiB buffers between threads.

A pull holds its chunk reads in flight (4 MiB each, ``--parallel`` of them) and hands
them from the event loop to the journal's and the extractor's threads.  With glibc's
defaults two things keep that memory long after it was freed:

- the **dynamic mmap threshold**: a block of 128 KiB or more comes from ``mmap`` and goes
  back to the kernel when freed, but freeing one raises the threshold to its size, so
  every later 4 MiB buffer comes from a heap instead, where freed space is reused but
  seldom returned, and fragments;
- **one arena per thread** (up to eight per core): each thread that allocates gets a heap
  of its own, and a buffer allocated in one and freed in another stays in the first.

Measured on the standard library's tree over loopback ssh (peak RSS of the pull, three
rounds each, alternating): 125-131 MiB with the defaults, 115-118 MiB with a fixed 1 MiB
threshold and two arenas (issue 13's goal is 120).  An ``mmap`` per large buffer costs
its page faults, about 0.3 ms for 4 MiB: nothing beside the read that filled it.

Only the process's entry point calls :func:`tune` (an in-process caller's allocator is
its own business), before the pull's threads start: an arena, once made, stays.
Elsewhere (musl, another libc) there is no ``mallopt`` and nothing is done.
"""

from __future__ import annotations

import ctypes

#: ``mallopt`` parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
#: blocks this large or larger are mapped, and unmapped when freed
MMAP_THRESHOLD = 1 << 20
#: heaps shared by all threads
ARENA_MAX = 2


def tune() -> bool:
    """Set the threshold and the arena count; False where this libc has no ``mallopt``
    (or refused a value)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(M_ARENA_MAX, ARENA_MAX))
