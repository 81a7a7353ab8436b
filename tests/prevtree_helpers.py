"""The ``--keep-prev`` pull cycle shared by the previous tree's tests (test_prevtree,
test_walk_ahead): a pull that must come out exact, where the kept tree is, and what it may
hold."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

from helpers import assert_exact, make_tree, options, run_pull
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.pull import pull as wsync_pull
from wsync.transports.local import LocalTransport


def pull(ws: Path, dest: Path, opts: PullOptions) -> PullResult:
    result = run_pull(LocalTransport(), ws, dest, opts)
    assert result.ok, result.error
    assert_exact(ws, dest)
    return result


def prev_of(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.wsync-prev"


def tmp_trees(dest: Path) -> list[Path]:
    return sorted(dest.parent.glob(f".{dest.name}.wsync-tmp-*"))


def assert_shares_only(dest: Path) -> None:
    """Every non-directory of the kept tree is the very inode DEST holds at that path
    (old versions and deleted entries went with the pull that replaced them)."""
    prev = prev_of(dest)
    assert prev.is_dir() and not prev.is_symlink()
    # closed to others: its directories keep the old DEST's modes, its files are DEST's
    assert stat.S_IMODE(os.stat(prev).st_mode) == 0o700
    seen = 0
    for top, dirs, files in os.walk(prev):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            path = os.path.join(top, name)
            twin = dest / os.path.relpath(path, prev)
            assert os.lstat(path).st_ino == os.lstat(twin).st_ino, path
            seen += 1
    assert seen > 0


def change(ws: Path, round_no: int) -> None:
    """A few kinds of change: an edit, an addition, a deletion, a rename, a type change."""
    (ws / "src" / f"f{round_no}.txt").write_text(f"round {round_no}\n" * 3)
    (ws / f"new-{round_no}").mkdir()
    (ws / f"new-{round_no}" / "n.txt").write_text("new\n")
    (ws / "src" / f"f{round_no + 10}.txt").unlink()
    old = ws / f"new-{round_no - 1}"
    if old.exists():
        old.rename(ws / f"renamed-{round_no}")
    (ws / "tool.sh").chmod(0o700 if round_no % 2 else 0o750)
    if round_no == 3:
        (ws / "dangling").unlink()
        (ws / "dangling").mkdir()


def pulled_twice(tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    """A workspace pulled twice with ``--keep-prev``, the second time with a change: the
    tree is kept."""
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=30)
    dest = tmp_path / "out"
    opts = options(tmp_path, keep_prev=True)
    assert pull(ws, dest, opts).mode == "full"
    assert not prev_of(dest).exists()  # a full pull shares nothing with the old tree
    change(ws, 1)
    assert pull(ws, dest, opts).mode == "incremental"
    assert_shares_only(dest)
    return ws, dest, opts


def cancel_once(
    ws: Path, dest: Path, opts: PullOptions, reached: Callable[[], Awaitable[object]]
) -> None:
    """Start a pull and cancel it (as a daemon does) once ``reached()`` returns."""

    async def go() -> None:
        transport = LocalTransport()
        task = asyncio.create_task(wsync_pull(transport, str(ws), dest, opts))
        await reached()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await transport.aclose()

    asyncio.run(go())
