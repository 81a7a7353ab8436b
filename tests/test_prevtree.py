"""The previous tree (:mod:`wsync.engine.prevtree`, ``--keep-prev``): an incremental pull
keeps the old tree beside DEST and starts the next one from it; whatever happens to that tree
in between, DEST ends exact and nothing of it leaks into DEST or out of it.  Without the
option nothing is kept."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pwd
import shutil
import sqlite3
import stat
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import wsync
from helpers import assert_exact, make_tree, options, run_pull
from incr_helpers import Rehashes
from prevtree_helpers import (
    assert_shares_only,
    cancel_once,
    change,
    prev_of,
    pull,
    pulled_twice,
    tmp_trees,
)
from wsync.engine import hostscan, prevtree
from wsync.engine import pull as pull_module
from wsync.engine.api import PullOptions
from wsync.engine.destdir import DestDir
from wsync.engine.incremental import Incremental
from wsync.engine.incstate import PullState, state_path
from wsync.engine.pull import _Pull
from wsync.errors import Fenced, HostIOError
from wsync.transports.local import LocalTransport


@pytest.fixture
def pulled(tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    """A workspace pulled twice, the second time with a change: the tree is kept."""
    return pulled_twice(tmp_path)


def test_each_pull_starts_from_the_tree_the_last_one_kept(
    pulled: tuple[Path, Path, PullOptions],
) -> None:
    ws, dest, opts = pulled
    for round_no in (2, 3, 4):
        kept = os.stat(prev_of(dest)).st_ino
        change(ws, round_no)
        result = pull(ws, dest, opts)
        assert result.mode == "incremental" and result.changed_files > 0
        # the kept tree became DEST: reused, not rebuilt
        assert os.stat(dest).st_ino == kept
        assert_shares_only(dest)
        assert tmp_trees(dest) == []
    # nothing changed: neither tree is written
    before = (os.stat(dest).st_ino, os.stat(prev_of(dest)).st_mtime_ns)
    result = pull(ws, dest, opts)
    assert result.changed_files == 0
    assert (os.stat(dest).st_ino, os.stat(prev_of(dest)).st_mtime_ns) == before


def test_whatever_was_put_in_the_kept_tree_never_reaches_dest(
    tmp_path: Path, pulled: tuple[Path, Path, PullOptions]
) -> None:
    ws, dest, opts = pulled
    prev = prev_of(dest)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("not wsync's\n")
    # an extra file, a kept file replaced by a lookalike, a directory swapped for a
    # symlink to elsewhere, a FIFO, odd modes, a directory that is not ours
    (prev / "extra.txt").write_text("planted\n")
    (prev / "src" / "f5.txt").unlink()
    (prev / "src" / "f5.txt").write_text((ws / "src" / "f5.txt").read_text())
    shutil.rmtree(prev / "src" / "deep")
    (prev / "src" / "deep").symlink_to(outside)
    os.mkfifo(prev / "fifo")
    (prev / "empty").chmod(0o777)
    (prev / "empty" / "nested-empty").chmod(0o000)
    (prev / "theirs").mkdir()
    (prev / "theirs" / "x").write_text("x\n")
    if os.geteuid() == 0:
        os.chown(prev / "theirs", 65534, 65534)
    change(ws, 2)
    pull(ws, dest, opts)
    assert sorted(os.listdir(outside)) == ["precious"]
    assert (outside / "precious").read_text() == "not wsync's\n"
    assert_shares_only(dest)
    # the lookalike was not taken for DEST's file: DEST kept its own inode
    assert os.stat(dest / "src" / "f5.txt").st_nlink == 2


def test_a_kept_tree_swapped_for_a_symlink_is_not_followed(
    tmp_path: Path, pulled: tuple[Path, Path, PullOptions]
) -> None:
    ws, dest, opts = pulled
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(prev_of(dest), elsewhere, symlinks=True)
    before = sorted(str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*"))
    mode = stat.S_IMODE(os.stat(elsewhere).st_mode)
    shutil.rmtree(prev_of(dest))
    prev_of(dest).symlink_to(elsewhere)
    change(ws, 2)
    pull(ws, dest, opts)
    assert sorted(str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*")) == before
    assert stat.S_IMODE(os.stat(elsewhere).st_mode) == mode
    assert not prev_of(dest).is_symlink()
    assert_shares_only(dest)


def test_a_failed_pull_leaves_its_tree_to_the_next_one(
    pulled: tuple[Path, Path, PullOptions],
) -> None:
    """Failed after its tree was built (a daemon's lease ran out just before the swap):
    DEST is untouched and the tree is left for the next run, not thrown away."""
    ws, dest, opts = pulled
    kept = os.stat(prev_of(dest)).st_ino
    before = sorted(p.relative_to(dest) for p in dest.rglob("*"))
    change(ws, 2)

    def lapsed() -> None:
        raise Fenced("lease lost")

    with pytest.raises(Fenced):
        run_pull(LocalTransport(), ws, dest, dataclasses.replace(opts, fence=lapsed))
    assert sorted(p.relative_to(dest) for p in dest.rglob("*")) == before
    assert not prev_of(dest).exists()
    [tmp] = tmp_trees(dest)
    assert os.stat(tmp).st_ino == kept
    result = pull(ws, dest, opts)  # resumes the journaled run, on the same tree
    assert result.mode == "incremental"
    assert os.stat(dest).st_ino == kept
    assert_shares_only(dest)
    change(ws, 3)
    pull(ws, dest, opts)
    assert_shares_only(dest)


def test_a_full_pull_drops_the_kept_tree(pulled: tuple[Path, Path, PullOptions]) -> None:
    ws, dest, opts = pulled
    change(ws, 2)
    assert pull(ws, dest, dataclasses.replace(opts, full=True)).mode == "full"
    assert not prev_of(dest).exists() and tmp_trees(dest) == []
    change(ws, 3)
    assert pull(ws, dest, opts).mode == "incremental"
    assert_shares_only(dest)


def recorded_vs_disk(dest: Path, opts: PullOptions, *, ignore_ctime: bool = False) -> list[bytes]:
    """Paths whose recorded host signature is not what ``lstat`` of DEST says now (a ctime
    that moved into the last commit's window counts as recorded: the diff keeps it; so does
    the root's, which the swap moves after the pull read it: a directory's ctime is never
    compared)."""
    with PullState.open(opts.state_dir, dest, "") as state:
        lo, hi = state.window()
    db = sqlite3.connect(state_path(opts.state_dir, dest))
    try:
        rows = db.execute("SELECT path, hkind, hmode, hsize, hmtime, hctime, hino FROM state")
        recorded = {bytes(r[0]): tuple(r[1:]) for r in rows}
    finally:
        db.close()
    wrong = []
    for path, signature in recorded.items():
        st = os.lstat(os.fsencode(dest) + b"/" + path if path != b"." else os.fsencode(dest))
        now = hostscan.row(path, st)[1:]
        if ignore_ctime or path == b"." or lo <= st.st_ctime_ns <= hi:
            signature, now = signature[:4] + signature[5:], now[:4] + now[5:]
        if signature != now:
            wrong.append(path)
    return wrong


def test_the_commit_after_a_reuse_records_dest_as_it_is(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit lstats only what the pull made and keeps the diff's scan for the rest:
    a recorded signature may differ from DEST only in the ctime of an entry the reuse
    linked anew (re-hashed once by the next pull, which then finds nothing to do).  A
    reuse opens no ctime window (see test_ctime_window)."""
    ws, dest, opts = pulled
    for round_no in (2, 3):
        change(ws, round_no)
        pull(ws, dest, opts)
        for path in recorded_vs_disk(dest, opts):
            assert recorded_vs_disk(dest, opts, ignore_ctime=True) == [], path
    rehashes = Rehashes(monkeypatch)
    result = pull(ws, dest, opts)
    assert result.changed_files == 0 and result.files == 0
    assert 0 < rehashes.count < 10
    assert recorded_vs_disk(dest, opts) == []


def test_dest_edited_while_the_pull_reuses_the_tree_is_repaired_next_time(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Edits made to DEST after the diff's scan land in the new tree (it links DEST's
    inodes); the state must not record them as the guest's, or no pull repairs them.
    src/f1.txt is linked anew (the last pull fetched it), src/f4.txt is kept as is."""
    ws, dest, opts = pulled
    reuse = prevtree.reuse

    def edit_then_reuse(*args: object, **kw: object) -> tuple[int, int]:
        for name in ("f1.txt", "f4.txt"):
            with (dest / "src" / name).open("ab") as f:
                f.write(b"edited on the host during the pull\n")
        return reuse(*args, **kw)  # type: ignore[arg-type]

    change(ws, 2)
    monkeypatch.setattr(prevtree, "reuse", edit_then_reuse)
    run_pull(LocalTransport(), ws, dest, opts)
    monkeypatch.setattr(prevtree, "reuse", reuse)
    assert b"edited on the host" in (dest / "src" / "f1.txt").read_bytes()
    pull(ws, dest, opts)  # asserts the tree exact
    assert_shares_only(dest)


def test_a_tree_that_could_not_be_kept_costs_no_rehash(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the old tree cannot be kept it is removed, which moves the ctime of every kept
    inode, within the commit's window: the next pull re-hashes nothing."""
    ws, dest, opts = pulled
    change(ws, 2)
    pull(ws, dest, opts)  # a reuse, so the next pull reuses too
    monkeypatch.setattr(DestDir, "keep_prev", lambda self, old: None)
    change(ws, 3)
    pull(ws, dest, opts)
    assert not prev_of(dest).exists()
    assert recorded_vs_disk(dest, opts) == []
    monkeypatch.undo()
    rehashes = Rehashes(monkeypatch)
    assert pull(ws, dest, opts).changed_files == 0
    assert rehashes.count == 0


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("chattr") is None, reason="chattr +i needs root"
)
def test_something_in_the_kept_tree_that_cannot_be_removed_never_blocks_dest(
    tmp_path: Path, pulled: tuple[Path, Path, PullOptions]
) -> None:
    """An entry of the kept tree that cannot be removed (here immutable; as a user, a
    directory of someone else's holding a file) fails the pull that reuses the tree once;
    the tree is then set aside, and the next pull builds a fresh farm and lands DEST."""
    ws, dest, opts = pulled
    planted = prev_of(dest) / "src" / "planted"
    planted.write_text("stuck\n")
    if subprocess.run(["chattr", "+i", str(planted)], capture_output=True).returncode:
        pytest.skip("this filesystem has no immutable flag")
    try:
        change(ws, 2)
        with pytest.raises(HostIOError, match="planted"):
            run_pull(LocalTransport(), ws, dest, opts)
        result = run_pull(LocalTransport(), ws, dest, opts)
        assert result.ok, result.error
        assert_exact(ws, dest)
        assert any("not removed" in w for w in result.warnings), result.warnings
        plain = run_pull(LocalTransport(), ws, dest, dataclasses.replace(opts, full=True))
        assert plain.ok, plain.error
    finally:
        for path in dest.parent.glob(f".{dest.name}.wsync-*/src/planted"):
            subprocess.run(["chattr", "-i", str(path)], check=True)


