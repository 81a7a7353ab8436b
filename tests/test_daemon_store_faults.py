"""The daemon's job store when it cannot be written: a full disk under the state directory.

A pull that ends while its record cannot be written is over all the same: the queue goes
on, the API keeps answering, and the record lands once the store takes writes again (an
independent review found the job left ``running`` in the store for good and the queue
behind it stalled)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from test_daemon_harness import DaemonProcess, base_config, make_tree, running
from wsync.daemon.config import load_config
from wsync.daemon.jobs import JobManager
from wsync.daemon.metrics import Metrics
from wsync.daemon.store import Job, JobStore, StoreUnavailable, new_job_id
from wsync.engine.api import ProgressCallback, PullOptions, PullResult
from wsync.errors import WsyncError


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (root only): the state directory's filesystem, to fill."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip("cannot mount a tmpfs (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> None:
    """Write ``path`` until its filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)


def test_a_pull_that_ends_on_a_full_disk_is_recorded_later_and_the_queue_goes_on(
    tmp_path: Path, small_fs: Path
) -> None:
    src = tmp_path / "src"
    make_tree(src)
    roots = tmp_path / "roots"
    roots.mkdir()
    config = f"""
state_dir = "{small_fs}/state"
engine_dir = "{tmp_path}/engine"
dest_roots = ["{roots}"]
[api]
listen = "127.0.0.1:0"
[limits]
max_concurrent = 1
chunk_size = 65536
min_free_bytes = 0
[sandboxes.slow]
uri = "local:{src}"
dest = "{roots}/slow"
chaos = "slow=0.5"
[sandboxes.fast]
uri = "local:{src}"
dest = "{roots}/fast"
"""
    home = tmp_path / "d"
    home.mkdir()
    daemon = DaemonProcess(home, config)
    daemon.state_dir = small_fs / "state"
    daemon.start()
    try:
        slow = daemon.pull("slow")
        daemon.wait_job(slow["id"], ("running",))
        fast = daemon.pull("fast")
        assert fast["state"] == "queued"
        filler = small_fs / "filler"
        fill(filler)  # something else fills the state directory's disk
        # the slow pull ends (DEST swapped) with its record refused, and the queued one runs
        daemon.wait_until(
            lambda: (roots / "fast" / "README.md").exists(), timeout=60, what="the queued pull"
        )
        assert (roots / "slow" / "README.md").exists()
        assert "job.save_failed" in daemon.log_path.read_text(encoding="utf-8")
        # the API tells the end the store has not taken yet
        assert daemon.job(slow["id"])["state"] == "succeeded"
        filler.unlink()  # space again: both records land in the store
        for job_id in (slow["id"], fast["id"]):
            assert daemon.wait_job(job_id, timeout=120)["exit_code"] == 0

        def stored() -> bool:
            with contextlib.closing(sqlite3.connect(daemon.state_dir / "jobs.db")) as db:
                states = db.execute("SELECT state FROM jobs").fetchall()
            return sorted(states) == [("succeeded",), ("succeeded",)]

        daemon.wait_until(stored, timeout=120, what="both records in the store")
    finally:
        daemon.close()


