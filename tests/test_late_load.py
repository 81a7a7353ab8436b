"""The late load: without a baseline the manifest loads while the content run goes on.

A first pull (or ``--full``) archives the whole tree whatever the manifest says, so the
manifest is verified and journaled, the content run is admitted at once, and the
manifest is parsed into the state meanwhile; the pull waits for it before the swap,
because the commit records it (see :mod:`wsync.engine.incphases`).  These tests hold
the load at its start to see the order of things, fail it to see DEST untouched, and
stop the pull while it runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from helpers import assert_exact, local, make_tree, options, run_pull
from wsync.engine import incremental
from wsync.engine.guest import CallStats, GuestSession
from wsync.engine.incphases import IncrementalRunner
from wsync.engine.incremental import Incremental
from wsync.engine.pull import pull
from wsync.errors import HostIOError

KiB = 1024


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "ws", big=200 * KiB, small=30)


@pytest.fixture
def admitted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The modes of the admissions made, in order."""
    modes: list[str] = []
    real = GuestSession.admit

    async def admit(self: GuestSession, *args: Any, **kwargs: Any) -> bool:
        if not kwargs.get("installed"):  # not its own retry after installing the producer
            modes.append(kwargs.get("mode", "tar"))
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(GuestSession, "admit", admit)
    yield modes


def _hold_load(
    monkeypatch: pytest.MonkeyPatch,
    until: Callable[[], bool],
    then: Callable[[], None],
    bound: float = 20.0,
) -> list[bool]:
    """Make the manifest's load wait (up to ``bound`` seconds) until ``until()``; it
    records whether that came true, then runs ``then`` and loads."""
    seen: list[bool] = []
    real = Incremental.load

    def load(self: Incremental, stream: BinaryIO) -> None:
        for _ in range(int(bound * 100)):
            if until():
                break
            threading.Event().wait(0.01)
        seen.append(until())
        then()
        real(self, stream)

    monkeypatch.setattr(Incremental, "load", load)
    return seen


