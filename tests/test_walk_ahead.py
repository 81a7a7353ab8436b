"""The previous tree's walk taken ahead (``--keep-prev``): while the manifest loads and the
diff runs, a worker thread walks the kept tree, and the reuse takes those rows instead of
walking it again, but only for the very tree it renamed into place.  Whatever happens to the
tree between the walk and the reuse, DEST ends exact."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from helpers import run_pull
from prevtree_helpers import (
    assert_shares_only,
    cancel_once,
    change,
    prev_of,
    pull,
    pulled_twice,
    tmp_trees,
)
from wsync.engine import prevtree
from wsync.engine.api import PullOptions
from wsync.engine.incphases import IncrementalRunner
from wsync.engine.incstate import PullState
from wsync.errors import Fenced
from wsync.transports.local import LocalTransport


@pytest.fixture
def pulled(tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    return pulled_twice(tmp_path)


class Walks:
    """Every walk of a tree (:func:`prevtree.walk`) and every walk ahead, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[str] = []
        self.ahead: list[prevtree.Walked | None] = []
        self.started = threading.Event()
        walk, ahead = prevtree.walk, prevtree.walk_ahead

        def counted_walk(
            root_fd: int,
            check: Callable[[], None],
            listed: dict[bytes, tuple[int, int]] | None = None,
        ) -> Any:
            self.events.append("walk")
            self.started.set()
            return walk(root_fd, check, listed)

        def counted_ahead(
            parent_fd: int,
            names: Iterable[str],
            check: Callable[[], None],
            limit: int,
            since: int,
            dest_name: str,
        ) -> prevtree.Walked | None:
            got = ahead(parent_fd, names, check, limit, since, dest_name)
            self.ahead.append(got)
            self.after_ahead()
            return got

        monkeypatch.setattr(prevtree, "walk", counted_walk)
        monkeypatch.setattr(prevtree, "walk_ahead", counted_ahead)

    def after_ahead(self) -> None:
        """What a test does to the kept tree once the walk ahead is over."""


