"""The early farm (wsync.engine.prefarm, wsync.engine.linker): DEST's scan linked into the
tmp tree by a worker process while the diff runs, then brought to exactly the farm
build_farm makes; on real trees, and through real pulls."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import assert_exact, make_tree, options, run_pull
from incr_helpers import EarlyFarms, Rehashes
from wsync.engine import hostscan, linker, prefarm
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.excludes import Excludes
from wsync.engine.farm import build_farm
from wsync.engine.incphases import IncrementalRunner
from wsync.engine.incstate import PullState
from wsync.engine.prefarm import Prefarm
from wsync.engine.pull import pull
from wsync.errors import HostIOError
from wsync.transports.local import LocalTransport

_DIR = os.O_RDONLY | os.O_DIRECTORY


@pytest.fixture
def trees(tmp_path: Path) -> Iterator[tuple[Path, int, Path, int]]:
    dest, tmp = tmp_path / "dest", tmp_path / "tmp"
    dest.mkdir()
    tmp.mkdir()
    dfd, tfd = os.open(dest, _DIR), os.open(tmp, _DIR)
    yield dest, dfd, tmp, tfd
    os.close(dfd)
    os.close(tfd)


def scan(root: Path) -> list[hostscan.HostRow]:
    fd = os.open(root, _DIR)
    try:
        return list(hostscan.scan(fd))
    finally:
        os.close(fd)


def shape(root: Path) -> dict[bytes, tuple[str, int]]:
    """Each entry below ``root``: its kind and, for all but directories, its inode (a
    farm's directories are fresh; its other entries are DEST's very inodes)."""
    found: dict[bytes, tuple[str, int]] = {}
    for row in scan(root)[1:]:
        path, kind, mode = row[0], row[1], row[2]
        found[path] = (kind, stat.S_IMODE(mode) if kind == "d" else row[6])
    return found


def random_dest(root: Path, rng: random.Random) -> None:
    dirs = [root]
    for n in range(rng.randrange(20, 120)):
        parent = rng.choice(dirs)
        name = f"e{n}" + rng.choice(["", ".txt", "-x", " sp", "\udcff"])
        what = rng.random()
        path = parent / name
        if what < 0.3:
            path.mkdir()
            dirs.append(path)
        elif what < 0.4:
            path.symlink_to(rng.choice(["nowhere", "/etc/passwd", ".."]))
        elif what < 0.45:
            os.mkfifo(path)
        else:
            path.write_bytes(os.urandom(rng.randrange(0, 64)))


def random_keep(dest: Path, rng: random.Random) -> list[tuple[bytes, str]]:
    """A diff's keep list against ``dest``: some entries kept, some dropped (deleted or
    fetched), files turned into directories, directories dropped with their subtrees, and
    new directories; sorted by path, every parent a kept directory."""
    keep: dict[bytes, str] = {}
    for path, kind, *_ in sorted(scan(dest)[1:]):
        parent = path.rpartition(b"/")[0]
        if parent and keep.get(parent) != "d":
            continue  # its directory is gone from the new tree
        roll = rng.random()
        if roll < 0.7:
            keep[path] = kind  # kept as it is
        elif roll < 0.8:
            keep[path] = "d"  # another kind now: a directory where DEST has this entry
            if rng.random() < 0.5:
                keep[path + b"/new"] = "d"
        # else: deleted, or fetched by the select run (not in keep)
    for path in [p for p, k in keep.items() if k == "d"]:
        if rng.random() < 0.2:
            keep[path + b"/added"] = "d"
    keep.setdefault(b"brand-new", "d")
    return sorted(keep.items())


@pytest.mark.parametrize("seed", range(12))
def test_finish_makes_the_tree_build_farm_makes(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    dest = tmp_path / "dest"
    dest.mkdir()
    random_dest(dest, rng)
    keep = random_keep(dest, rng)
    rows = scan(dest)
    fresh, early = tmp_path / "fresh", tmp_path / "early"
    fresh.mkdir()
    early.mkdir()
    dfd, ffd, efd = os.open(dest, _DIR), os.open(fresh, _DIR), os.open(early, _DIR)
    try:
        build_farm(dfd, ffd, keep, lambda: None)
        farm = Prefarm()
        farm.build(rows, dfd, efd)
        assert farm.broken is None
        assert len(farm.made) == len(rows) - 1  # every entry but the root
        farm.finish(dfd, efd, keep, lambda: None)
    finally:
        for fd in (dfd, ffd, efd):
            os.close(fd)
    assert shape(early) == shape(fresh)
    assert set(shape(early)) == {path for path, _ in keep}


def test_entries_gone_since_the_scan_are_skipped(trees: tuple[Path, int, Path, int]) -> None:
    dest, dfd, tmp, tfd = trees
    (dest / "d").mkdir()
    (dest / "d" / "in").write_text("i")
    (dest / "f").write_text("f")
    (dest / "stays").write_text("s")
    rows = scan(dest)
    shutil.rmtree(dest / "d")
    (dest / "f").unlink()
    farm = Prefarm()
    farm.build(rows, dfd, tfd)
    assert farm.broken is None
    # directories are made in the tmp tree whatever DEST holds; what DEST lost is not linked
    assert farm.made == {b"d": True, b"stays": False}
    assert sorted(os.listdir(tmp)) == ["d", "stays"]
    assert os.listdir(tmp / "d") == []
    # the diff (of the same scan) keeps "f": DEST lost it during the pull, as in build_farm
    with pytest.raises(HostIOError, match="DEST changed during the pull"):
        farm.finish(dfd, tfd, [(b"f", "f"), (b"stays", "f")], lambda: None)


def test_a_directory_swapped_for_a_symlink_is_never_followed(
    trees: tuple[Path, int, Path, int],
) -> None:
    dest, dfd, tmp, tfd = trees
    (dest / "d").mkdir()
    (dest / "d" / "secret").write_text("mine")
    rows = scan(dest)
    outside = dest.parent / "outside"
    outside.mkdir()
    (outside / "secret").write_text("theirs")
    shutil.rmtree(dest / "d")
    (dest / "d").symlink_to(outside)
    farm = Prefarm()
    farm.build(rows, dfd, tfd)
    assert farm.broken is None
    assert not (tmp / "d" / "secret").exists()
    assert os.stat(outside / "secret").st_nlink == 1


def test_an_error_it_cannot_account_for_breaks_it(trees: tuple[Path, int, Path, int]) -> None:
    dest, dfd, tmp, tfd = trees
    (dest / "a").write_text("a")
    (dest / "b").write_text("b")
    (tmp / "a").write_text("in the way")
    farm = Prefarm()
    farm.build(scan(dest), dfd, tfd)
    assert farm.broken is not None and "a: File exists" in farm.broken
    prefarm.clear(tfd)
    assert os.listdir(tmp) == []


def test_a_stopped_farm_is_broken(trees: tuple[Path, int, Path, int]) -> None:
    dest, dfd, tmp, tfd = trees
    (dest / "a").write_text("a")
    farm = Prefarm()
    farm.stop()
    farm.build(scan(dest), dfd, tfd)
    assert farm.broken is not None and "stopped" in farm.broken
    assert os.listdir(tmp) == []


@pytest.mark.parametrize("python", ["", "/bin/false"])
def test_no_worker_process_breaks_it(
    trees: tuple[Path, int, Path, int], monkeypatch: pytest.MonkeyPatch, python: str
) -> None:
    dest, dfd, _, tfd = trees
    (dest / "a").write_text("a")
    monkeypatch.setattr(sys, "executable", python)
    farm = Prefarm()
    farm.build(scan(dest), dfd, tfd)
    assert farm.broken is not None and "worker process" in farm.broken


# -- through real pulls -------------------------------------------------------------


def go(ws: Path, dest: Path, opts: PullOptions) -> PullResult:
    result = run_pull(LocalTransport(), ws, dest, opts)
    assert result.ok, result.error
    return result


def leftovers(dest: Path) -> list[str]:
    return sorted(n for n in os.listdir(dest.parent) if ".wsync-" in n)


def change(ws: Path) -> None:
    (ws / "src" / "f1.txt").write_text("changed\n")
    (ws / "src" / "f2.txt").unlink()
    shutil.rmtree(ws / "src" / "deep")
    (ws / "src" / "f3.txt").unlink()
    (ws / "src" / "f3.txt").mkdir()
    (ws / "new" / "dir").mkdir(parents=True)
    (ws / "new" / "dir" / "file").write_text("new\n")


@pytest.fixture
def pulled(tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    """A workspace pulled once into DEST (the next pull has a baseline)."""
    ws, dest = tmp_path / "ws", tmp_path / "out"
    make_tree(ws, big=64 * 1024, small=30)
    opts = options(tmp_path)
    go(ws, dest, opts)
    return ws, dest, opts


def test_a_pull_with_changes_farms_early_and_is_exact(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    ws, dest, opts = pulled
    counted = EarlyFarms(monkeypatch)
    change(ws)
    result = go(ws, dest, opts)
    assert result.mode == "incremental" and result.changed_files > 0
    assert (counted.built, counted.finished) == (1, 1)
    assert_exact(ws, dest)
    assert leftovers(dest) == []
    # the same listing again: no early farm (nothing is likely to change), nothing left
    again = go(ws, dest, opts)
    assert again.changed_files == 0 and again.deleted_files == 0
    assert (counted.built, counted.finished) == (1, 1)
    assert_exact(ws, dest)
    assert leftovers(dest) == []


def test_an_unneeded_early_farm_goes_and_costs_the_next_pull_no_rehash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guest's listing changed, but only in what --exclude leaves out (a directory-only
    pattern is applied on the host, so the listing shows the change: see
    Excludes.guest_prune): nothing to do, and the early farm goes with its tmp tree.  Its
    links and unlinks moved the ctime of every file of DEST; they are recorded again, so
    the next pull re-hashes nothing.  (Found by review: it re-hashed all 51 files.)"""
    ws, dest = tmp_path / "ws", tmp_path / "out"
    make_tree(ws, big=64 * 1024, small=40)
    (ws / "cache").mkdir()
    (ws / "cache" / "c").write_text("1\n")
    opts = options(tmp_path, excludes=Excludes(["cache/"]))
    go(ws, dest, opts)
    (ws / "cache" / "c").write_text("2\n")  # the listing changes, nothing to do
    farms = EarlyFarms(monkeypatch)
    before = os.stat(dest)
    result = go(ws, dest, opts)
    assert result.changed_files == 0 and result.deleted_files == 0
    assert (farms.built, farms.finished) == (1, 0)
    assert leftovers(dest) == []
    assert os.stat(dest).st_ino == before.st_ino  # DEST was not replaced
    assert not (dest / "cache").exists()
    rehashes = Rehashes(monkeypatch)
    again = go(ws, dest, opts)
    assert again.changed_files == again.deleted_files == 0
    assert rehashes.count == 0
    assert farms.built == 1
    # and a host edit with the mtime put back is still seen (its ctime moved after)
    target = dest / "src" / "f1.txt"
    st = os.stat(target)
    with target.open("r+b") as f:
        f.write(b"X")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert go(ws, dest, opts).changed_files == 1
    assert target.read_bytes() == (ws / "src" / "f1.txt").read_bytes()


