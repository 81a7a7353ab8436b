"""DEST is written through one held parent fd: confined by a dest root, locked, never a mount.

Issue 7 items 2 (a symlink swapped into DEST's parent path sends the tree outside the
daemon's roots), 13 (two sandboxes pulled into one DEST both succeed; DEST on a mount point
fails only after the whole transfer) and 7 (left-over tmp trees block DEST).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from helpers import assert_exact, local, make_tree, options, run_pull
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.destdir import DestDir, open_beneath
from wsync.engine.journal import Journal
from wsync.engine.pull import pull
from wsync.errors import HostIOError, UsageError
from wsync.protocol import scripts
from wsync.transports.local import LocalTransport

Hook = Callable[[int], Awaitable[None]]


@pytest.fixture(autouse=True)
def _plain_admissions(monkeypatch: pytest.MonkeyPatch) -> None:
    """No URL fits the carried admission: :class:`HookTransport`'s every admission is
    plain, as on Sprites or Kubernetes with a deep workspace path."""
    monkeypatch.setattr(scripts, "URL_ARGV_MAX", 0)


class HookTransport(LocalTransport):
    """The real ``local:`` transport, with a test hook awaited before every exec
    (the n-th exec gets n): it changes the host while the pull runs.  Without guest
    helpers, so that every guest call is an exec the hook sees, and with a short argv too
    short for the admission that carries its status (:func:`_plain_admissions`), so that a
    status follows each admission as a call of its own (a stream small enough to come with
    the admission's status would leave no exec while the tree is extracted)."""

    capabilities = dataclasses.replace(LocalTransport.capabilities, channel=False, long_argv=False)

    def __init__(self, hook: Hook) -> None:
        super().__init__()
        self.hook = hook
        self.calls = 0

    async def exec(self, argv, **kw):  # type: ignore[no-untyped-def,override]
        self.calls += 1
        await self.hook(self.calls)
        return await super().exec(argv, **kw)


def pull_as(
    transport: LocalTransport, sandbox: str, workspace: Path, dest: Path, opts: PullOptions
) -> Awaitable[PullResult]:
    async def go() -> PullResult:
        try:
            return await pull(transport, str(workspace), dest, opts, sandbox=sandbox)
        finally:
            await transport.aclose()

    return go()


def small_tree(root: Path, text: str) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "file").write_text(text)
    return root


def beside(dest: Path) -> list[str]:
    """What wsync left next to DEST (tmp trees, lock files)."""
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}."))


# -- item 2: confinement beneath a dest root ---------------------------------------------------


@pytest.mark.parametrize("use_openat2", [True, False], ids=["openat2", "walk"])
def test_open_beneath_refuses_every_symlink(tmp_path: Path, use_openat2: bool) -> None:
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "a" / "link").symlink_to(tmp_path / "outside")
    (root / "a" / "rel").symlink_to("b")
    (root / "a" / "file").write_text("x")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        good = open_beneath(fd, ("a", "b"), use_openat2=use_openat2)
        assert os.path.samestat(os.fstat(good), os.stat(root / "a" / "b"))
        os.close(good)
        for parts, code in [
            (("a", "link"), "ELOOP"),
            (("a", "rel"), "ELOOP"),
            (("a", "link", "x"), "ELOOP"),
            (("a", "file"), "ENOTDIR"),
            (("a", "missing"), "ENOENT"),
        ]:
            with pytest.raises(OSError) as info:
                open_beneath(fd, parts, use_openat2=use_openat2)
            assert info.value.errno == getattr(__import__("errno"), code), parts
        with pytest.raises(OSError):
            open_beneath(fd, ("..", "outside"), use_openat2=use_openat2)
    finally:
        os.close(fd)


