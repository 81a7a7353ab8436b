"""The extractor's file-creating threads (wsync.engine.writers): errors come back in the
extractor's thread, in order; nothing runs after close; pending work stays bounded."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from extract_helpers import LIMITS, build, extract, make_root, member
from wsync.engine import extract as extract_mod
from wsync.engine import writers
from wsync.engine.extract import extract_tar_stream
from wsync.engine.writers import Writers
from wsync.errors import HostileArchive, HostIOError

CHR = tarfile.CHRTYPE


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


# ------------------------------------------------- the extractor's use of the writers


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("how", ["refused-member", "duplicate"])
def test_a_failed_extraction_leaves_no_descriptor_open(tmp_path: Path, how: str) -> None:
    """A job holds a dup of its directory's fd until it runs: the jobs that never run (cancelled
    at close, or submitted after an earlier job failed) release theirs.  The daemon runs
    pulls in its own process, so a guest must not leak its fds a failed pull at a time."""
    files = [member(f"d/f{i}", data=b"x") for i in range(200)]
    if how == "refused-member":
        archive = build(member("d", tarfile.DIRTYPE, mode=0o755), *files, member("dev", CHR))
    else:  # the duplicate's error comes back at a later submit
        archive = build(
            member("d", tarfile.DIRTYPE, mode=0o755),
            member("d/a", data=b"1"),
            member("d/a", data=b"2"),
            *files,
        )
    before = _open_fds()
    for n in range(5):
        (tmp_path / str(n)).mkdir()
        with pytest.raises(HostileArchive):
            extract(archive, make_root(tmp_path / str(n)))
    assert _open_fds() == before


def test_an_earlier_members_error_is_the_one_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small file the host fails to write (a full disk, a quota), then a member the
    extractor refuses itself: the host's error is the pull's, not the guest's refusal that
    came after it (exit 8, not 7)."""
    real = extract_mod.create_file

    def full_disk(dir_fd: int, leaf: bytes, name: bytes, *args: object) -> object:
        if leaf == b"big":
            raise HostIOError("host write failed: 'big': No space left on device")
        return real(dir_fd, leaf, name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(extract_mod, "create_file", full_disk)
    root = make_root(tmp_path)
    with pytest.raises(HostIOError, match="No space left") as failed:
        extract(build(member("big", data=b"x" * 100), member("dev", CHR)), root)
    assert failed.value.exit_code == 8
    with pytest.raises(HostIOError, match="No space left"):
        extract(build(member("big", data=b"x"), *[member(f"f{i}") for i in range(3)]), root)


_STUCK_WRITER = """
import io, sys, threading, time
import wsync.engine.extract as ex
from wsync.engine.api import ExtractLimits

def stuck(*args):
    threading.Event().wait(600)  # a create the kernel does not finish (a hung NFS DEST)

ex.create_file = stuck
data = open(sys.argv[1], "rb").read()
run = lambda: ex.extract_tar_stream(io.BytesIO(data), sys.argv[2], ExtractLimits(min_free_bytes=0))
threading.Thread(target=run, daemon=True).start()
time.sleep(0.5)
print("gave up", flush=True)
"""


def test_a_stuck_writer_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    """The pull gives up on a stuck extractor thread after a bound (it is a daemon thread);
    a writer thread stuck in a create must not then hold the process at exit."""
    archive = tmp_path / "a.tar"
    archive.write_bytes(build(member("f", data=b"x")))
    root = make_root(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _STUCK_WRITER, str(archive), str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "gave up\n"


def test_a_link_read_again_over_its_own_inode_leaves_no_fresh_name(tmp_path: Path) -> None:
    """rename(2) between two links of one inode does nothing and succeeds: the fresh name a
    later archive's member was written under must still go (two archives, and a farm)."""
    first = build(member("f", data=b"x"), member("g", tarfile.LNKTYPE, link="f"))
    again = build(member("g", tarfile.LNKTYPE, link="f"))
    (tmp_path / "stream").mkdir()
    (tmp_path / "farm").mkdir()
    root = make_root(tmp_path / "stream")
    extract(first + again, root)
    assert sorted(os.listdir(root)) == ["f", "g"]
    farm = make_root(tmp_path / "farm")
    (farm / "f").write_text("x")
    os.link(farm / "f", farm / "g")
    extract_tar_stream(io.BufferedReader(io.BytesIO(again)), farm, LIMITS, replace=True)  # type: ignore[arg-type]
    assert sorted(os.listdir(farm)) == ["f", "g"]
    assert (farm / "f").stat().st_ino == (farm / "g").stat().st_ino


def test_of_two_failing_files_the_first_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's error, raised at a later submit or at the drain, is the first: the jobs
    still pending came after it, and their errors are not reported in its place."""
    real = extract_mod.create_file

    def failing(dir_fd: int, leaf: bytes, name: bytes, *args: object) -> object:
        if leaf in (b"a", b"b"):
            raise HostIOError(f"{leaf.decode()!r}: No space left on device")
        return real(dir_fd, leaf, name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(extract_mod, "create_file", failing)
    archive = build(member("a", data=b"1"), member("b", data=b"2"), member("c", data=b"3"))
    for n in range(20):  # wherever a's error comes back, b's is never reported instead
        (tmp_path / str(n)).mkdir()
        with pytest.raises(HostIOError, match="'a'"):
            extract(archive, make_root(tmp_path / str(n)))


_STUCK_JOURNAL_WRITE = """
import threading
from wsync.engine.winddown import WriterPool

pool = WriterPool(2, "wsync-journal")
pool.submit(threading.Event().wait, 600)  # a write the kernel does not finish
pool.shutdown(wait=False, cancel_futures=True)  # the wind-down's, then it gives up
print("gave up", flush=True)
"""


def test_a_stuck_journal_write_does_not_keep_the_process_alive() -> None:
    """The journal's writer pool is daemon threads too: after the wind-down gave up on a
    write (a hung state directory), the process still ends."""
    done = subprocess.run(
        [sys.executable, "-c", _STUCK_JOURNAL_WRITE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "gave up\n"


def test_the_pool_runs_hands_back_and_cancels() -> None:
    from wsync.engine.winddown import WriterPool

    pool = WriterPool(2, "wsync-test")
    gate = threading.Event()
    blocked = [pool.submit(gate.wait, 10) for _ in range(2)]
    queued = pool.submit(lambda: 1)
    failing = pool.submit(int, "x")
    assert len(pool.pending) == 4
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled() and failing.cancelled()
    with pytest.raises(RuntimeError):
        pool.submit(lambda: 2)
    gate.set()
    assert [f.result(10) for f in blocked] == [True, True]
    assert pool.pending == set()
    pool = WriterPool(1, "wsync-test")
    with pytest.raises(ValueError):
        pool.submit(int, "x").result(10)
    assert pool.submit(int, "7").result(10) == 7
    pool.shutdown(wait=True)