def test_a_first_pull_admits_the_content_run_before_the_manifest_loads(
    tmp_path: Path, workspace: Path, admitted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load waits for the tar run's admission; before the late load it came only
    after the load, so this waited 20 s and saw none."""
    seen = _hold_load(monkeypatch, lambda: "tar" in admitted, lambda: None)
    dest = tmp_path / "out"
    result = run_pull(local(), workspace, dest, options(tmp_path))
    assert result.ok and result.mode == "full"
    assert seen == [True] and admitted == ["manifest", "tar"]
    assert_exact(workspace, dest)
    # the state the late load filled is the baseline: the next pull has nothing to do
    again = run_pull(local(), workspace, dest, options(tmp_path))
    assert again.ok and again.mode == "incremental"
    assert (again.changed_files, again.deleted_files, again.chunks) == (0, 0, 0)


@pytest.mark.parametrize("full", [True, False], ids=["full", "incremental"])
def test_a_pull_over_a_baseline(
    tmp_path: Path,
    workspace: Path,
    admitted: list[str],
    monkeypatch: pytest.MonkeyPatch,
    full: bool,
) -> None:
    """``--full`` loads the manifest late, as a first pull does; without it the diff
    needs the manifest, which loads before any content run (a content run admitted
    during the load would show within the second the load holds)."""
    dest = tmp_path / "out"
    assert run_pull(local(), workspace, dest, options(tmp_path)).ok
    (workspace / "src" / "f1.txt").write_text("changed\n")
    admitted.clear()
    if full:
        seen = _hold_load(monkeypatch, lambda: "tar" in admitted, lambda: None)
    else:
        seen = _hold_load(monkeypatch, lambda: len(admitted) > 1, lambda: None, bound=1.0)
    result = run_pull(local(), workspace, dest, options(tmp_path, full=full))
    assert result.ok
    if full:
        assert result.mode == "full" and seen == [True] and admitted == ["manifest", "tar"]
    else:
        assert result.mode == "incremental" and result.changed_files == 1
        assert seen == [False] and admitted == ["manifest", "select"]
    assert_exact(workspace, dest)


def _fail() -> None:
    raise HostIOError("the state's disk went away")


def test_a_manifest_that_does_not_load_fails_the_pull_with_dest_untouched(
    tmp_path: Path, workspace: Path, admitted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The late load's failure (once the content run is admitted) is the pull's, raised
    before the swap: no DEST, nothing beside it; the next run pulls exactly."""
    seen = _hold_load(monkeypatch, lambda: "tar" in admitted, _fail)
    dest = tmp_path / "out"
    with pytest.raises(HostIOError, match="went away"):
        run_pull(local(), workspace, dest, options(tmp_path))
    assert seen == [True]
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    monkeypatch.undo()
    result = run_pull(local(), workspace, dest, options(tmp_path))
    assert result.ok
    assert_exact(workspace, dest)


def test_a_full_pull_whose_manifest_does_not_load_leaves_the_old_dest(
    tmp_path: Path, workspace: Path, admitted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--full`` over a DEST pulled before: the content run is extracted, then the
    late load fails: DEST is still the old tree, inode for inode."""
    dest = tmp_path / "out"
    assert run_pull(local(), workspace, dest, options(tmp_path)).ok
    before = {p: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in dest.rglob("*")}
    (workspace / "src" / "f1.txt").write_text("changed\n")
    (workspace / "new.txt").write_text("new\n")
    admitted.clear()
    seen = _hold_load(monkeypatch, lambda: "tar" in admitted, _fail)
    with pytest.raises(HostIOError, match="went away"):
        run_pull(local(), workspace, dest, options(tmp_path, full=True))
    assert seen == [True]
    assert {p: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in dest.rglob("*")} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_a_pull_with_nothing_to_do_leaves_no_late_load_running(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recorded state where the guest cannot take a list (no base64 and no stdin): no
    baseline, so the manifest would load late, yet the no-op shortcut may still match.
    The pull returns with no load left running (found in review: its thread read the
    journal while the pull removed it, and held the state the pull had closed)."""
    dest = tmp_path / "out"
    for _ in range(2):
        assert run_pull(local(), workspace, dest, options(tmp_path)).ok
    monkeypatch.setattr(incremental, "can_select", lambda plan, *, stdin: False)
    real_stop = IncrementalRunner.stop_scan

    async def stop_scan(self: IncrementalRunner) -> None:
        if self.scan_task is not None:  # the scan finishes first, as on a small DEST
            await asyncio.gather(self.scan_task, return_exceptions=True)
        await real_stop(self)

    monkeypatch.setattr(IncrementalRunner, "stop_scan", stop_scan)
    released = threading.Event()
    _hold_load(monkeypatch, released.is_set, lambda: None, bound=0.5)
    try:
        result = run_pull(local(), workspace, dest, options(tmp_path))
        assert result.ok and result.chunks == 0
        assert [t for t in threading.enumerate() if t.name == "wsync-host-io"] == []
    finally:
        released.set()


def test_a_pull_stopped_during_the_late_load_leaves_no_tree_and_resumes(
    tmp_path: Path, workspace: Path, admitted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while the load holds (the content run admitted meanwhile): the pull
    stops, the load's thread is let go, nothing is left beside DEST, and the next run
    resumes the journaled listing and content run."""
    real_load = Incremental.load
    release = threading.Event()
    holding = threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(20)

    _hold_load(monkeypatch, lambda: "tar" in admitted, hold)
    dest = tmp_path / "out"

    async def go() -> None:
        transport = local()
        task = asyncio.create_task(pull(transport, str(workspace), dest, options(tmp_path)))
        try:
            for _ in range(2000):
                if holding.is_set():
                    break
                await asyncio.sleep(0.01)
            assert holding.is_set()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            release.set()
            await transport.aclose()

    asyncio.run(go())
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    monkeypatch.setattr(Incremental, "load", real_load)
    admitted.clear()
    result = run_pull(local(), workspace, dest, options(tmp_path))
    assert result.ok and result.reconciled  # the journaled listing, used again
    assert admitted == ["tar"]  # the content run resumed, no fresh listing
    assert_exact(workspace, dest)


def test_the_manifests_staging_goes_beside_the_content_runs_admission(
    tmp_path: Path, workspace: Path, admitted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a first pull nothing waits for the manifest's guest staging to go: its removal
    here waits for the content run's admission to start (bounded); awaited before that
    admission, as it was, it would wait in vain.  It removes its own snapshot, never the
    content run's, which the session has moved on to meanwhile."""
    real = GuestSession.cleanup
    removed: list[str] = []
    waited: list[bool] = []

    async def cleanup(session: GuestSession, snapshot: str | None = None) -> None:
        if not removed:
            for _ in range(3000):
                if "tar" in admitted:
                    break
                await asyncio.sleep(0.01)
            waited.append("tar" in admitted)
        removed.append(session.snapshot if snapshot is None else snapshot)
        await real(session, snapshot)

    monkeypatch.setattr(GuestSession, "cleanup", cleanup)
    dest = tmp_path / "out"
    result = run_pull(local(), workspace, dest, options(tmp_path))
    assert result.ok and not result.warnings, result.warnings
    assert waited == [True] and len(set(removed)) == 2
    assert_exact(workspace, dest)
    assert [p.name for p in (tmp_path / "staging").iterdir() if p.name in removed] == []


def test_a_cleanup_removes_the_snapshot_it_names(tmp_path: Path, workspace: Path) -> None:
    """Not the session's current one (a retry builds its command again: it must name
    the same snapshot however the session moved on)."""

    async def go() -> None:
        session = GuestSession(local(), options(tmp_path), CallStats())
        plan = await session.probe(str(workspace))
        for snapshot in ("s-one", "s-two"):
            assert not await session.admit(snapshot, str(workspace), plan.compressor)
        assert session.snapshot == "s-two"
        await session.cleanup("s-one")
        root = Path(session.staging_root)
        assert not (root / "s-one").exists() and (root / "s-two").is_dir()
        await session.cleanup()
        assert not (root / "s-two").exists()

    asyncio.run(go())
