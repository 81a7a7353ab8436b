"""The daemon's job store when it cannot be written: a full disk under the state directory.

A pull that ends while its record cannot be written is over all the same: the queue goes
on, the API keeps answering, and the record lands once the store takes writes again (an
independent review found the job left ``running`` in the store for good and the queue
behind it stalled)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_daemon_harness import DaemonProcess, make_tree


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
        assert "job.save_failed" in daemon.log()
        filler.unlink()  # space again: both records land
        for job_id in (slow["id"], fast["id"]):
            assert daemon.wait_job(job_id, timeout=120)["exit_code"] == 0
        assert "job.saved" in daemon.log()
    finally:
        daemon.close()