@pytest.fixture
def confined(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(workspace, dest root, a directory outside the root that must stay empty)."""
    workspace = small_tree(tmp_path / "ws", "guest data\n")
    root = tmp_path / "roots"
    (root / "a").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    return workspace, root, outside


@pytest.mark.parametrize("case", ["symlink-in-path", "outside-root", "dest-is-root"])
def test_dest_root_refuses_at_start(
    tmp_path: Path, confined: tuple[Path, Path, Path], case: str
) -> None:
    workspace, root, outside = confined
    if case == "symlink-in-path":
        (root / "link").symlink_to(outside)
        dest, message = root / "link" / "out", "crosses a symlink"
    elif case == "outside-root":
        dest, message = outside / "out", "not beneath the dest root"
    else:
        dest, message = root, "not beneath the dest root"
    transport = HookTransport(lambda n: asyncio.sleep(0))
    with pytest.raises(UsageError, match=message) as info:
        run_pull(transport, workspace, dest, options(tmp_path, dest_root=root))
    assert info.value.exit_code == 2
    assert transport.calls == 0  # refused before the guest was asked anything
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("when", ["before-tmp", "during-extraction"])
@pytest.mark.parametrize("rooted", [True, False], ids=["dest-root", "cli"])
def test_symlink_swapped_into_the_parent_path_during_the_pull(
    tmp_path: Path, confined: tuple[Path, Path, Path], when: str, rooted: bool
) -> None:
    """After check_dest, ``roots/a`` is renamed away and replaced by a symlink to a
    directory outside the root.  Nothing may land outside: with a dest root the pull is
    refused; without one (the CLI) the tree lands in the directory that was checked."""
    workspace, root, outside = confined
    dest = root / "a" / "out"
    swapped: list[int] = []

    async def swap(n: int) -> None:
        if swapped:
            return
        if when == "before-tmp" or any(
            p.name.startswith(".out.wsync-tmp-") for p in (root / "a").iterdir()
        ):
            (root / "a").rename(root / "a-moved")
            (root / "a").symlink_to(outside)
            swapped.append(n)

    opts = options(tmp_path, dest_root=root if rooted else None, chunk_size=64 * 1024)
    transport = HookTransport(swap)
    if rooted:
        with pytest.raises(UsageError, match="replaced during the pull") as info:
            run_pull(transport, workspace, dest, opts)
        assert info.value.exit_code == 2
        assert sorted(os.listdir(root / "a-moved")) == []  # the tmp tree was removed
    else:
        run_pull(transport, workspace, dest, opts)
        assert_exact(workspace, root / "a-moved" / "out")
        assert beside(root / "a-moved" / "out") == []
    assert swapped
    assert list(outside.iterdir()) == []


def test_dest_root_pull_writes_beneath_the_root(
    tmp_path: Path, confined: tuple[Path, Path, Path]
) -> None:
    workspace, root, _ = confined
    dest = root / "a" / "out"
    result = run_pull(local(), workspace, dest, options(tmp_path, dest_root=root))
    assert result.dest == str(dest.resolve())
    assert_exact(workspace, dest)
    assert beside(dest) == []


# -- item 13: DEST is locked for the whole pull -------------------------------------------------


def test_two_sandboxes_into_one_dest_second_fails_at_once(tmp_path: Path) -> None:
    ws1 = small_tree(tmp_path / "ws1", "one\n")
    ws2 = small_tree(tmp_path / "ws2", "two\n")
    dest = tmp_path / "out"
    opts = options(tmp_path)

    async def scenario() -> tuple[PullResult, BaseException | PullResult]:
        started, release = asyncio.Event(), asyncio.Event()

        async def hold(n: int) -> None:
            started.set()
            if n == 1:
                await release.wait()

        first = asyncio.create_task(pull_as(HookTransport(hold), "local:ws1", ws1, dest, opts))
        await asyncio.wait_for(started.wait(), 60)
        try:
            second: BaseException | PullResult = await asyncio.wait_for(
                pull_as(local(), "local:ws2", ws2, dest, opts), 60
            )
        except UsageError as exc:
            second = exc
        release.set()
        return await asyncio.wait_for(first, 120), second

    first, second = asyncio.run(scenario())
    assert first.ok
    assert_exact(ws1, dest)
    assert isinstance(second, UsageError), second
    assert second.exit_code == 2
    assert f"being written by another wsync pull (pid {os.getpid()})" in str(second)
    assert "\n" not in str(second)
    assert beside(dest) == []  # the lock file goes with the lock
    # released: the next pull into DEST works
    run_pull(local(), ws2, dest, opts)
    assert_exact(ws2, dest)


def test_lock_survives_a_holder_that_unlinks_on_release(tmp_path: Path) -> None:
    """The lock file is removed on release; a waiter that opened the old file must
    not believe it holds the lock once a third pull took a new one."""
    dest = tmp_path / "out"
    a = DestDir.open(dest)
    a.lock()
    stale = os.open(tmp_path / ".out.wsync-lock", os.O_RDWR)  # opened before the release
    a.close()
    b = DestDir.open(dest)
    b.lock()
    try:
        c = DestDir.open(dest)
        with pytest.raises(UsageError, match="another wsync pull"):
            c.lock()
        c.close()
    finally:
        b.close()
        os.close(stale)
    assert beside(dest) == []


def test_nested_dests_exclude_each_other_in_either_order(tmp_path: Path) -> None:
    """A pull replaces DEST whole: a pull beneath it (``D/sub``) or above it (D's parent,
    when that is a DEST too) meanwhile would be swept away with the old tree, so whichever
    comes second fails at once, naming why; siblings share their parent freely."""
    (tmp_path / "top" / "D" / "sub").mkdir(parents=True)
    top, d = tmp_path / "top", tmp_path / "top" / "D"
    dests = {top, d, d / "sub"}  # as the registry of the pulls' state directory says

    def held(path: Path) -> DestDir:
        target = DestDir.open(path)
        target.lock(dests.__contains__)
        return target

    def refused(path: Path, why: str) -> None:
        target = DestDir.open(path)
        with pytest.raises(UsageError, match=why) as info:
            target.lock(dests.__contains__)
        target.close()
        assert info.value.exit_code == 2

    inner = held(d / "sub")
    refused(d, f"DEST {d} is locked by another process")
    refused(top, "is locked by another process")
    sibling = held(tmp_path / "top" / "E")
    inner.close()
    outer = held(d)
    refused(d / "sub", f"lies in the DEST {d}, which another process")
    refused(d / "sub" / "deeper", f"lies in the DEST {d}")
    refused(top, "is locked by another process")
    outer.close()
    sibling.close()
    for path in (top, d, d / "sub"):
        held(path).close()  # all released


def test_a_pull_beneath_a_dest_that_is_no_dest_yet_waits_for_its_pull(tmp_path: Path) -> None:
    """Found by a review: a pull into an empty directory ``D`` (accepted as empty, no DEST
    of wsync's yet) and a pull into ``D/sub`` meanwhile both succeeded, and ``D``'s swap
    threw ``sub`` away with the old tree.  The pull beneath now meets ``D``'s DEST lock,
    held, and stops at once; a lock file nobody holds (a killed pull's) stops nothing."""
    d = tmp_path / "top" / "D"
    d.mkdir(parents=True)
    outer = DestDir.open(d)
    outer.lock()  # no registry: D is no DEST wsync wrote
    try:
        inner = DestDir.open(d / "sub")
        with pytest.raises(UsageError, match=rf"lies in {d}, which another wsync pull"):
            inner.lock()
        inner.close()
        (d / "a").mkdir()
        deeper = DestDir.open(d / "a" / "b")
        with pytest.raises(UsageError, match=rf"lies in {d}, which"):
            deeper.lock()
        deeper.close()
    finally:
        outer.close()
    (tmp_path / "top" / ".D.wsync-lock").write_text("999999\n")  # left by a killed pull
    free = DestDir.open(d / "sub")
    free.lock()
    free.close()


def test_a_fifo_for_a_lock_file_above_dest_hangs_nothing(tmp_path: Path) -> None:
    """Found by a review: the look at an ancestor's lock file opened it read-only and
    waiting, and a FIFO planted under that name (in ``/tmp``, say) hung the pull in its
    ``open`` for good, a daemon's job past any cancel."""
    (tmp_path / "pub" / "work").mkdir(parents=True)
    os.mkfifo(tmp_path / "pub" / ".work.wsync-lock")
    done: list[bool] = []

    def lock() -> None:
        target = DestDir.open(tmp_path / "pub" / "work" / "out")
        target.lock()
        target.close()
        done.append(True)

    thread = threading.Thread(target=lock, daemon=True)
    thread.start()
    thread.join(30)
    if not done:  # let the hung open go, so the test run can end
        with contextlib.suppress(OSError):
            os.close(os.open(tmp_path / "pub" / ".work.wsync-lock", os.O_WRONLY | os.O_NONBLOCK))
    assert done == [True]


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file of another user: needs root")
def test_another_users_lock_file_above_dest_stops_nothing(tmp_path: Path) -> None:
    """In a directory anyone may write (``/tmp``) another user could plant and hold a lock
    file beside an ancestor of DEST: only a lock file of ours or root's counts."""
    shared = tmp_path / "shared"
    (shared / "x").mkdir(parents=True)
    planted = shared / ".x.wsync-lock"
    planted.write_text("")
    os.chown(planted, 65534, 65534)
    fd = os.open(planted, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        target = DestDir.open(shared / "x" / "out")
        target.lock()
        target.close()
    finally:
        os.close(fd)


def test_a_lock_on_a_directory_that_is_no_dest_stops_no_pull(tmp_path: Path) -> None:
    """``flock`` on a directory needs only read access: with a shared lock on every
    ancestor, any local user holding ``/`` (or /home) exclusively stopped every pull (a
    reviewer's experiment made a whole test run fail with "lies in /").  Only ancestors
    that are DESTs are locked now."""
    ws = small_tree(tmp_path / "ws", "guest\n")
    holders = []
    for directory in (Path("/"), tmp_path):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holders.append(fd)
    try:
        run_pull(local(), ws, tmp_path / "out", options(tmp_path))
    finally:
        for fd in holders:
            os.close(fd)
    assert_exact(ws, tmp_path / "out")


def test_a_pull_into_a_subdirectory_is_never_swept_away_by_a_pull_of_dest(tmp_path: Path) -> None:
    """The race a red team found: a pull into ``D/inner`` runs; a pull into ``D`` starts and
    swaps a new ``D`` in.  The inner pull then swapped its tree into the old ``D`` (thrown
    away) and said it succeeded (or, a moment later, failed after its whole transfer).
    Now the pull into ``D`` fails at once."""
    ws_outer = small_tree(tmp_path / "ws1", "outer\n")
    ws_inner = small_tree(tmp_path / "ws2", "inner\n")
    dest = tmp_path / "D"
    opts = options(tmp_path)
    run_pull(local(), ws_outer, dest, opts)
    outcome: list[BaseException | PullResult] = []

    def outer() -> None:
        try:
            outcome.append(run_pull(local(), ws_outer, dest, opts))
        except UsageError as exc:
            outcome.append(exc)

    def outer_pull() -> None:  # just before the inner pull's swap, on a loop of its own
        thread = threading.Thread(target=outer)
        thread.start()
        thread.join(120)

    inner = dest / "inner"  # a directory of its own in D (D/sub holds the outer guest's)
    done = run_pull(local(), ws_inner, inner, dataclasses.replace(opts, fence=outer_pull))
    assert done.ok
    assert_exact(ws_inner, inner)
    (refusal,) = outcome
    assert isinstance(refusal, UsageError) and "locked by another process" in str(refusal), refusal


# -- item 13: DEST on a mount point is refused before any transfer ------------------------------


@pytest.fixture(params=["tmpfs", "bind"])
def mounted_dest(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    dest = tmp_path / "out"
    dest.mkdir()
    if request.param == "tmpfs":
        argv = ["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(dest)]
    else:  # same filesystem, same st_dev: only the mount table tells
        argv = ["mount", "--bind", str(dest), str(dest)]
    done = subprocess.run(argv, capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here ({request.param}): {done.stderr.decode(errors='replace')}")
    try:
        yield dest
    finally:
        subprocess.run(["umount", "-l", str(dest)], check=False)


def test_dest_on_a_mount_point_fails_before_any_transfer(
    tmp_path: Path, mounted_dest: Path
) -> None:
    workspace = small_tree(tmp_path / "ws", "x\n")
    transport = HookTransport(lambda n: asyncio.sleep(0))
    opts = options(tmp_path)
    with pytest.raises(UsageError, match=r"is a mount point.*subdirectory") as info:
        run_pull(transport, workspace, mounted_dest, opts)
    assert info.value.exit_code == 2
    assert transport.calls == 0
    assert not Path(opts.staging_root).exists()
    # the advice works
    run_pull(local(), workspace, mounted_dest / "workspace", opts)
    assert_exact(workspace, mounted_dest / "workspace")


# -- item 7: left-overs of earlier runs -------------------------------------------------------


def test_left_over_tmp_trees_are_cleaned_by_the_next_pull(tmp_path: Path) -> None:
    workspace = make_tree(tmp_path / "ws", big=100_000, small=5)
    dest = tmp_path / "out"
    own = Journal(tmp_path / "state", "local", dest).key[:12]  # this pull's own tmp name
    for name in (f".out.wsync-tmp-{own}", ".out.wsync-tmp-0123456789ab", ".out.wsync-old"):
        left = tmp_path / name
        (left / "ro" / "x" / "y").mkdir(parents=True)
        (left / "ro" / "x" / "y" / "f").write_text("stale\n")
        (left / "link").symlink_to(workspace)
        for d in (left / "ro" / "x" / "y", left / "ro" / "x", left / "ro"):
            d.chmod(0o500)
    # other DESTs' (out2, and "out.wsync-tmp-0123456789ab"): not ours to remove
    kept = [tmp_path / ".out2.wsync-tmp-0123456789ab"]
    kept.append(tmp_path / ".out.wsync-tmp-0123456789ab.wsync-tmp-0123456789ab")
    for other in kept:
        other.mkdir()
    run_pull(local(), workspace, dest, options(tmp_path))
    assert_exact(workspace, dest)
    assert beside(dest) == sorted(p.name for p in kept[1:])
    assert all(p.is_dir() for p in kept)
    assert (workspace / "blob.bin").exists()


def test_discard_reports_a_failed_removal_and_never_raises(tmp_path: Path) -> None:
    """The failure path's cleanup must not replace the pull's own error: a tmp tree that
    cannot be removed (here a mount point inside it, EBUSY) becomes a message."""
    dest = tmp_path / "out"
    target = DestDir.open(dest)
    try:
        fd, warnings, _, _ = target.make_tmp(".out.wsync-tmp-0123456789ab")
        assert warnings == [] and fd >= 0
        mnt = tmp_path / ".out.wsync-tmp-0123456789ab" / "mnt"
        mnt.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace')}")
        try:
            problem = target.discard(".out.wsync-tmp-0123456789ab")
            # the tree went under a stale name before its removal: the message names
            # that, where the mount stays
            stale = [p for p in tmp_path.glob(".out.wsync-tmp-*/mnt") if p != mnt]
        finally:
            for where in [mnt, *tmp_path.glob(".out.wsync-tmp-*/mnt")]:
                subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)
        assert len(stale) == 1 and problem is not None and f"{stale[0]}:" in problem
        assert not any(
            str(tmp_path) in line for line in Path("/proc/mounts").read_text().splitlines()
        )
    finally:
        target.close()


@pytest.mark.parametrize("was", ["none", "a tree"])
def test_a_directory_put_at_dest_during_the_pull_is_never_thrown_away(
    tmp_path: Path, was: str
) -> None:
    """The swap replaces only the DEST the pull started from: another directory put there
    meanwhile (another program; a daemon job into ``D/inner`` whose confinement created
    ``D``) stays, and the pull fails saying so.  A red team lost a succeeded job's tree
    this way.  A DEST removed meanwhile is no loss: the new tree goes there."""
    ws = small_tree(tmp_path / "ws", "guest\n")
    dest = tmp_path / "out"
    opts = options(tmp_path)
    if was == "a tree":
        run_pull(local(), ws, dest, opts)
        (ws / "sub" / "file").write_text("guest, changed\n")

    def other_program() -> None:  # just before the swap
        if dest.exists():
            dest.rename(tmp_path / "moved-away")
        (dest / "inner").mkdir(parents=True)
        (dest / "inner" / "theirs").write_text("keep me\n")

    with pytest.raises(HostIOError, match="replaced or created by another program") as info:
        run_pull(local(), ws, dest, dataclasses.replace(opts, fence=other_program))
    assert info.value.exit_code == 8
    assert (dest / "inner" / "theirs").read_text() == "keep me\n"
    assert sorted(p.name for p in dest.iterdir()) == ["inner"]
    assert beside(dest) == []
    # and the rerun does not take it for wsync's tree (the reviewer's catch: the pull
    # had recorded DEST as its own before the swap found it was not)
    with pytest.raises(UsageError, match="did not write"):
        run_pull(local(), ws, dest, opts)
    assert (dest / "inner" / "theirs").read_text() == "keep me\n"
    shutil.rmtree(dest)

    def removed() -> None:
        shutil.rmtree(dest, ignore_errors=True)

    run_pull(local(), ws, dest, dataclasses.replace(opts, force=True))
    (ws / "sub" / "file").write_text("guest, changed again\n")
    run_pull(local(), ws, dest, dataclasses.replace(opts, fence=removed))
    assert_exact(ws, dest)


def test_an_empty_dest_written_into_during_the_pull_is_never_thrown_away(
    tmp_path: Path,
) -> None:
    """DEST is accepted without ``--force`` because it is empty; another program that
    writes into that very directory while the pull runs (a ``git clone`` into the
    directory just made, an editor's project files) must not lose its files to the swap
    either.  The check at the start alone let the pull swap it away and succeed."""
    ws = small_tree(tmp_path / "ws", "guest\n")
    dest = tmp_path / "out"
    dest.mkdir()
    opts = options(tmp_path)

    def other_program() -> None:  # just before the swap
        (dest / "theirs").write_text("keep me\n")

    with pytest.raises(HostIOError, match="replaced or created by another program") as info:
        run_pull(local(), ws, dest, dataclasses.replace(opts, fence=other_program))
    assert info.value.exit_code == 8
    assert sorted(p.name for p in dest.iterdir()) == ["theirs"]
    assert beside(dest) == []
    with pytest.raises(UsageError, match="did not write"):  # not taken for wsync's since
        run_pull(local(), ws, dest, opts)
    assert (dest / "theirs").read_text() == "keep me\n"
    # once wsync's, DEST is replaced whole as always; --force replaces a non-empty one
    run_pull(local(), ws, dest, dataclasses.replace(opts, force=True))
    assert_exact(ws, dest)


@pytest.mark.parametrize(
    "name",
    [
        ".agent1.wsync-lock",
        ".agent1.wsync-prev",
        ".a.wsync-old",
        ".a.b.wsync-tmp-0123",
        ".a.wsync-prev/inside",  # any component: the daemon creates missing parents
    ],
)
def test_a_dest_named_like_wsyncs_own_entries_beside_a_dest_is_refused(
    tmp_path: Path, name: str
) -> None:
    """A red team pulled into ``.agent1.wsync-lock`` through the daemon: every later pull
    of ``agent1`` failed ("locking DEST: Is a directory") until someone removed it."""
    ws = small_tree(tmp_path / "ws", "guest\n")
    with pytest.raises(UsageError, match="wsync's own") as info:
        run_pull(local(), ws, tmp_path / name, options(tmp_path))
    assert info.value.exit_code == 2
    assert not (tmp_path / name.split("/")[0]).exists()
    # names that only look alike are DESTs like any other
    for fine in ("agent1.wsync-lock", ".agent1.wsync-locked", ".wsync-prev"):
        run_pull(local(), ws, tmp_path / fine, options(tmp_path))
        assert_exact(ws, tmp_path / fine)


@pytest.mark.skipif(os.geteuid() != 0, reason="looks as another user, which needs root")
def test_a_pull_beneath_a_dest_sees_its_lock_through_a_directory_it_may_only_search() -> None:
    """Found by a review: the walk up from DEST opened each ancestor for reading, and
    stopped at one this user may search but not read (mode 711), so a pull beneath it
    missed the lock of a pull replacing a directory above it.  The walk goes on through
    such a directory (another user runs the pull beneath: root reads anything)."""
    top = Path(tempfile.mkdtemp(prefix="wsync-walk-", dir="/tmp"))
    try:
        top.chmod(0o755)
        d = top / "D"
        (d / "x").mkdir(parents=True)
        d.chmod(0o711)  # others may pass, not list
        os.chown(d / "x", 65534, 65534)  # the pull beneath writes its lock file there
        outer = DestDir.open(d)
        outer.lock()  # a pull into D (no DEST of wsync's yet) holds D's lock file
        try:
            pid = os.fork()
            if pid == 0:  # the pull beneath, as nobody
                code = 3
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    inner = DestDir.open(d / "x" / "sub")
                    try:
                        inner.lock()
                        code = 1  # not stopped
                    except UsageError as exc:
                        code = 0 if f"lies in {d}, which another wsync pull" in str(exc) else 2
                    inner.close()
                except BaseException:
                    code = 4
                os._exit(code)
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        finally:
            outer.close()
    finally:
        shutil.rmtree(top)


def test_a_dest_name_is_held_to_what_its_filesystem_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eCryptfs takes names of 143 bytes: DEST's name is held to what the filesystem of
    its parent says, not to 255 alone (found by a review), and the fd is not leaked."""
    monkeypatch.setattr(os, "fpathconf", lambda fd, name: 143)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(UsageError, match="at most 119 bytes"):
        DestDir.open(tmp_path / ("q" * 120))
    assert len(os.listdir("/proc/self/fd")) == fds
    DestDir.open(tmp_path / ("q" * 119)).close()
    # a filesystem that says 0 or -1 (some FUSE ones) is not believed: 255 holds
    for said in (0, -1):
        monkeypatch.setattr(os, "fpathconf", lambda fd, name, said=said: said)
        DestDir.open(tmp_path / ("q" * 231)).close()
