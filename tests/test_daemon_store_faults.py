"""The daemon's job store when it cannot be written: a full disk under the state directory.

A pull that ends while its record cannot be written is over all the same: the queue goes
on, the API keeps answering, and the record lands once the store takes writes again (an
independent review found the job left ``running`` in the store for good and the queue
behind it stalled)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_daemon_harness import DaemonProcess, base_config, make_tree, running


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