def test_a_state_without_the_listing_key_takes_the_no_op_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state an older wsync wrote (no ``listing`` key) and an unchanged guest: no early
    farm, which would be wasted.  (Found by review: two wasted farms after an upgrade.)"""
    ws, dest = tmp_path / "ws", tmp_path / "out"
    make_tree(ws, big=64 * 1024, small=10)
    opts = options(tmp_path)
    go(ws, dest, opts)
    go(ws, dest, opts)  # nothing to do: the no-op record
    with PullState.open(opts.state_dir, dest, "unused") as state:
        state.db.execute("DELETE FROM main.meta WHERE k = 'listing'")
        state.db.commit()
    farms = EarlyFarms(monkeypatch)
    assert go(ws, dest, opts).changed_files == 0
    assert farms.built == 0


def test_a_broken_early_farm_falls_back_to_a_fresh_one(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    ws, dest, opts = pulled
    counted = EarlyFarms(monkeypatch)
    monkeypatch.setattr(sys, "executable", "/bin/false")
    change(ws)
    result = go(ws, dest, opts)
    assert result.mode == "incremental"
    assert (counted.built, counted.finished) == (1, 0)
    assert_exact(ws, dest)
    assert leftovers(dest) == []


def test_the_worker_gets_no_secrets_from_our_environment(
    trees: tuple[Path, int, Path, int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A daemon's environment may hold tokens; the worker needs only to find Python."""
    dest, dfd, _, tfd = trees
    (dest / "a").write_text("a")
    seen = tmp_path / "seen-env"
    spy = tmp_path / "python"
    spy.write_text(f"#!/bin/sh\nenv > {seen}\nexit 3\n")
    spy.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(spy))
    monkeypatch.setenv("WSYNC_API_TOKEN", "s3cret-token-value")
    monkeypatch.setenv("PYTHONPATH", "/some/where")
    farm = Prefarm()
    farm.build(scan(dest), dfd, tfd)
    assert farm.broken is not None and "ended with 3" in farm.broken
    env = seen.read_text()
    assert "s3cret-token-value" not in env
    assert "PYTHONPATH=/some/where" in env


