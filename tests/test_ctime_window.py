"""The commit's ctime window (:meth:`wsync.engine.incstate.PullState.window`): an incremental
pull records the entries it kept from the diff's scan and closes a window over its own links
and unlinks instead of scanning DEST again after removing the old tree.  What must hold:
the next pull re-hashes nothing it kept, and an edit made after the pull, even one that
puts the size and mtime back, is still seen and repaired; a window left open (a kill before
the old tree was gone) or written under another listing hides nothing; a ``--keep-prev``
pull that reused and kept its tree (it moved no ctime of what it kept) opens none, so it
still sees an edit made during it."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import sqlite3
import stat as stat_module
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from helpers import assert_exact, diff, make_tree, options, run_pull
from incr_helpers import Rehashes
from wsync.engine import hostscan, prevtree
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.destdir import DestDir
from wsync.engine.excludes import Excludes
from wsync.engine.guest import GuestSession
from wsync.engine.incremental import Incremental
from wsync.engine.incstate import NO_WINDOW, PullState, state_path
from wsync.transports.local import LocalTransport


def pull(ws: Path, dest: Path, opts: PullOptions) -> PullResult:
    result = run_pull(LocalTransport(), ws, dest, opts)
    assert result.ok, result.error
    assert_exact(ws, dest)
    return result


def window(dest: Path, opts: PullOptions) -> tuple[int, int]:
    with PullState.open(opts.state_dir, dest, "") as state:
        return state.window()


def edit_in_place(path: Path) -> None:
    """Rewrite ``path`` with other bytes of the same size and put its mtime back: only
    its ctime tells (what ``touch -r`` after an edit leaves)."""
    st = path.stat()
    data = path.read_bytes()
    path.write_bytes(bytes(b ^ 0x20 for b in data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size


def after(hi: int) -> None:
    """Wait until the kernel's coarse clock, which stamps ctimes, is past ``hi``."""
    while time.time_ns() < hi + 50_000_000:
        time.sleep(0.01)


def next_pull_rehashes_nothing(
    ws: Path, dest: Path, opts: PullOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change, and a pull that re-hashes nothing the last one kept."""
    rehashes = Rehashes(monkeypatch)
    (ws / "src" / "f3.txt").write_text("changed thrice\n")
    assert pull(ws, dest, opts).changed_files == 1
    assert rehashes.count == 0


@pytest.fixture(params=[False, True], ids=["default", "keep-prev"])
def pulled(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    """A workspace pulled whole, then incrementally after a change."""
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=30)
    dest = tmp_path / "out"
    opts = options(tmp_path, keep_prev=request.param)
    assert pull(ws, dest, opts).mode == "full"
    (ws / "src" / "f1.txt").write_text("changed once\n")
    assert pull(ws, dest, opts).mode == "incremental"
    return ws, dest, opts


def test_an_incremental_pull_scans_dest_once(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit lstats what the pull made; it does not walk DEST again after the old
    tree's removal (which took as long again on a large tree)."""
    ws, dest, opts = pulled
    scans = 0  # (with --keep-prev this pull reuses the tree the last one kept)
    real = hostscan.scan

    def counted(dest_fd: int) -> object:
        nonlocal scans
        scans += 1
        return real(dest_fd)

    monkeypatch.setattr(hostscan, "scan", counted)
    (ws / "src" / "f2.txt").write_text("changed twice\n")
    assert pull(ws, dest, opts).changed_files == 1
    assert scans == 1
    lo, hi = window(dest, opts)
    if opts.keep_prev:
        assert (lo, hi) == NO_WINDOW
    else:
        assert lo < hi <= time.time_ns()


def test_what_a_pull_kept_is_not_rehashed_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=30)
    dest = tmp_path / "out"
    opts = options(tmp_path)
    pull(ws, dest, opts)
    (ws / "src" / "f2.txt").write_text("changed twice\n")
    pull(ws, dest, opts)
    next_pull_rehashes_nothing(ws, dest, opts, monkeypatch)
    result = pull(ws, dest, opts)
    assert result.changed_files == 0 and result.files == 0


