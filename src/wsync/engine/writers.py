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
extraction leaks nothing into a long-running daemon.  The threads are daemon threads, not
a ``ThreadPoolExecutor``'s: Python joins those at exit without a limit, and a create
stuck on a hung filesystem must not keep a stopped pull's process alive (the pull gives up
on its extractor thread after a bound: :mod:`wsync.engine.winddown`).
"""

from __future__ import annotations

import queue
import resource
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

#: threads creating files
THREADS = 4
#: payload bytes held by pending jobs, at most (the extractor waits beyond)
MAX_PENDING_BYTES = 4 * 1024 * 1024
#: pending jobs at most (each holds a directory fd): no more than an eighth of the
#: descriptors the process may open (``ulimit -n 48`` still leaves the rest of the pull
#: its fds)
MAX_PENDING_JOBS = 64

_Job = tuple["Future[Any]", Callable[[], Any]]


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


def _work(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (item := jobs.get()) is not None:
        future, job = item
        if not future.set_running_or_notify_cancel():
            continue  # cancelled by close(): its release ran there
        try:
            result = job()
        except BaseException as exc:  # handed to the extractor's thread, in order
            future.set_exception(exc)
        else:
            future.set_result(result)


class Writers:
    """Jobs run by :data:`THREADS` threads, their results handed back in order of submission."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
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
            jobs = self._start()
            self._collect(block=False)
            while self._pending and (
                self._bytes + nbytes > MAX_PENDING_BYTES or len(self._pending) >= self._max_jobs
            ):
                self._collect_one()
        except BaseException:
            if release is not None:
                release()
            raise
        future: Future[Any] = Future()
        self._pending.append(_Pending(future, nbytes, done, release))
        self._bytes += nbytes
        jobs.put((future, job))

    def drain(self) -> None:
        """Wait for every pending job; raise the first error among them."""
        self._collect(block=True)

    def _start(self) -> queue.SimpleQueue[_Job | None]:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            for n in range(THREADS):
                threading.Thread(
                    target=_work, args=(self._jobs,), name=f"wsync-writer-{n}", daemon=True
                ).start()
        return self._jobs

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
            jobs, self._jobs = self._jobs, None
            if jobs is not None:
                for _ in range(THREADS):
                    jobs.put(None)
