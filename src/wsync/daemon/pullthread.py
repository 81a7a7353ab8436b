"""One engine pull on its own thread and event loop, so it can never stall the API.

Why not run the engine on the daemon's loop: a pull's clean-up after a cancel
is partly synchronous (joining the extractor thread, removing a half-written
tree of 200k files, waiting for journal writes), and on the shared loop that
froze ``/healthz``, every other job and SIGTERM handling for seconds.  On its
own thread the engine may block as long as it likes; the daemon's loop only
waits on a future.

The contract with the daemon's loop is small:

* :meth:`PullThread.start` runs ``work`` (a coroutine factory) on a fresh loop
  in a daemon thread; the outcome (a result or an exception) resolves
  :attr:`PullThread.done` on the daemon's loop.
* :meth:`PullThread.cancel` is thread-safe and idempotent: it cancels the
  engine's task on its own loop (or stops it before it starts).
* Nothing here touches the job store or the event broker; callbacks that must
  reach the daemon's loop go through :meth:`PullThread.to_main`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import structlog

T = TypeVar("T")

log = structlog.get_logger("wsync.daemon")


class PullThread(Generic[T]):
    """Runs one coroutine to completion on a dedicated thread with its own loop."""

    def __init__(self, name: str, work: Callable[[], Awaitable[T]]) -> None:
        self._main = asyncio.get_running_loop()
        self.done: asyncio.Future[T] = self._main.create_future()
        self._work = work
        self._lock = threading.Lock()
        self._cancelled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[T] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread; where none can be started (out of memory or processes), the
        outcome is that error: the job fails, it never waits for a thread that is not."""
        try:
            self._thread.start()
        except RuntimeError as exc:
            self._resolve((False, exc))

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def cancel(self) -> None:
        """Ask the pull to stop (the engine keeps its journal); returns at once."""
        with self._lock:
            self._cancelled = True
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed: it ended
                loop.call_soon_threadsafe(task.cancel)

    def to_main(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` on the daemon's loop (dropped once that loop is closed)."""
        with contextlib.suppress(RuntimeError):
            self._main.call_soon_threadsafe(callback, *args)

    # -- on the pull's own thread ---------------------------------------------

    async def _guarded(self) -> T:
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            cancelled = self._cancelled
        if cancelled:
            raise asyncio.CancelledError()
        return await self._work()

    def _run(self) -> None:
        outcome: tuple[bool, Any]
        try:
            loop = asyncio.new_event_loop()
        except BaseException as exc:
            # no loop (out of file descriptors, say): the outcome is that error, or the
            # job would wait on ``done`` for good and hold its sandbox's slot
            self.to_main(self._resolve, (False, exc))
            return
        try:
            outcome = (True, loop.run_until_complete(self._guarded()))
        except BaseException as exc:  # delivered to the waiting job, never lost
            outcome = (False, exc)
        finally:
            with self._lock:
                self._loop = self._task = None
            try:
                _close_loop(loop)
            except Exception:  # a failed loop teardown must not lose the outcome
                log.warning("pull_thread.teardown_failed", exc_info=True)
        self.to_main(self._resolve, outcome)

    def _resolve(self, outcome: tuple[bool, Any]) -> None:
        if self.done.done():
            return
        ok, value = outcome
        if ok:
            self.done.set_result(value)
        elif isinstance(value, asyncio.CancelledError):
            # a cancelled *future* would look like the waiter itself was cancelled
            self.done.set_exception(PullCancelled())
        elif not isinstance(value, Exception):  # SystemExit & co. stay on their thread
            self.done.set_exception(RuntimeError(f"pull thread ended by {value!r}"))
        else:
            self.done.set_exception(value)


class PullCancelled(Exception):
    """The pull's own task was cancelled (by :meth:`PullThread.cancel`)."""


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """What ``asyncio.run`` does on the way out: cancel leftovers, close generators."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.run_until_complete(loop.shutdown_default_executor())
    loop.close()