def test_a_write_lock_held_on_the_job_store_does_not_freeze_the_api(tmp_path: Path) -> None:
    """An operator's ``sqlite3`` shell holds a write transaction on jobs.db while a pull
    runs: each of the pull's saves waited 5 s for it on the event loop, and ``/healthz``
    went unanswered for as long as the lock lasted (found by an independent review).
    Now a write gives up after a quarter second; the job's end is recorded once the lock
    is gone."""
    src = tmp_path / "src"
    make_tree(src)
    (tmp_path / "roots").mkdir()
    extra = (
        f'[sandboxes.slow]\nuri = "local:{src}"\ndest = "{tmp_path}/roots/slow"\n'
        'chaos = "slow=0.3"\n'
    )
    with running(tmp_path, base_config(tmp_path, extra)) as daemon:
        job = daemon.pull("slow")
        daemon.wait_job(job["id"], ("running",))
        shell = sqlite3.connect(daemon.state_dir / "jobs.db", isolation_level=None)
        shell.execute("BEGIN IMMEDIATE")
        slowest = 0.0
        try:
            # until the pull is over (its DEST swapped) and a little more
            end = time.monotonic() + 120
            over = None
            while time.monotonic() < end and (over is None or time.monotonic() < over + 2):
                asked = time.monotonic()
                status, _ = daemon.request("GET", "/healthz", token=None, timeout=60)
                slowest = max(slowest, time.monotonic() - asked)
                assert status == 200
                if over is None and (tmp_path / "roots" / "slow" / "README.md").exists():
                    over = time.monotonic()
                time.sleep(0.1)
            assert over is not None, "the pull did not end"
        finally:
            shell.execute("ROLLBACK")
            shell.close()
        # a wait of 5 s a save stacks up to many; a quarter second a write stays far below
        assert slowest < 4.0, slowest
        assert daemon.wait_job(job["id"], timeout=120)["exit_code"] == 0


# -- in process: a JobManager on a real JobStore, an operator's shell holding its lock -----


class _Puller:
    """The engine's place in JobManager (its ``puller``): each pull waits for ``release``."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()

    async def __call__(
        self,
        uri: str,
        dest: Path,
        options: PullOptions,
        transport_options: Mapping[str, Any] | None,
        on_progress: ProgressCallback | None,
    ) -> PullResult:
        self.calls.append(dest.name)
        while not self.release.is_set():  # noqa: ASYNC110 - set from the test's thread
            await asyncio.sleep(0.01)
        return PullResult(ok=True, sandbox=uri, dest=str(dest))


def _manager(tmp_path: Path, puller: _Puller) -> tuple[JobManager, JobStore]:
    (tmp_path / "roots").mkdir()
    (tmp_path / "ws").mkdir()
    boxes = "".join(
        f'[sandboxes.{name}]\nuri = "local:{tmp_path}/ws"\ndest = "{tmp_path}/roots/{name}"\n'
        for name in ("box", "other")
    )
    path = tmp_path / "c.toml"
    path.write_text(
        f'state_dir = "{tmp_path}/state"\ndest_roots = ["{tmp_path}/roots"]\n'
        f"[limits]\nmax_concurrent = 1\n{boxes}",
        encoding="utf-8",
    )
    store = JobStore(tmp_path / "jobs.db")
    return JobManager(load_config(path), store, Metrics(), puller=puller), store


@contextlib.contextmanager
def _locked(tmp_path: Path) -> Iterator[None]:
    """An operator's ``sqlite3`` shell in a write transaction on jobs.db."""
    with contextlib.closing(sqlite3.connect(tmp_path / "jobs.db", isolation_level=None)) as db:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            db.execute("ROLLBACK")