def test_without_keep_prev_nothing_is_kept_and_a_kept_tree_goes(
    pulled: tuple[Path, Path, PullOptions],
) -> None:
    ws, dest, opts = pulled
    plain = dataclasses.replace(opts, keep_prev=False)
    change(ws, 2)
    assert pull(ws, dest, plain).mode == "incremental"
    assert not prev_of(dest).exists() and tmp_trees(dest) == []
    # every file of DEST is DEST's alone again (guest hardlinks aside)
    assert os.stat(dest / "src" / "f5.txt").st_nlink == 1
    change(ws, 3)
    pull(ws, dest, plain)
    assert not prev_of(dest).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a pull as another user, which needs root")
def test_read_only_directories_when_not_root() -> None:
    """Root writes anywhere; a user does not: the kept tree holds the guest's read-only
    directories, which its pruning and its reuse must open up first (an earlier version
    failed here with exit 8, and pruning left a warning on every pull)."""
    python = "/usr/bin/python3"
    nobody = pwd.getpwnam("nobody")
    src = Path(wsync.__file__).resolve().parents[1]
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{src}:{sysconfig.get_paths()['purelib']}",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    if not os.path.exists(python):
        pytest.skip("no /usr/bin/python3 to run as another user")
    probe = subprocess.run(
        [python, "-c", "import wsync.cli, zstandard, xxhash"],
        env=env, user=nobody.pw_uid, group=nobody.pw_gid, capture_output=True, cwd="/",
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"this venv's packages do not import as another user: {probe.stderr[-200:]!r}")
    top = Path(tempfile.mkdtemp(prefix="wsync-nobody-", dir="/tmp"))
    try:
        ws, dest = top / "ws", top / "out"
        (ws / "ro" / "sub").mkdir(parents=True)
        (ws / "ro" / "sub" / "f").write_text("f\n")
        (ws / "rw").mkdir()
        (ws / "rw" / "g").write_text("g\n")
        for path in [top, *top.rglob("*")]:
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        argv = [python, "-m", "wsync", "pull", f"local:{ws}", str(dest), "--keep-prev",
                "--json", "--no-progress", "--state-dir", str(top / "state"),
                "--staging-dir", str(top / "stage")]  # fmt: skip
        for turn in range(4):
            for d in (ws / "ro", ws / "ro" / "sub"):
                d.chmod(0o755)
            (ws / "ro" / "h").write_text(f"turn {turn}\n")
            os.chown(ws / "ro" / "h", nobody.pw_uid, nobody.pw_gid)
            for d in (ws / "ro", ws / "ro" / "sub"):
                d.chmod(0o555)
            done = subprocess.run(
                argv, env=env, user=nobody.pw_uid, group=nobody.pw_gid,
                capture_output=True, text=True, cwd="/", timeout=300,
            )  # fmt: skip
            result = json.loads(done.stdout)
            assert done.returncode == 0 and result["warnings"] == [], (done.stderr, result)
            assert result["mode"] == ("full" if turn == 0 else "incremental")
            assert_exact(ws, dest)
        assert prev_of(dest).is_dir()
    finally:
        for path in [top, *top.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        shutil.rmtree(top)


@pytest.mark.skipif(os.geteuid() != 0, reason="reads as another user, which needs root")
def test_a_directory_the_guest_closed_is_closed_before_the_build_puts_files_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept directory keeps the old DEST's mode: one the guest has since closed (0755 to
    0700) must be closed before new files go in, or another user holding it open (a shell
    that was in DEST) reads them during the build."""
    ws = make_tree(tmp_path / "ws", big=4096, small=20)
    (ws / "secrets").mkdir(mode=0o755)
    (ws / "secrets" / "readme").write_text("hi\n")
    dest = tmp_path / "out"
    opts = options(tmp_path, keep_prev=True)
    pull(ws, dest, opts)
    change(ws, 1)
    pull(ws, dest, opts)
    held = os.open(dest / "secrets", os.O_RDONLY | os.O_DIRECTORY)  # DEST/secrets, held
    try:
        change(ws, 2)
        pull(ws, dest, opts)  # the held directory is the kept tree's now
        (ws / "secrets").chmod(0o700)
        (ws / "secrets" / "key").write_text("TOP SECRET\n")
        (ws / "secrets" / "key").chmod(0o644)
        change(ws, 3)
        seen: list[int] = []
        dir_meta = Incremental.dir_meta

        def read_as_nobody(self: Incremental, tmp_fd: int) -> None:
            pid = os.fork()
            if pid == 0:  # the child reads what the build put in the held directory
                code = 1
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    os.close(os.open("key", os.O_RDONLY, dir_fd=held))
                except PermissionError:
                    code = 0
                except BaseException:
                    code = 2
                os._exit(code)
            seen.append(os.waitpid(pid, 0)[1])
            dir_meta(self, tmp_fd)

        monkeypatch.setattr(Incremental, "dir_meta", read_as_nobody)
        pull(ws, dest, opts)
        assert os.fstat(held).st_ino == os.stat(dest / "secrets").st_ino  # it was reused
        assert seen == [0], "another user read a file of a directory the guest had closed"
    finally:
        os.close(held)


def test_a_prune_given_up_on_never_works_in_the_next_pulls_tree(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull stopped while it prunes the kept tree leaves the prune's thread at work; the
    next pull in the same process (a daemon) must not start from that tree, or the late
    prune removes from it what the new DEST needs (a pull that reported success, with
    entries missing)."""
    ws, dest, opts = pulled
    (ws / "d").mkdir()
    (ws / "d" / "a.txt").write_text("a\n")
    pull(ws, dest, opts)
    shutil.rmtree(ws / "d")  # the next prune removes d from the kept tree
    entered, release, pruned = threading.Event(), threading.Event(), threading.Event()
    prune = prevtree.prune

    def slow_prune(db: sqlite3.Connection, prev_fd: int, check: Callable[[], None]) -> int:
        entered.set()
        release.wait(60)
        try:
            return prune(db, prev_fd, lambda: None)
        finally:
            pruned.set()

    monkeypatch.setattr(prevtree, "prune", slow_prune)
    # entered is set by the prune's thread
    cancel_once(ws, dest, opts, lambda: asyncio.to_thread(entered.wait, 60))
    assert entered.is_set()
    monkeypatch.setattr(prevtree, "prune", prune)
    (ws / "d").mkdir()  # back, with a new file: the next tree needs d
    (ws / "d" / "new.txt").write_text("new\n")
    swap_in = _Pull.swap_in

    def late_prune_then_swap(self: _Pull, tmp: str, tmp_fd: int) -> str | None:
        release.set()
        assert pruned.wait(60)
        return swap_in(self, tmp, tmp_fd)

    monkeypatch.setattr(_Pull, "swap_in", late_prune_then_swap)
    pull(ws, dest, opts)  # exact, or the late prune removed d from this pull's tree


