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

from helpers import assert_exact, counting_cleanups, local, make_tree, options, run_pull
from wsync.engine import incremental
from wsync.engine.guest import GuestSession
from wsync.engine.guestcall import CallStats
from wsync.engine.incphases import IncrementalRunner
from wsync.engine.incremental import Incremental
from wsync.engine.pull import _Pull, pull
from wsync.errors import HostIOError, StagingFailed

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


def _stopped_while_loading(
    tmp_path: Path,
    workspace: Path,
    monkeypatch: pytest.MonkeyPatch,
    until: Callable[[], bool],
    **overrides: Any,
) -> list[bool]:
    """A pull into ``out`` (with ``overrides`` of its options) cancelled (SIGINT, a daemon's
    DELETE, --timeout) while the manifest's load holds, which it does until ``until()``;
    the load is then let go and put back.  Returns what :func:`_hold_load` saw."""
    real_load = Incremental.load
    release = threading.Event()
    holding = threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(20)

    seen = _hold_load(monkeypatch, until, hold)

    async def go() -> None:
        transport = local()
        out = tmp_path / "out"
        opts = options(tmp_path, **overrides)
        task = asyncio.create_task(pull(transport, str(workspace), out, opts))
        try:
            assert await asyncio.to_thread(holding.wait, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            release.set()
            await transport.aclose()

    asyncio.run(go())
    monkeypatch.setattr(Incremental, "load", real_load)
    return seen


def _stopped_first_pull(
    tmp_path: Path, workspace: Path, admitted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first pull stopped while the late load holds, the content run admitted
    meanwhile."""
    seen = _stopped_while_loading(tmp_path, workspace, monkeypatch, lambda: "tar" in admitted)
    assert seen == [True]
    admitted.clear()


def _staged(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "staging").iterdir() if p.name.startswith("s"))


@pytest.mark.usefixtures("no_inline")  # (a run that comes whole cleans itself)
def test_a_pull_stopped_during_the_late_load_leaves_no_tree_and_resumes(
    tmp_path: Path, workspace: Path, admitted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while the load holds (the content run admitted meanwhile): the pull
    stops, the load's thread is let go, nothing is left beside DEST, and the next run
    resumes the journaled listing and content run.  Both runs' guest staging stays
    until then (the listing's was left for the last cleanup, which never came); that
    run's last cleanup names both, so nothing waits for the GC's day."""
    dest = tmp_path / "out"
    _stopped_first_pull(tmp_path, workspace, admitted, monkeypatch)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    assert _staged(tmp_path)  # the listing's, at least
    result = run_pull(local(), workspace, dest, options(tmp_path))
    assert result.ok and result.reconciled  # the journaled listing, used again
    assert admitted == ["tar"]  # the content run resumed, no fresh listing
    assert_exact(workspace, dest)
    assert _staged(tmp_path) == []


def test_a_dry_run_after_a_stopped_first_pull_lists_the_workspace_as_it_is_now(
    tmp_path: Path, workspace: Path, admitted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing of the stopped pull is still staged under its id; a preview must not
    adopt it: it shows what a pull would do now, a file added since included.  Nor may
    it remove it: the real rerun still resumes the stopped pull."""
    _stopped_first_pull(tmp_path, workspace, admitted, monkeypatch)
    staged = _staged(tmp_path)
    (workspace / "added-after-the-stop.txt").write_text("new\n")
    result = run_pull(local(), workspace, tmp_path / "out", options(tmp_path, dry_run=True))
    assert any(line.endswith("added-after-the-stop.txt") for line in result.changes)
    assert _staged(tmp_path) == staged
    admitted.clear()
    result = run_pull(local(), workspace, tmp_path / "out", options(tmp_path))
    assert result.ok and result.reconciled
    assert admitted == ["tar"]  # the content run resumed, no fresh listing


@pytest.mark.usefixtures("no_inline")  # (a run that comes whole cleans itself)
def test_a_dry_run_after_a_stopped_dry_run_lists_the_workspace_as_it_is_now(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run stopped while its listing streams leaves its journal (no ``done`` yet)
    and its listing staged; the next dry run must list afresh, not resume that listing
    (it would preview the workspace as it was), and its cleanup takes the old one too.
    A red-team review found the resume."""
    out = tmp_path / "out"
    run_pull(local(), workspace, out, options(tmp_path))
    _stopped_while_loading(tmp_path, workspace, monkeypatch, lambda: True, dry_run=True)
    assert _staged(tmp_path)  # the stopped dry run's listing
    assert not list((tmp_path / "state/pulls").glob("*/phase-manifest/done.json"))
    (workspace / "added-after-the-stop.txt").write_text("new\n")
    preview = run_pull(local(), workspace, out, options(tmp_path, dry_run=True))
    assert not preview.reconciled
    assert any(line.endswith("added-after-the-stop.txt") for line in preview.changes)
    assert _staged(tmp_path) == []
    assert list((tmp_path / "state/pulls").iterdir()) == []


@pytest.mark.usefixtures("no_inline")  # (a run that comes whole cleans itself)
@pytest.mark.parametrize("keep", [False, True], ids=["default", "keep-staging"])
@pytest.mark.parametrize("pull_kind", ["first", "changed", "unchanged"])
def test_the_manifests_staging_goes_with_the_content_runs_in_one_last_call(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch, keep: bool, pull_kind: str
) -> None:
    """Nothing runs beside the call after the listing (a first pull's admission, an
    incremental pull's list upload): a removal of the listing's staging there made that
    call wait for its helper (or open another), a round trip on a remote backend.  Every
    run's staging goes in the pull's last cleanup, one call, the listing's alone where
    nothing changed.  With --keep-staging the content run's stays, and the listing's goes
    as soon as its stream is in, as before."""
    dest = tmp_path / "out"
    if pull_kind != "first":
        run_pull(local(), workspace, dest, options(tmp_path))
    if pull_kind == "changed":
        (workspace / "added.txt").write_text("new\n")
    real = GuestSession.cleanup
    calls: list[tuple[str, ...]] = []
    finishing: list[bool] = []  # whether each call came in the pull's last cleanup
    finish = _Pull.finish

    async def cleanup(session: GuestSession, *snapshots: str) -> None:
        calls.append(snapshots or (session.snapshot,))
        finishing.append(bool(in_finish))
        await real(session, *snapshots)

    in_finish: list[bool] = []

    async def finishing_now(runner: _Pull, old: str | None) -> None:
        in_finish.append(True)
        await finish(runner, old)

    monkeypatch.setattr(GuestSession, "cleanup", cleanup)
    monkeypatch.setattr(_Pull, "finish", finishing_now)
    result = run_pull(local(), workspace, dest, options(tmp_path, keep_staging=keep))
    assert result.ok and not result.warnings, result.warnings
    assert_exact(workspace, dest)
    staged = sorted(p.name for p in (tmp_path / "staging").iterdir() if p.name.startswith("s"))
    runs = 1 if pull_kind == "unchanged" else 2
    assert len(calls) == 1 and len(calls[0]) == (1 if keep else runs), calls
    assert finishing == [not keep]  # with --keep-staging, the listing's went at once
    if keep and runs == 2:  # the content run's, kept; the manifest's went
        assert len(staged) == 1 and staged[0] not in calls[0]
    else:
        assert staged == []


@pytest.mark.usefixtures("no_inline")  # (a run that comes whole cleans itself)
def test_a_first_pull_that_fails_for_good_removes_both_runs_staging(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure that the same snapshot would repeat discards it at once (the guest's
    disk may be what failed): the manifest's staging, left for the last cleanup, goes in
    the same call."""
    calls = counting_cleanups(monkeypatch)
    real_admit = GuestSession.admit

    async def admit(self: GuestSession, *args: Any, **kwargs: Any) -> bool:
        answer = await real_admit(self, *args, **kwargs)
        if kwargs.get("mode", "tar") == "tar":
            raise StagingFailed("the guest's disk is full (test)")
        return answer

    monkeypatch.setattr(GuestSession, "admit", admit)
    with pytest.raises(StagingFailed):
        run_pull(local(), workspace, tmp_path / "out", options(tmp_path))
    assert len(calls) == 1 and len(calls[0]) == 2, calls
    assert [p.name for p in (tmp_path / "staging").iterdir() if p.name.startswith("s")] == []


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


@pytest.mark.usefixtures("no_inline")  # (a run that comes whole cleans itself)
@pytest.mark.parametrize("where", ["diff", "apply", "upload"])
def test_a_pull_over_a_baseline_stopped_after_its_listing_leaves_no_staging_after_its_rerun(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A host failure after the listing, before a content run is journaled after it (in
    the diff, in an apply-only pull's directory metadata) or after (the list's upload):
    the listing's staging stays in the guest, left for a last cleanup that never came,
    and the rerun (which lists afresh, or replays it) names it in its own."""
    from wsync.errors import HostIOError

    dest = tmp_path / "out"
    assert run_pull(local(), workspace, dest, options(tmp_path)).ok
    if where == "apply":
        next(workspace.rglob("*.txt")).unlink()  # a deletion only: no content run
    else:
        (workspace / "added.txt").write_text("new\n")
    failed: list[bool] = []

    def once(real: Callable[..., Any]) -> Callable[..., Any]:
        def fail(*args: Any, **kwargs: Any) -> Any:
            if not failed:
                failed.append(True)
                raise HostIOError("a host failure (test)")
            return real(*args, **kwargs)

        return fail

    if where == "diff":
        monkeypatch.setattr(Incremental, "decide", once(Incremental.decide))
    elif where == "apply":
        monkeypatch.setattr(Incremental, "dir_meta", once(Incremental.dir_meta))
    else:
        upload = GuestSession.upload_list

        async def upload_once(session: GuestSession, *args: Any, **kwargs: Any) -> None:
            once(lambda: None)()
            await upload(session, *args, **kwargs)

        monkeypatch.setattr(GuestSession, "upload_list", upload_once)
    with pytest.raises(HostIOError):
        run_pull(local(), workspace, dest, options(tmp_path))
    assert _staged(tmp_path)  # the listing's
    result = run_pull(local(), workspace, dest, options(tmp_path))
    assert result.ok and result.mode == "incremental"
    assert_exact(workspace, dest)
    assert _staged(tmp_path) == []