def test_a_pull_stopped_while_it_farms_early_leaves_nothing(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while the worker links (the diff done or not): DEST untouched, the tmp
    tree removed, the worker stopped."""
    ws, dest, opts = pulled
    entered, stopped = threading.Event(), threading.Event()
    build, stop = Prefarm.build, Prefarm.stop

    def slow_build(farm: Prefarm, *args: object) -> None:
        entered.set()
        stopped.wait(60)  # until drop_early_farm stops it
        build(farm, *args)  # type: ignore[arg-type]

    def stopping(farm: Prefarm) -> None:
        stopped.set()
        stop(farm)

    monkeypatch.setattr(Prefarm, "build", slow_build)
    monkeypatch.setattr(Prefarm, "stop", stopping)
    change(ws)
    before = os.stat(dest).st_ino

    async def go_and_cancel() -> None:
        task = asyncio.create_task(pull(LocalTransport(), str(ws), dest, opts))
        assert await asyncio.to_thread(entered.wait, 60)
        await asyncio.sleep(0.2)  # the diff may be done, or waiting
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go_and_cancel())
    assert stopped.is_set()
    assert os.stat(dest).st_ino == before
    assert leftovers(dest) == []
    assert go(ws, dest, opts).ok
    assert_exact(ws, dest)


def test_the_worker_stops_when_its_pull_is_gone(
    trees: tuple[Path, int, Path, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a kill -9 of the pull its worker would go on linking into a tree the next run
    is removing; it looks for its parent every 64 records and stops."""
    dest, dfd, tmp, tfd = trees
    for i in range(3000):
        (dest / f"f{i}").write_text("x")
    records = [b"n" + row[0] for row in scan(dest)[1:]]
    parents = iter([100, 100, 1])  # adopted by init after the second look
    monkeypatch.setattr(os, "getppid", lambda: next(parents, 1))
    with pytest.raises(OSError, match="the pull that started it is gone"):
        linker.link_all(records, dfd, tfd)
    assert len(os.listdir(tmp)) == 64


def test_a_kill_9_while_it_farms_early_then_a_rerun_is_exact(
    pulled: tuple[Path, Path, PullOptions],
) -> None:
    """The pull is killed once its early farm's tree appears beside DEST (or later, if the
    look comes late); its worker stops by itself, and the rerun removes the tree and
    finishes exactly."""
    ws, dest, opts = pulled
    for i in range(3000):
        (ws / "many" / f"d{i % 30}").mkdir(parents=True, exist_ok=True)
        (ws / "many" / f"d{i % 30}" / f"f{i}").write_text(f"{i}\n")
    go(ws, dest, opts)
    change(ws)
    command = [sys.executable, "-m", "wsync", "pull", f"local:{ws}", str(dest), "--no-progress",
               "--state-dir", str(opts.state_dir), "--staging-dir", str(opts.staging_root)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if any(".wsync-tmp-" in name for name in leftovers(dest)):
            break
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    rerun = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert_exact(ws, dest)
    assert leftovers(dest) == []


def test_the_diff_waits_for_the_early_farm_to_take_the_scan(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The diff hands DEST's scan rows to the state's tables and drops them; an early farm
    whose task runs late (a loaded loop) must still get them.  (Found in CI: on a small
    tree the diff could start before the farm's task first ran, and no farm was made.)"""
    ws, dest, opts = pulled
    late = IncrementalRunner._early_farm

    async def running_late(runner: IncrementalRunner, *args: object) -> tuple[str, int] | None:
        await asyncio.sleep(0.3)
        return await late(runner, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(IncrementalRunner, "_early_farm", running_late)
    farms = EarlyFarms(monkeypatch)
    change(ws)
    result = go(ws, dest, opts)
    assert result.mode == "incremental"
    assert (farms.built, farms.finished) == (1, 1)
    assert_exact(ws, dest)
