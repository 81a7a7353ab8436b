"""A few threads that create the extractor's small files while it reads on.

Why: on a busy ext4 creating a file costs the kernel 100-300 us (the inode allocator, the
directory's index, the journal), more than everything else a small file costs, and
``tar -x`` pays it one file at a time.  Measured here on the standard library's 7,733
files (their bytes already in memory, DEST on the same filesystem): 1.39 s in one thread,
0.86 s in four.  ``os.open`` and ``os.write`` release the GIL, so threads are enough.

The extractor stays the only reader and judge of the archive: a job is a closure it made
after every check, over a directory fd it reached itself (see :mod:`wsync.engine.extract`).
What it must keep in order, it orders: it waits for every pending job (:meth:`Writers.drain`)
before a hardlink (its target may be pending), before a later archive's replacements and
before the final directory pass (a create changes its directory's mtime).  Two members of
one name stay refused whichever is created first (the second gets ``EEXIST``).  A job's
error is raised in the extractor's thread at its next submit or drain, the first one only;
and :meth:`Writers.close` waits for every running job, so nothing writes after the
extraction returned or failed.

A job may hold a resource (the extractor's jobs hold a dup of a directory fd, closed when
they run): its ``release`` runs instead when the job never will (cancelled by
:meth:`Writers.close`, or its submit failed on an earlier job's error), so a failed
extraction leaks nothing into a long-running daemon.  The threads are
:class:`~wsync.engine.winddown.WriterPool`'s daemon threads: a create stuck on a hung
filesystem must not keep a stopped pull's process alive (the pull gives up on its extractor
thread after a bound).
"""

from __future__ import annotations

import resource
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from wsync.engine.winddown import WriterPool

#: threads creating files
THREADS = 4
#: payload bytes held by pending jobs, at most (the extractor waits beyond)
MAX_PENDING_BYTES = 4 * 1024 * 1024
#: pending jobs at most (each holds a directory fd): no more than an eighth of the
#: descriptors the process may open (``ulimit -n 48`` still leaves the rest of the pull
#: its fds)
MAX_PENDING_JOBS = 64


class _Pending:
    """A submitted job as the extractor's thread tracks it."""

    __slots__ = ("done", "future", "nbytes", "release")

    def __init__(
        self,
        future: Future[Any],
        nbytes: int,
        done: Callable[[Any], None] | None,
        release: Callable[[], None] | None,
    ) -> None:
        self.future = future
        self.nbytes = nbytes
        self.done = done
        self.release = release


class Writers:
    """Jobs run by :data:`THREADS` threads, their results handed back in order of submission."""

    def __init__(self) -> None:
        self._pool: WriterPool | None = None
        self._pending: deque[_Pending] = deque()
        self._bytes = 0
        #: a job's error was raised (the first: what is pending now came after it)
        self.failed = False
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._max_jobs = MAX_PENDING_JOBS if soft < 0 else max(1, min(MAX_PENDING_JOBS, soft // 8))

    def submit(
        self,
        job: Callable[[], Any],
        nbytes: int,
        done: Callable[[Any], None] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Run ``job`` in a thread; ``done(result)`` runs later in this thread.  Waits while
        too much is pending; raises the first error of a finished job (then ``release()``
        runs: the job never will)."""
        try:
            if self._pool is None:
                self._pool = WriterPool(THREADS, "wsync-writer")
            self._collect(block=False)
            while self._pending and (
                self._bytes + nbytes > MAX_PENDING_BYTES or len(self._pending) >= self._max_jobs
            ):
                self._collect_one()
            future = self._pool.submit(job)
        except BaseException:
            if release is not None:
                release()
            raise
        self._pending.append(_Pending(future, nbytes, done, release))
        self._bytes += nbytes

    def drain(self) -> None:
        """Wait for every pending job; raise the first error among them."""
        self._collect(block=True)

    def _collect(self, *, block: bool) -> None:
        while self._pending and (block or self._pending[0].future.done()):
            self._collect_one()

    def _collect_one(self) -> None:
        item = self._pending.popleft()
        self._bytes -= item.nbytes
        try:
            result = item.future.result()  # a job's exception is raised here, in order
        except BaseException:
            self.failed = True
            raise
        if item.done is not None:
            item.done(result)

    def close(self) -> None:
        """Cancel the jobs not yet started (releasing what they hold), wait for those still
        running, discard their results and errors (the extraction is over: it returned
        after :meth:`drain`, or failed), stop the threads."""
        pending, self._pending = self._pending, deque()
        self._bytes = 0
        try:
            for item in pending:
                if item.future.cancel() and item.release is not None:
                    item.release()
            for item in pending:
                if not item.future.cancelled():
                    item.future.exception()  # waits; retrieved: never reported as unhandled
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False)