def test_an_edit_after_the_pull_with_size_and_mtime_put_back_is_repaired(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    ws, dest, opts = pulled
    after(window(dest, opts)[1])
    edit_in_place(dest / "src" / "f5.txt")  # kept by the last pull
    edit_in_place(dest / "src" / "f1.txt")  # fetched by it
    rehashes = Rehashes(monkeypatch)
    result = pull(ws, dest, opts)  # asserts DEST exact
    assert result.changed_files == 2
    assert rehashes.count == 2


def test_a_window_left_open_hides_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after the commit, before the old tree was gone: the window stays open and
    counts as none, so every moved ctime is re-hashed, and an edit made at once (its
    ctime inside what the window would have been) is repaired."""
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=30)
    dest = tmp_path / "out"
    opts = options(tmp_path)
    pull(ws, dest, opts)
    monkeypatch.setattr(Incremental, "close_window", lambda self: None)
    (ws / "src" / "f2.txt").write_text("changed twice\n")
    pull(ws, dest, opts)
    monkeypatch.undo()
    assert window(dest, opts) == NO_WINDOW
    edit_in_place(dest / "src" / "f5.txt")
    rehashes = Rehashes(monkeypatch)
    result = pull(ws, dest, opts)
    assert result.changed_files == 1
    assert rehashes.count > 1  # every file the killed pull kept
    rehashes.count = 0
    assert pull(ws, dest, opts).changed_files == 0
    assert rehashes.count == 0


def test_a_window_of_another_commit_hides_nothing(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older wsync (a rolled-back install) commits without a window and leaves the
    key as it was: its listing is another one, and the window no longer counts."""
    ws, dest, opts = pulled
    db = sqlite3.connect(state_path(opts.state_dir, dest))
    with db:
        db.execute("UPDATE meta SET v = 'xxh128:zstdl:1:other' WHERE k = 'listing'")
    db.close()
    assert window(dest, opts) == NO_WINDOW
    (ws / "src" / "f2.txt").write_text("changed twice\n")
    rehashes = Rehashes(monkeypatch)
    pull(ws, dest, opts)
    assert rehashes.count > 1


def test_an_edit_during_a_pull_that_reuses_its_kept_tree_is_seen_next_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--keep-prev``: the reused tree's kept entries are DEST's inodes, never linked
    anew, so their ctimes move only by someone else's hand; no window is opened, and an
    edit made while the pull ran, with the size and mtime put back, is repaired by the
    next pull."""
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=30)
    dest = tmp_path / "out"
    opts = options(tmp_path, keep_prev=True)
    pull(ws, dest, opts)
    for round_no in (1, 2):  # the second reuses the tree the first kept
        (ws / "src" / f"f{round_no}.txt").write_text(f"round {round_no}\n")
        pull(ws, dest, opts)
    reuse = prevtree.reuse

    def edit_then_reuse(*args: object, **kw: object) -> tuple[int, int]:
        edit_in_place(dest / "src" / "f5.txt")
        return reuse(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(prevtree, "reuse", edit_then_reuse)
    (ws / "src" / "f3.txt").write_text("round 3\n")
    result = run_pull(LocalTransport(), ws, dest, opts)
    assert result.ok, result.error
    monkeypatch.undo()
    assert (dest / "src" / "f5.txt").read_bytes() != (ws / "src" / "f5.txt").read_bytes()
    assert window(dest, opts) == NO_WINDOW
    assert pull(ws, dest, opts).changed_files == 1  # and DEST is exact again


def slow_removal(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The old tree's removal takes ``seconds`` more (a large tree), then ends early in a
    second of the wall clock (so that an edit right after the pull shares its second)."""
    real = DestDir.removal

    def slowly(self: DestDir, name: str) -> Callable[[], None]:
        run = real(self, name)

        def go() -> None:
            run()
            time.sleep(seconds)
            while time.time() % 1 > 0.2:
                time.sleep(0.01)

        return go

    monkeypatch.setattr(DestDir, "removal", slowly)


def test_the_window_is_dests_clock_not_the_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DEST on a file server whose clock is behind the host's (NFS, SMB: the server
    stamps ctimes): here the host's clock runs a second ahead.  An edit half a second after
    the pull, size and mtime put back, is repaired.  (Found by review: the window was the
    host's clock, and hid it.)"""
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=30)
    dest = tmp_path / "out"
    opts = options(tmp_path)
    pull(ws, dest, opts)
    real_ns = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real_ns() + 1_000_000_000)
    slow_removal(monkeypatch, 1.0)
    (ws / "src" / "f1.txt").write_text("changed once\n")
    pull(ws, dest, opts)
    monkeypatch.undo()
    time.sleep(0.5)
    edit_in_place(dest / "src" / "f5.txt")
    pull(ws, dest, opts)  # asserts DEST exact


