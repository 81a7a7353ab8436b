"""A pull's own thread (:mod:`wsync.daemon.pullthread`): whatever stops it from running,
its outcome reaches the daemon's loop.  Found by a review: out of file descriptors, the
thread could not make its event loop and died without a word; the job stayed ``running``
for good, deaf to cancels, and its sandbox got no more pulls until a restart."""

from __future__ import annotations

import asyncio
import errno
import threading

import pytest

from wsync.daemon import pullthread
from wsync.daemon.pullthread import PullThread


async def _work() -> str:
    return "pulled"


def test_a_pull_thread_delivers_its_result() -> None:
    async def go() -> str:
        thread = PullThread("t", _work)
        thread.start()
        return await asyncio.wait_for(thread.done, 30)

    assert asyncio.run(go()) == "pulled"


def test_a_thread_that_cannot_make_its_loop_fails_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_loop() -> asyncio.AbstractEventLoop:
        raise OSError(errno.EMFILE, "Too many open files")

    async def go() -> None:
        thread = PullThread("t", _work)
        monkeypatch.setattr(pullthread.asyncio, "new_event_loop", no_loop)
        thread.start()
        with pytest.raises(OSError, match="Too many open files"):
            await asyncio.wait_for(thread.done, 30)

    asyncio.run(go())


def test_a_thread_that_cannot_start_fails_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    async def go() -> None:
        thread = PullThread("t", _work)
        monkeypatch.setattr(threading.Thread, "start", refuse)
        thread.start()
        monkeypatch.undo()
        with pytest.raises(RuntimeError, match="can't start new thread"):
            await asyncio.wait_for(thread.done, 30)

    asyncio.run(go())
