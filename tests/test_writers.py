"""The extractor's file-creating threads (wsync.engine.writers): errors come back in the
extractor's thread, in order; nothing runs after close; pending work stays bounded."""

from __future__ import annotations

import threading
import time

import pytest

from wsync.engine import writers
from wsync.engine.writers import Writers
from wsync.errors import HostileArchive


def test_results_come_back_in_order_in_the_callers_thread() -> None:
    w = Writers()
    seen: list[tuple[int, str]] = []
    try:
        for i in range(50):
            w.submit(
                lambda i=i: (time.sleep(0.001 * (i % 3)), i)[1],
                1,
                lambda r: seen.append((r, threading.current_thread().name)),
            )
        w.drain()
    finally:
        w.close()
    assert [r for r, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {threading.current_thread().name}


def test_the_first_error_is_raised_at_the_next_submit_or_drain() -> None:
    """And the jobs still queued when the extraction fails are never run."""
    w = Writers()
    release = threading.Event()
    ran: list[int] = []

    def fail() -> None:
        raise HostileArchive("the first")

    def later(i: int) -> None:
        release.wait(10)
        ran.append(i)

    try:
        with pytest.raises(HostileArchive, match="the first"):
            w.submit(fail, 1)
            for i in range(40):  # more than the threads: some are still queued at close
                w.submit(lambda i=i: later(i), 1)
            w.drain()
    finally:
        release.set()
        w.close()
    done = len(ran)
    time.sleep(0.2)
    assert len(ran) == done, "a job ran after close returned"
    assert done < 40


def test_close_waits_for_running_jobs() -> None:
    w = Writers()
    finished = threading.Event()

    def slow() -> None:
        time.sleep(0.3)
        finished.set()

    w.submit(slow, 1)
    time.sleep(0.05)  # it is running
    w.close()
    assert finished.is_set()


def test_pending_bytes_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writers, "MAX_PENDING_BYTES", 100)
    w = Writers()
    gate = threading.Event()
    in_flight = []
    try:
        for _ in range(3):
            w.submit(lambda: gate.wait(10), 60)
            in_flight.append(w._bytes)
            gate.set()
        w.drain()
    finally:
        w.close()
    assert max(in_flight) <= 100