@pytest.fixture
def coarse_fs(tmp_path: Path) -> Iterator[Path]:
    """A filesystem that stamps times in whole seconds (ext4 with 128-byte inodes, as
    mke2fs makes small ones), loop-mounted; skipped where that cannot be done."""
    image, mount = tmp_path / "coarse.img", tmp_path / "coarse"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("a loop-mounted filesystem needs root and mkfs.ext4")
    with image.open("wb") as f:
        f.truncate(1024 * 1024 * 1024)  # sparse; above the 256 MiB free-space reserve
    made = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-I", "128", str(image)], capture_output=True, check=False
    )
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4: {made.stderr.decode(errors='replace').strip()}")
    mounted = subprocess.run(
        ["mount", "-o", "loop", str(image), str(mount)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"no loop mount here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        probe = mount / "probe"
        probe.write_text("x")
        if probe.stat().st_ctime_ns % 1_000_000_000:
            pytest.skip("this ext4 stamps finer than seconds")
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def test_an_edit_in_the_pulls_last_second_on_a_filesystem_of_whole_seconds(
    tmp_path: Path, coarse_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ctime of such a filesystem is a whole second: an edit right after the pull
    (size and mtime put back) shares its second with the pull's last unlinks, and is still
    repaired (the window ends before that second, whose entries are re-hashed once).
    (Found by review: the window ended at the host's time, and hid it.)"""
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=30)
    dest = coarse_fs / "out"
    opts = options(tmp_path)
    pull(ws, dest, opts)
    slow_removal(monkeypatch, 1.0)
    (ws / "src" / "f1.txt").write_text("changed once\n")
    pull(ws, dest, opts)
    monkeypatch.undo()
    edit_in_place(dest / "src" / "f5.txt")  # kept by the pull
    edit_in_place(dest / "src" / "f1.txt")  # fetched by it
    pull(ws, dest, opts)  # asserts DEST exact
    # a pull that begins and ends within one second waits for the next one to close its
    # window: the pull after it re-hashes nothing it kept
    (ws / "src" / "f2.txt").write_text("changed twice\n")
    time.sleep(1.01 - time.time() % 1)  # begins as a second begins, ends within it
    pull(ws, dest, opts)
    next_pull_rehashes_nothing(ws, dest, opts, monkeypatch)


@pytest.mark.parametrize("how", ["re-hash", "wasted farm"])
def test_an_edit_right_after_a_pull_that_did_not_commit_on_whole_seconds(
    tmp_path: Path, coarse_fs: Path, how: str
) -> None:
    """Found by a red-team review: a pull that commits nothing still records ctimes of
    DEST as it scanned them (a re-hash's verdict with the no-op record; a refresh after
    an early farm it did not need, whose links moved every ctime) but, unlike a commit,
    did not wait for DEST's clock to tick.  On a filesystem of whole seconds an edit right
    after it, size and mtime put back, shared the second recorded and stayed hidden from
    every later pull.  Such a pull now waits for the tick: the edit lands after it."""
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=30)
    (ws / "x").mkdir()
    (ws / "x" / "tmp").write_text("0")
    dest = coarse_fs / "out"
    # (a pattern with a '/' is filtered by the host: the guest lists the entry)
    opts = dataclasses.replace(options(tmp_path), excludes=Excludes.from_options(["x/tmp"], []))

    def pulled() -> PullResult:
        result = run_pull(LocalTransport(), ws, dest, opts)
        assert result.ok, result.error
        assert diff(ws, dest) == ["missing: 'x/tmp'"]
        return result

    pulled()
    target = dest / "src" / "f5.txt"
    time.sleep(1.01 - time.time() % 1)  # the pull below begins as a second begins
    if how == "re-hash":
        target.chmod(target.stat().st_mode & 0o7777)  # its ctime moves: re-hashed
    else:
        (ws / "x" / "tmp").write_text("1")  # a new listing, nothing to fetch: a farm wasted
    assert pulled().changed_files == 0
    edit_in_place(target)
    pulled()


def test_an_edit_right_after_a_pull_of_a_workspace_of_whole_seconds(
    tmp_path: Path, coarse_fs: Path
) -> None:
    """Found by a red-team review: on a workspace whose filesystem stamps whole seconds, a
    file listed, read and edited again (size kept) within one second kept its listed
    record, ctime included, while DEST held what was read: no later pull saw it.  A
    content run that fetches such a file now starts a second after the listing."""
    ws = coarse_fs / "ws"
    ws.mkdir()
    (ws / "f").write_bytes(b"AAAA")
    (ws / "g").write_bytes(b"keep")
    dest, opts = tmp_path / "out", options(tmp_path)
    pull(ws, dest, opts)
    time.sleep(1.01 - time.time() % 1)  # the edit and the pull below begin a second
    (ws / "f").write_bytes(b"BBBB")
    # (g too, where the first pull's listing loaded late and left it unrecorded)
    assert pull(ws, dest, opts).changed_files in (1, 2)
    (ws / "f").write_bytes(b"CCCC")  # right after the pull: once within its second
    pull(ws, dest, opts)  # asserts DEST exact


def test_an_edit_right_after_a_first_pull_with_a_late_listing_of_whole_seconds(
    tmp_path: Path, coarse_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a first pull whose listing loads only while its content run reads
    (it cannot wait: nothing is parsed yet): the files stamped in the listing's last
    second are left out of the state, and the next pull fetches them."""
    ws = coarse_fs / "ws"
    ws.mkdir()
    (ws / "old").write_bytes(b"older")
    admitted: list[str] = []
    real_admit, real_load = GuestSession.admit, Incremental.load

    async def admit(self: GuestSession, *args: Any, **kwargs: Any) -> bool:
        admitted.append(kwargs.get("mode", "tar"))
        return await real_admit(self, *args, **kwargs)

    def load(self: Incremental, stream: BinaryIO) -> None:
        deadline = time.monotonic() + 20
        while "tar" not in admitted and time.monotonic() < deadline:
            time.sleep(0.01)
        real_load(self, stream)

    monkeypatch.setattr(GuestSession, "admit", admit)
    monkeypatch.setattr(Incremental, "load", load)
    time.sleep(2.01 - time.time() % 1)  # "old" a second or more before the listing
    (ws / "f").write_bytes(b"BBBB")
    dest, opts = tmp_path / "out", options(tmp_path)
    assert pull(ws, dest, opts).mode == "full"
    assert "tar" in admitted
    (ws / "f").write_bytes(b"CCCC")  # right after the pull: once within its second
    monkeypatch.undo()
    again = pull(ws, dest, opts)  # asserts DEST exact
    assert again.changed_files == 1  # f alone: "old" was recorded


def lock_chmod_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fchmod`` of the DEST lock fails, as on another user's lock file left in a shared
    directory by their killed pull (the pull opens it read-only and cannot chmod it)."""
    real = os.fchmod

    def fchmod(fd: int, mode: int) -> None:
        try:
            on_lock = os.readlink(f"/proc/self/fd/{fd}").endswith(".wsync-lock")
        except OSError:
            on_lock = False
        if on_lock:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        real(fd, mode)

    monkeypatch.setattr(os, "fchmod", fchmod)


def test_a_lock_that_cannot_be_chmodded_still_gives_a_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window's time is read off a directory made beside DEST, not off the lock file.
    (Found by review: with the lock's chmod refused there was no window, and every pull
    re-hashed every file the last one kept.)"""
    lock_chmod_refused(monkeypatch)
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=30)
    dest, opts = tmp_path / "out", options(tmp_path)
    pull(ws, dest, opts)
    for round_no in (1, 2, 3):
        (ws / "src" / "f1.txt").write_text(f"round {round_no}\n")
        rehashes = Rehashes(monkeypatch)
        assert pull(ws, dest, opts).changed_files == 1
        assert rehashes.count == 0 or round_no == 1
    assert sorted(p.name for p in tmp_path.iterdir() if "wsync" in p.name) == []


@pytest.mark.parametrize("first", [True, False], ids=["first", "--full"])
def test_a_full_pull_needs_no_window_and_sees_an_edit_after_its_swap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: bool
) -> None:
    """A whole-tree pull records its new tree as read just before the swap, and nothing
    of the pull moves a ctime of it after that: it opens no window, so an edit of DEST
    between its swap and its commit, size and mtime put back, is re-hashed and repaired
    by the next pull.  (It used to scan DEST after the swap, record what it found, and
    open a window from its start: such an edit stayed.)"""
    ws = make_tree(tmp_path / "ws", big=1024, small=3)
    dest = tmp_path / "out"
    opts = options(tmp_path)
    if not first:
        pull(ws, dest, opts)
        opts = dataclasses.replace(opts, full=True)
    commit = Incremental.commit

    def edit_first(self: Incremental, **kwargs: bool) -> bool:
        edit_in_place(dest / "src" / "f1.txt")
        return commit(self, **kwargs)

    monkeypatch.setattr(Incremental, "commit", edit_first)
    result = run_pull(LocalTransport(), ws, dest, opts)
    assert result.ok and result.mode == "full", result.error
    monkeypatch.undo()
    assert diff(ws, dest) == ["differs: 'src/f1.txt'"]
    assert window(dest, opts) == NO_WINDOW
    again = pull(ws, dest, dataclasses.replace(opts, full=False))  # asserts DEST exact
    assert again.mode == "incremental" and again.changed_files == 1


# -- the recorded value -------------------------------------------------------------------


def state_with(tmp_path: Path, listing: str | None, value: str | None) -> PullState:
    state = PullState.open(tmp_path / "state", tmp_path / "dest", "key")
    for k, v in (("listing", listing), ("ctime_window", value)):
        if v is not None:
            state.db.execute("INSERT OR REPLACE INTO main.meta VALUES (?, ?)", (k, v))
    state.db.commit()
    return state


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("xxh128:zstdl:9:ab:100:200", (100, 200)),
        ("xxh128:zstdl:9:ab:-5:7", (-5, 7)),
        ("xxh128:zstdl:9:ab:100:", NO_WINDOW),  # open
        ("xxh128:zstdl:9:cd:100:200", NO_WINDOW),  # another listing's
        ("100:200", NO_WINDOW),
        ("xxh128:zstdl:9:ab:x:200", NO_WINDOW),
        ("xxh128:zstdl:9:ab:100:2e5", NO_WINDOW),
        ("", NO_WINDOW),
        (None, NO_WINDOW),
    ],
)
def test_the_window_read_back(tmp_path: Path, value: str | None, expected: tuple[int, int]) -> None:
    with state_with(tmp_path, "xxh128:zstdl:9:ab", value) as state:
        assert state.window() == expected


def test_closing_a_window_only_closes_this_listings_open_one(tmp_path: Path) -> None:
    with state_with(tmp_path, "L:1", "L:1:100:") as state:
        state.close_window(300)
        assert state.window() == (100, 300)
        state.close_window(400)  # closed already: stays
        assert state.window() == (100, 300)
    with state_with(tmp_path / "other", "L:2", "L:1:100:") as state:
        state.close_window(300)
        assert state.window() == NO_WINDOW


def test_a_noop_record_carries_the_window_to_its_listing(tmp_path: Path) -> None:
    """A pull that found nothing to do under a new listing (a directory's ctime moved in
    the guest, say) leaves DEST's ctimes as the window describes them."""
    with state_with(tmp_path, "L:1", "L:1:100:300") as state:
        state.record_noop("key", "L:2", "host")
        assert state.window() == (100, 300)
    with state_with(tmp_path / "open", "L:1", "L:1:100:") as state:
        state.record_noop("key", "L:2", "host")  # open it was, open it stays
        assert state.window() == NO_WINDOW
        assert state.db.execute("SELECT v FROM meta WHERE k = 'ctime_window'").fetchone() == (
            "L:2:100:",
        )


class _CountingOs:
    """``os`` for :mod:`wsync.engine.prevtree` alone, counting its ``stat`` of directories."""

    def __init__(self) -> None:
        self.dirs = 0
        self.counting = False

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def stat(self, *args: object, **kwargs: object) -> os.stat_result:
        st = os.stat(*args, **kwargs)  # type: ignore[arg-type]
        if self.counting and stat_module.S_ISDIR(st.st_mode):
            self.dirs += 1
        return st


def test_the_commit_looks_at_no_directory_again(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pull set every directory's mode and mtime and kept what it saw then: the
    commit records that, without an lstat of each (a 59k-entry tree has 8,700)."""
    ws, dest, opts = pulled
    counting = _CountingOs()
    monkeypatch.setattr(prevtree, "os", counting)
    commit = Incremental.commit

    def counted_commit(self: Incremental, **kwargs: bool) -> bool:
        counting.counting = True
        try:
            return commit(self, **kwargs)
        finally:
            counting.counting = False

    monkeypatch.setattr(Incremental, "commit", counted_commit)
    (ws / "src" / "f2.txt").write_text("changed twice\n")
    (ws / "src" / "deep" / "new").mkdir()
    assert pull(ws, dest, opts).changed_files == 3  # the file, the new directory, its parent
    assert counting.dirs == 0
    monkeypatch.undo()
    assert pull(ws, dest, opts).changed_files == 0  # what it recorded is DEST


def _repoint(link: Path) -> None:
    target = os.readlink(link)
    link.unlink()
    link.symlink_to(target + "-elsewhere")


def _touch_dir(directory: Path) -> None:
    (directory / ".swp").write_text("")  # an editor's swap file, come and gone
    (directory / ".swp").unlink()


@pytest.mark.parametrize(
    "what",
    ["root chmod", "root entry come and gone", "fetched symlink", "fetched file"],
)
def test_an_entry_the_pull_made_changed_between_its_swap_and_its_commit_is_repaired(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """Found by a review of the pull's host side: the commit read what the pull made
    after the swap and recorded it as the pull's, so a change made to DEST in between was
    never seen again: DEST's root chmodded or its mtime moved (an editor's swap file), a
    fetched symlink pointed elsewhere (``ln -sfn``), and with ``--keep-prev`` (no window)
    a fetched file rewritten with its size and mtime put back.  Those rows are read off
    the new tree before the swap now.  A default pull's ctime window then still hid the
    fetched file's edit (its ctime moved into the window, which was taken for the pull's
    own links); the window now covers only entries recorded from a scan taken before it
    opened (what the pull kept), never one read off the new tree."""
    ws, dest, opts = pulled
    commit = Incremental.commit
    (ws / "link-to-blob").unlink()
    (ws / "link-to-blob").symlink_to("tool.sh")
    (ws / "src" / "f2.txt").write_text("changed twice\n")
    edits: dict[str, Callable[[], None]] = {
        "root chmod": lambda: dest.chmod(0o700),
        "root entry come and gone": lambda: _touch_dir(dest),
        "fetched symlink": lambda: _repoint(dest / "link-to-blob"),
        "fetched file": lambda: edit_in_place(dest / "src" / "f2.txt"),
    }

    def edit_first(self: Incremental, **kwargs: bool) -> bool:
        edits[what]()
        return commit(self, **kwargs)

    monkeypatch.setattr(Incremental, "commit", edit_first)
    result = run_pull(LocalTransport(), ws, dest, opts)
    assert result.ok and result.mode == "incremental", result.error
    monkeypatch.undo()

    def root(path: Path) -> tuple[int, int]:
        return path.stat().st_mode, path.stat().st_mtime_ns

    assert diff(ws, dest) != [] or root(dest) != root(ws)  # (diff leaves out the root)
    pull(ws, dest, opts)  # asserts DEST exact
    assert root(dest) == root(ws)


def test_a_directory_changed_between_the_swap_and_the_commit_is_repaired(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chmod of one of DEST's directories just after the swap, before the commit: the
    commit records the directory as the pull left it, so the next pull sees the change
    and repairs it (a commit that looked at DEST then recorded the chmod as the pull's
    own, and no later pull touched it)."""
    ws, dest, opts = pulled
    commit = Incremental.commit

    def chmod_first(self: Incremental, **kwargs: bool) -> bool:
        (dest / "src" / "deep").chmod(0o700)
        return commit(self, **kwargs)

    monkeypatch.setattr(Incremental, "commit", chmod_first)
    (ws / "src" / "f2.txt").write_text("changed twice\n")
    result = run_pull(LocalTransport(), ws, dest, opts)
    assert result.ok, result.error
    monkeypatch.undo()
    assert (dest / "src" / "deep").stat().st_mode & 0o777 == 0o700
    pull(ws, dest, opts)  # exact: the mode is the guest's again


#: ``tar`` whose first whole read (``-cf``, no ``-N``) has the file ``{file}`` rewritten in
#: place while it is half-way through it (tar blocked on its full pipe after 1 MiB): what a
#: concurrent writer does.  ``{mark}.same`` says the rewrite came within the second of the
#: producer's mark ``m`` (its directory is tar's current one), the window to hit
_TEARING_TAR = """#!/bin/sh
case " $* " in *" -N "*) exec {real} "$@" ;; *" -cf "*) ;; *) exec {real} "$@" ;; esac
[ -e {mark} ] && exec {real} "$@"
: > {mark}
{{ {real} "$@"; echo $? > {mark}.rc; }} | {{
  head -c 1048576
  s=$(stat -c %Y m)
  dd if=/dev/zero of={file} bs=1048576 count=8 conv=notrunc 2>/dev/null
  [ "$(date +%s)" = "$s" ] && : > {mark}.same
  cat
}}
exit $(cat {mark}.rc)
"""


def _pull_while_rewritten(tmp_path: Path, ws: Path, rel: Path, *, must_succeed: bool) -> None:
    """Full pulls of ``ws`` while a tar shim rewrites ``ws/rel`` (8 MiB) in the middle of
    its read, until a rewrite falls in the change mark's own second (at most four tries):
    DEST never holds the file torn.  ``must_succeed``: each pull must succeed, else a
    failed one counts as leaving the old bytes."""
    target = ws / rel
    bindir, mark = tmp_path / "shim", tmp_path / "rewritten"
    bindir.mkdir()
    real = shutil.which("tar")
    assert real
    (bindir / "tar").write_text(_TEARING_TAR.format(real=real, mark=mark, file=target))
    (bindir / "tar").chmod(0o755)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    old, new = b"A" * (8 << 20), b"\0" * (8 << 20)
    for attempt in range(4):
        for name in ("", ".same", ".rc"):
            Path(f"{mark}{name}").unlink(missing_ok=True)
        target.write_bytes(old)
        time.sleep(1.05)  # written a second before the pull: not "changed" by itself
        dest = tmp_path / f"out{attempt}"
        result = run_pull(LocalTransport(env=env), ws, dest, options(tmp_path, full=True))
        assert Path(mark).exists()  # the file was rewritten while read
        if must_succeed:
            assert result.ok
        got = (dest / rel).read_bytes() if result.ok else old
        assert got in (old, new), "a torn file in DEST"
        if Path(f"{mark}.same").exists():
            break


def test_a_file_rewritten_while_read_on_a_workspace_of_whole_seconds(
    tmp_path: Path, coarse_fs: Path
) -> None:
    """Found by a red-team review: the producer tells a file changed while tar read it by
    its times against a mark taken just before the read, on the staging's filesystem, in
    nanoseconds.  On a workspace whose filesystem stamps whole seconds, a rewrite within
    the mark's own second is stamped before the mark: find did not list it, GNU tar's
    ``-N`` round would not have read it again, and the pull succeeded with the file half
    old, half new (a version that never existed; GNU tar's own "file changed as we read
    it" only became a warning).  Now it is read again: DEST never holds a torn file.
    (Busybox's find compares whole seconds: there the mark's wait for its tick was a
    second already.)  Each try rewrites the file once; the old code was caught by the
    first try whose rewrite fell in the mark's second (most do)."""
    ws = coarse_fs / "ws"
    ws.mkdir()
    _pull_while_rewritten(tmp_path, ws, Path("f"), must_succeed=True)


def test_a_file_rewritten_while_read_on_a_mount_of_whole_seconds_inside_the_workspace(
    tmp_path: Path, coarse_fs: Path
) -> None:
    """The producer's check for a workspace of whole seconds looked only at the
    workspace's root.  A filesystem of whole seconds mounted inside a workspace whose
    own filesystem stamps nanoseconds (a bind mount, a volume) was not seen, and a
    file there rewritten within the mark's second while tar read it reached DEST torn,
    the pull reporting success (guarantee 8)."""
    ws = tmp_path / "ws"
    (ws / "mnt").mkdir(parents=True)
    (ws / "top").write_text("on the workspace's own filesystem\n")
    if os.stat(ws).st_ctime_ns % 1_000_000_000 == 0:
        pytest.skip("the workspace's own filesystem stamps whole seconds")
    (coarse_fs / "part").mkdir()
    bound = subprocess.run(
        ["mount", "--bind", str(coarse_fs / "part"), str(ws / "mnt")],
        capture_output=True,
        check=False,
    )
    if bound.returncode != 0:
        pytest.skip(f"no bind mount here: {bound.stderr.decode(errors='replace').strip()}")
    try:
        _pull_while_rewritten(tmp_path, ws, Path("mnt", "f"), must_succeed=False)
    finally:
        subprocess.run(["umount", "-l", str(ws / "mnt")], capture_output=True, check=False)