def test_the_kept_tree_is_walked_while_the_diff_runs_and_only_then(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    ws, dest, opts = pulled
    walks = Walks(monkeypatch)
    diff = PullState.diff

    def diff_after_the_walk_began(self: PullState, *args: Any, **kwargs: Any) -> Any:
        # the walk starts once the manifest's bytes are in, before the diff: a walk
        # that only starts within the reuse never sets this
        walks.started.wait(15)
        walks.events.append("diff")
        return diff(self, *args, **kwargs)

    monkeypatch.setattr(PullState, "diff", diff_after_the_walk_began)
    kept = os.stat(prev_of(dest)).st_ino
    change(ws, 2)
    result = pull(ws, dest, opts)
    assert result.mode == "incremental" and result.changed_files > 0
    assert walks.events == ["walk", "diff"]  # the reuse did not walk the tree again
    [walked] = walks.ahead
    assert walked is not None and len(walked.rows) > 10
    assert os.stat(dest).st_ino == kept  # the kept tree became DEST
    assert_shares_only(dest)


def test_a_tree_swapped_in_after_the_walk_is_walked_again(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the walk ahead is over, the kept tree is replaced by a copy of it (every file
    a lookalike of another inode) plus a planted file.  The reuse must not take the rows of
    the walked tree for the one it renamed into place: else it keeps the lookalikes as if
    they were DEST's inodes, and the planted file (no row of the walk names it) reaches
    DEST."""
    ws, dest, opts = pulled
    prev = prev_of(dest)
    walks = Walks(monkeypatch)

    def swap_tree() -> None:
        other = prev.parent / "other"
        shutil.copytree(prev, other, symlinks=True)
        (other / "planted.txt").write_text("not the guest's\n")
        shutil.rmtree(prev)
        other.rename(prev)

    walks.after_ahead = swap_tree  # type: ignore[method-assign]
    change(ws, 2)
    pull(ws, dest, opts)  # exact: no planted.txt
    assert walks.ahead and walks.ahead[0] is not None
    assert walks.events == ["walk", "walk"]  # ahead, then the reuse's own
    assert_shares_only(dest)


def test_an_entry_put_in_the_kept_tree_after_the_walk_never_reaches_dest(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a process of this user whose working directory was in the
    replaced tree (now the kept one) writes a file there after the walk; no row of the
    walk names it, so the reuse neither judged nor removed it, and it reached DEST with the
    swap.  The directory's ctime moved: the reuse walks again."""
    ws, dest, opts = pulled
    walks = Walks(monkeypatch)

    def editor_saves() -> None:
        (prev_of(dest) / "src" / "editor.swp").write_text("autosave\n")

    walks.after_ahead = editor_saves  # type: ignore[method-assign]
    change(ws, 2)
    pull(ws, dest, opts)  # exact: no src/editor.swp
    assert walks.ahead and walks.ahead[0] is not None
    assert walks.events == ["walk", "walk"]


def test_an_entry_put_there_with_the_directorys_mtime_put_back_is_seen_too(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: ``tar x``, ``cp -a`` and ``rsync -a`` put a directory's mtime
    back after they fill it; the directory's ctime still tells."""
    ws, dest, opts = pulled
    walks = Walks(monkeypatch)

    def restore_into() -> None:
        src = prev_of(dest) / "src"
        st = src.stat()
        (src / "planted.txt").write_text("copied in\n")
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))

    walks.after_ahead = restore_into  # type: ignore[method-assign]
    change(ws, 2)
    pull(ws, dest, opts)  # exact: no src/planted.txt
    assert walks.events == ["walk", "walk"]


def test_a_directory_of_a_future_mtime_does_not_cost_the_walk_ahead(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept directories carry the guest's mtimes, one of them ahead of the host's clock
    (a guest clock ahead): that is no change made while the walk ran, and the reuse still
    takes the walk's rows (a review found every such pull walking twice)."""
    ws, dest, opts = pulled
    hour = 3600 * 10**9
    future = time.time_ns() + hour
    os.utime(ws / "src" / "deep", ns=(future, future))
    change(ws, 2)
    pull(ws, dest, opts)  # the kept tree now holds it too
    os.utime(ws / "src" / "deep", ns=(future, future))
    walks = Walks(monkeypatch)
    change(ws, 3)
    pull(ws, dest, opts)
    assert walks.events == ["walk"]


def test_a_failed_pull_leaves_the_walked_tree_to_the_next_one(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    ws, dest, opts = pulled
    walks = Walks(monkeypatch)
    kept = os.stat(prev_of(dest)).st_ino
    change(ws, 2)

    def lapsed() -> None:
        raise Fenced("lease lost")

    with pytest.raises(Fenced):
        run_pull(LocalTransport(), ws, dest, dataclasses.replace(opts, fence=lapsed))
    assert walks.ahead and walks.ahead[0] is not None
    [tmp] = tmp_trees(dest)
    assert os.stat(tmp).st_ino == kept
    result = pull(ws, dest, opts)
    assert result.mode == "incremental"
    assert os.stat(dest).st_ino == kept
    assert_shares_only(dest)


def test_a_pull_with_nothing_to_fetch_walks_nothing_ahead(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk goes ahead only when the guest lists something else than last time: an
    unchanged workspace leaves the kept tree alone."""
    ws, dest, opts = pulled
    walks = Walks(monkeypatch)
    before = os.stat(prev_of(dest)).st_mtime_ns
    assert pull(ws, dest, opts).changed_files == 0
    assert walks.ahead == [] and walks.events == []
    assert os.stat(prev_of(dest)).st_mtime_ns == before


#: a stamp for walks whose rows alone are looked at
NOW = time.time_ns()


def _tree(root: Path, files: int) -> None:
    (root / "sub").mkdir(parents=True)
    for i in range(files):
        (root / "sub" / f"f{i}").write_text(f"{i}\n")


def test_walk_ahead_takes_the_first_tree_and_stops_at_its_limit(tmp_path: Path) -> None:
    _tree(tmp_path / "first", 3)
    _tree(tmp_path / "second", 1)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = prevtree.walk_ahead(fd, ["missing", "first", "second"], lambda: None, 10, NOW, "out")
        assert got is not None
        assert sorted(path for path, *_ in got.rows) == [
            b"sub",
            b"sub/f0",
            b"sub/f1",
            b"sub/f2",
        ]
        st = os.stat(tmp_path / "first")
        assert got.root == (st.st_dev, st.st_ino)
        assert st.st_mode & 0o777 == 0o700  # made private before it was walked
        # more entries than it may hold in memory: the reuse walks it itself
        assert prevtree.walk_ahead(fd, ["first"], lambda: None, 3, NOW, "out") is None
        assert prevtree.walk_ahead(fd, ["first"], lambda: None, 4, NOW, "out") is not None
    finally:
        os.close(fd)


def test_walk_ahead_follows_no_symlink_and_takes_no_tree_of_another_user(
    tmp_path: Path,
) -> None:
    elsewhere = tmp_path / "elsewhere"
    _tree(elsewhere, 2)
    (tmp_path / "link").symlink_to(elsewhere)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert prevtree.walk_ahead(fd, ["link"], lambda: None, 10, NOW, "out") is None
        assert os.stat(elsewhere).st_mode & 0o777 != 0o700 or os.geteuid() != 0
        if os.geteuid() == 0:
            os.chown(elsewhere, 65534, 65534)
            assert prevtree.walk_ahead(fd, ["elsewhere"], lambda: None, 10, NOW, "out") is None
    finally:
        os.close(fd)


def test_a_stopped_walk_ahead_raises_out_of_its_thread(tmp_path: Path) -> None:
    """Stopped (its pull gave up), the walk raises what the check raises, not a walk of
    part of the tree that the reuse could take for the whole."""
    _tree(tmp_path / "kept", 600)

    class Stop(Exception):
        pass

    def stop() -> None:
        raise Stop

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(Stop):
            prevtree.walk_ahead(fd, ["kept"], stop, 10**6, NOW, "out")
    finally:
        os.close(fd)
    assert len(os.listdir(tmp_path / "kept" / "sub")) == 600


def test_a_pull_stopped_while_it_waits_for_the_walk_stops_the_walk(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a pull cancelled (a daemon's stop) while it waited for the walk
    forgot the walk first, and the failure path never stopped it: the thread went on
    walking and chmod'ing the kept tree after the pull had returned and let DEST go."""
    ws, dest, opts = pulled
    waiting = threading.Event()
    finished = threading.Event()
    ahead = prevtree.walk_ahead
    take_walk = IncrementalRunner.take_walk

    def slow_ahead(
        parent_fd: int,
        names: Iterable[str],
        check: Callable[[], None],
        limit: int,
        since: int,
        dest_name: str,
    ) -> prevtree.Walked | None:
        try:
            for _ in range(1500):  # 30 s unless stopped
                check()
                time.sleep(0.02)
            return ahead(parent_fd, names, check, limit, since, dest_name)
        finally:
            finished.set()

    async def waited(self: IncrementalRunner) -> None:
        waiting.set()
        await take_walk(self)

    monkeypatch.setattr(prevtree, "walk_ahead", slow_ahead)
    monkeypatch.setattr(IncrementalRunner, "take_walk", waited)
    change(ws, 2)
    cancel_once(ws, dest, opts, lambda: asyncio.to_thread(waiting.wait, 60))
    assert waiting.is_set()
    assert finished.is_set(), "the walk was still at work after the pull returned"
    monkeypatch.undo()
    pull(ws, dest, opts)
    assert_shares_only(dest)