def test_a_pull_stopped_while_a_thread_works_in_its_reused_tree_leaves_it_to_none(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped (a daemon's cancel) while the directories' metadata is set in the reused tree
    on a worker thread: the cancelled wait leaves the thread at work there, so the tree is
    not left for the next pull (found by a review; a failure that stops no thread leaves
    it, see test_a_failed_pull_leaves_its_tree_to_the_next_one).  The next pull makes a
    fresh tree and DEST comes out exact."""
    ws, dest, opts = pulled
    change(ws, 2)
    entered, release = threading.Event(), threading.Event()
    dir_meta = Incremental.dir_meta

    def slow_dir_meta(self: Incremental, tmp_fd: int) -> None:
        entered.set()
        release.wait(60)
        dir_meta(self, tmp_fd)

    monkeypatch.setattr(Incremental, "dir_meta", slow_dir_meta)
    try:
        # entered is set by the worker thread
        cancel_once(ws, dest, opts, lambda: asyncio.to_thread(entered.wait, 60))
    finally:
        release.set()
    assert entered.is_set()
    monkeypatch.setattr(Incremental, "dir_meta", dir_meta)
    reused: list[int] = []
    reuse = prevtree.reuse

    def counted(*args: Any, **kwargs: Any) -> tuple[int, int]:
        reused.append(1)
        return reuse(*args, **kwargs)

    monkeypatch.setattr(prevtree, "reuse", counted)
    result = pull(ws, dest, opts)
    assert result.mode == "incremental"
    assert reused == []  # a fresh tree, not the one the thread was in
    change(ws, 3)
    pull(ws, dest, opts)
    assert_shares_only(dest)


def test_a_pull_cancelled_outside_any_thread_leaves_its_reused_tree(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel (a daemon's stop, the --timeout deadline) while the pull awaits a guest
    call (apply_lists), after every worker thread in the tree has returned: the tree is
    left for the next run, which reuses it (a review caught 8ffbafa dropping it on every
    cancel)."""
    ws, dest, opts = pulled
    kept = os.stat(prev_of(dest)).st_ino
    change(ws, 2)
    entered = asyncio.Event()
    real = pull_module.apply_lists

    async def stuck(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        await asyncio.sleep(3600)
        return await real(*args, **kwargs)

    monkeypatch.setattr(pull_module, "apply_lists", stuck)
    cancel_once(ws, dest, opts, lambda: asyncio.wait_for(entered.wait(), 60))
    monkeypatch.setattr(pull_module, "apply_lists", real)
    assert kept in [os.stat(t).st_ino for t in tmp_trees(dest)], "kept tree thrown away"
    pull(ws, dest, opts)
    assert os.stat(dest).st_ino == kept
    assert_exact(ws, dest)


def test_a_prune_that_fails_is_a_warning(
    pulled: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DEST is final when the prune runs: a failure in it is a warning, and the next reuse
    removes what it left."""
    ws, dest, opts = pulled

    def fails(*args: Any) -> int:
        raise HostIOError("the disk said no")

    monkeypatch.setattr(prevtree, "prune", fails)
    change(ws, 2)
    result = pull(ws, dest, opts)
    assert any("not fully pruned" in w and "the disk said no" in w for w in result.warnings)
    monkeypatch.undo()
    change(ws, 3)
    assert not pull(ws, dest, opts).warnings
    assert_shares_only(dest)