async def _until(predicate: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _stored(tmp_path: Path, job_id: str) -> str:
    with contextlib.closing(sqlite3.connect(tmp_path / "jobs.db")) as db:
        return str(db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()[0])


def test_a_cancel_the_store_refuses_leaves_the_job_to_run(tmp_path: Path) -> None:
    """The queued job was taken off the queue before its cancelled record was refused:
    it stayed 'queued' in the store, never ran, and every later request for its DEST was
    merged into it (found by a review of the quarter-second lock wait)."""
    puller = _Puller()
    manager, store = _manager(tmp_path, puller)

    async def run() -> None:
        await manager.start()
        manager.submit("box", None)
        await _until(lambda: puller.calls == ["box"])
        queued, _ = manager.submit("other", None)
        with _locked(tmp_path), pytest.raises(WsyncError, match="locked"):
            manager.cancel(queued.id)
        puller.release.set()
        await _until(lambda: manager.get(queued.id).state == "succeeded")
        assert puller.calls == ["box", "other"]
        await manager.shutdown(5)

    try:
        asyncio.run(run())
    finally:
        store.close()


def test_a_new_request_is_not_merged_into_a_job_whose_end_is_unrecorded(tmp_path: Path) -> None:
    """A job over but still 'running' in the store (its end refused) held the dedupe index:
    a new request got it back, "reconciled", and no pull ran.  Now the request records that
    end first (or, while the store takes no writes, is refused: 503)."""
    puller = _Puller()
    manager, store = _manager(tmp_path, puller)

    async def run() -> None:
        await manager.start()
        first, _ = manager.submit("box", None)
        await _until(lambda: puller.calls == ["box"])
        with _locked(tmp_path):
            puller.release.set()
            await _until(lambda: manager.get(first.id).state == "succeeded")
            assert _stored(tmp_path, first.id) == "running"
            assert manager.list_jobs(states=["running"]) == []  # over: not listed as running
            with pytest.raises(StoreUnavailable):
                manager.submit("box", None)
        again, reconciled = manager.submit("box", None)
        assert not reconciled and again.id != first.id
        assert _stored(tmp_path, first.id) == "succeeded"
        await _until(lambda: manager.get(again.id).state == "succeeded")
        assert puller.calls == ["box", "box"]
        await manager.shutdown(5)

    try:
        asyncio.run(run())
    finally:
        store.close()


def test_a_refused_prune_after_the_insert_leaves_the_new_job_queued(tmp_path: Path) -> None:
    """submit() stores the job, then prunes old records: a lock taken in between made the
    prune fail and the stored job never reached the queue (stranded, holding its DEST)."""
    puller = _Puller()
    puller.release.set()
    manager, store = _manager(tmp_path, puller)
    insert = store.insert
    shell = sqlite3.connect(tmp_path / "jobs.db", isolation_level=None)

    def insert_then_lock(job: Job) -> None:
        insert(job)
        shell.execute("BEGIN IMMEDIATE")  # another writer, right after the insert

    async def run() -> None:
        await manager.start()
        store.insert = insert_then_lock  # type: ignore[method-assign]
        job, _ = manager.submit("box", None)
        store.insert = insert  # type: ignore[method-assign]
        shell.execute("ROLLBACK")
        await _until(lambda: manager.get(job.id).state == "succeeded")
        await manager.shutdown(5)

    try:
        asyncio.run(run())
    finally:
        shell.close()
        store.close()


def test_a_shutdown_records_what_the_store_refused_before(tmp_path: Path) -> None:
    """The last try at shutdown removed a record it had just written a second time: a
    KeyError, and the daemon's stop crashed (exit 1, daemon.json and socket left)."""
    puller = _Puller()
    manager, store = _manager(tmp_path, puller)

    async def run() -> str:
        await manager.start()
        job, _ = manager.submit("box", None)
        await _until(lambda: puller.calls == ["box"])
        with _locked(tmp_path):
            puller.release.set()
            await _until(lambda: manager.get(job.id).state == "succeeded")
        await manager.shutdown(5)  # before the first resave (1 s): its last try lands it
        return job.id

    try:
        job_id = asyncio.run(run())
    finally:
        store.close()
    assert _stored(tmp_path, job_id) == "succeeded"


def test_a_lock_held_at_start_does_not_stop_the_daemon(tmp_path: Path) -> None:
    """A job 'running' when the last daemon died is queued again at start; a refused
    record of that used to end the start (the job runs all the same now)."""
    puller = _Puller()
    puller.release.set()
    manager, store = _manager(tmp_path, puller)
    dest = str(tmp_path / "roots" / "box")
    job = Job(new_job_id(), "box", f"local:{tmp_path}/ws", dest, state="running")
    store.insert(job)

    async def run() -> None:
        with _locked(tmp_path):
            assert await manager.start() == 1
        await _until(lambda: manager.get(job.id).state == "succeeded")
        await manager.shutdown(5)

    try:
        asyncio.run(run())
    finally:
        store.close()
