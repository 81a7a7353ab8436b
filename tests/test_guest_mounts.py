"""A workspace that spans filesystems (a volume, a bind mount or a tmpfs mounted inside it, a
btrfs subvolume): an inode number names a file only within its filesystem, so two files of
one number on two devices are two files, never one file's links.

Found by a review: the manifest listed inode numbers without devices, and an incremental
pull joined a file of the workspace's filesystem and one of a mount inside it that happened
to share an inode number into one hardlink group: the second took the first's bytes, exit 0,
and every later pull kept it so."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers import assert_exact, busybox_bin, options, run_pull, tool_dir
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.excludes import Excludes
from wsync.transports.base import Transport
from wsync.transports.local import LocalTransport

Guest = Callable[[], Transport]


def _mount_tmpfs(where: Path) -> None:
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "wsync-test", str(where)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"no tmpfs mount here: {done.stderr.decode(errors='replace').strip()}")


@pytest.fixture
def two_filesystems(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """A workspace on a tmpfs with another tmpfs mounted at ``m`` inside it, and a file of
    each that share an inode number: (workspace, the top file, the mounted one)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    outer = tmp_path / "outer"
    outer.mkdir()
    _mount_tmpfs(outer)
    mounts = [outer]
    try:
        ws = outer / "ws"
        (ws / "m").mkdir(parents=True)
        _mount_tmpfs(ws / "m")
        mounts.insert(0, ws / "m")
        top = {}
        for i in range(40):
            path = ws / f"top{i}.txt"
            path.write_text(f"top file {i}\n")
            top[path.stat().st_ino] = path
        pair = None
        for i in range(40):
            path = ws / "m" / f"mounted{i}.txt"
            path.write_text(f"mounted file {i}\n")
            ino = path.stat().st_ino
            if pair is None and ino in top:
                pair = (top[ino], path)
        if pair is None:
            pytest.skip("no two files of one inode number on the two filesystems")
        assert os.stat(pair[0]).st_dev != os.stat(pair[1]).st_dev
        yield ws, pair[0], pair[1]
    finally:
        for mount in mounts:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def _plain() -> Transport:
    return LocalTransport()


@pytest.fixture(params=["gnu-find", "busybox"])
def guest(request: pytest.FixtureRequest, tmp_path: Path) -> Guest:
    """The guest's tools: GNU find's ``-printf``, or busybox's find and stat."""
    if request.param == "gnu-find":
        return _plain
    path = busybox_bin(tmp_path / "bb")
    tool_dir(path, ("stat", "readlink"), target=shutil.which("busybox"))
    env = {"PATH": str(path), "HOME": str(tmp_path)}
    return lambda: LocalTransport(env=env)


def _pull(guest: Guest, ws: Path, dest: Path, opts: PullOptions) -> PullResult:
    result = run_pull(guest(), ws, dest, opts)
    assert result.ok, result.error
    assert_exact(ws, dest)
    return result


def test_files_of_one_inode_number_on_two_filesystems_stay_two_files(
    tmp_path: Path, two_filesystems: tuple[Path, Path, Path], guest: Guest
) -> None:
    ws, top, mounted = two_filesystems
    dest = tmp_path / "out"
    opts = options(tmp_path)
    assert _pull(guest, ws, dest, opts).mode == "full"
    for changed in (top, mounted):  # whichever of the two comes first by path, or second
        changed.write_text(changed.read_text() + "changed\n")
        result = _pull(guest, ws, dest, opts)  # exact: each keeps its own bytes
        assert result.mode == "incremental" and result.changed_files == 1
    for twin in (top, mounted):
        here = dest / twin.relative_to(ws)
        assert os.stat(here).st_nlink == 1
    assert _pull(guest, ws, dest, opts).changed_files == 0


def test_a_first_pull_that_selects_keeps_them_apart(
    tmp_path: Path, two_filesystems: tuple[Path, Path, Path], guest: Guest
) -> None:
    """An ``--exclude`` makes even the first pull a select run, joined by the manifest."""
    ws, _, _ = two_filesystems
    (ws / "skip.log").write_text("left out\n")
    dest = tmp_path / "out"
    opts = options(tmp_path, excludes=Excludes(("*.log",)))
    result = run_pull(guest(), ws, dest, opts)
    assert result.ok, result.error
    (ws / "skip.log").unlink()
    assert_exact(ws, dest)
