"""Helpers for a pull that is stopping: wait for its threads without blocking the loop.

A pull runs two kinds of threads: the extractor and the journal writers.  When
it fails or is cancelled it must stop them and remove its partial tree, on the
event loop, and that loop must keep running: the CLI exits within a second or
two of a Ctrl-C only if nothing blocks it, and the daemon serves other jobs and
its health check from the same loop.  So nothing here joins a thread or shuts
an executor down with ``wait=True``; every wait is a cancellable poll with a
bound, and what outlives the bound is left behind (daemon threads; the next run
removes a partial tree before it extracts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


class WriterPool:
    """Threads for blocking writes (the journal's chunks, the extractor's small files),
    which knows its writes still in flight, so that a stopping pull waits for them with a
    bound instead of ``shutdown(wait=True)``.

    Daemon threads over a queue, not a ``ThreadPoolExecutor``: Python joins an executor's
    threads at exit without a bound, so one write stuck on a hung filesystem would keep a
    stopped pull's process alive after the wind-down gave up on it.  A journal write is
    temp-file, fsync, rename: one cut short by the exit leaves a temp file the next run
    removes.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = 0
        self._shutdown = False
        self.pending: set[concurrent.futures.Future[Any]] = set()

    def submit(
        self, fn: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs
    ) -> concurrent.futures.Future[_R]:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        future: concurrent.futures.Future[_R] = concurrent.futures.Future()
        self.pending.add(future)
        future.add_done_callback(self.pending.discard)
        self._jobs.put((future, functools.partial(fn, *args, **kwargs)))
        if self._threads < self._max:
            name = f"{self._prefix}_{self._threads}"
            threading.Thread(target=_work, args=(self._jobs,), name=name, daemon=True).start()
            self._threads += 1
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; with ``cancel_futures`` drop what has not started; with
        ``wait`` wait for what is running (only where it must: never on the loop)."""
        self._shutdown = True
        if cancel_futures:
            for future in list(self.pending):
                future.cancel()
        for _ in range(self._threads):
            self._jobs.put(None)
        if wait:
            for future in list(self.pending):
                if not future.cancelled():
                    future.exception()


_Job = tuple["concurrent.futures.Future[Any]", Callable[[], Any]]


def _work(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (item := jobs.get()) is not None:
        future, job = item
        if not future.set_running_or_notify_cancel():
            continue  # cancelled before it started
        try:
            result = job()
        except BaseException as exc:  # the submitter's to raise
            future.set_exception(exc)
        else:
            future.set_result(result)


async def await_thread(thread: threading.Thread, bound: float | None) -> bool:
    """Wait until ``thread`` ends (True) or ``bound`` seconds pass (False), polling.

    Polling instead of ``thread.join``: a join blocks the event loop (and with it
    signal handling and, in the daemon, every other job), and a join in a worker
    thread cannot be abandoned.  The poll is cancellable and costs ~nothing.
    """
    loop = asyncio.get_running_loop()
    deadline = None if bound is None else loop.time() + bound
    delay = 0.001
    while thread.is_alive():
        if deadline is not None and loop.time() >= deadline:
            return False
        await asyncio.sleep(delay)
        delay = min(0.02, delay * 2)
    return True


async def in_thread(work: Callable[[], _R]) -> _R:
    """``work()`` on a daemon thread of its own, awaited by polling.

    For host work after the extraction (removing a tree, applying lists):
    unlike :func:`asyncio.to_thread`, whose default executor ``asyncio.run``
    and the interpreter join without a bound, a cancelled wait leaves the
    thread to finish or die with the process, so a Ctrl-C ends the run at once.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, name="wsync-host-io", daemon=True)
    thread.start()
    await await_thread(thread, None)
    if "error" in box:
        raise box["error"]
    value: _R = box["value"]
    return value


async def await_future(future: concurrent.futures.Future[Any], bound: float) -> bool:
    """Wait until a thread-pool ``future`` is done (True) or ``bound`` seconds pass."""
    if future.done():
        return True
    with contextlib.suppress(Exception):  # TimeoutError, or the write's own failure
        async with asyncio.timeout(max(0.0, bound)):
            await asyncio.wrap_future(future)
    return future.done()


def raise_if_cancelled() -> None:
    """Raise CancelledError if this task was asked to stop.

    ``Task.cancelling()`` counts cancel requests that were not withdrawn; a
    library that swallowed the CancelledError itself (Python 3.11's
    ``asyncio.wait_for`` does when the awaited future completes in the same
    step) leaves it counted.  Checked at the point of no return, so a swallowed
    cancel can make a pull slower to stop but never lets it replace DEST.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def owned(fd: int, work: Callable[[int], _R]) -> Callable[[], _R]:
    """``work`` on a copy of ``fd`` that the worker thread closes itself: a wait given up
    on (cancelled) leaves the thread at work, and the caller's fd may be closed, its number
    reused by the process meanwhile; the copy keeps naming the same directory."""
    own = os.dup(fd)

    def run() -> _R:
        try:
            return work(own)
        finally:
            os.close(own)

    return run
