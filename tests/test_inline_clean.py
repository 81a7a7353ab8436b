"""A run whose finished stream comes whole with its admission cleans its own staging.

An admission that carries the first status also carries the finished stream of a small run
(``data_b64``); asked to (``clean``: the probe saw the guest's ``base64`` encode its text
right), it then removes the snapshot's staging and says so, and the pull makes no cleanup
call for it: a small first pull is three guest calls instead of four, a pull that finds
nothing changed two instead of three (a round trip of 0.1-0.3 s each on the HTTP
backends).  The host checks every chunk of such a stream against the index the same
answer carried; one that does not match is the guest contradicting itself (the answer was
verified whole), and with nothing left to read the pull fails clearly.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from helpers import (
    assert_exact,
    counting_cleanups,
    guest_shell_path,
    local,
    make_tree,
    options,
    run_pull,
    writer_around_tar,
)
from test_pull_local import _LYING_BASE64, _shimmed
from wsync.engine.guest import GuestSession
from wsync.engine.guestcall import CallStats
from wsync.errors import StagingFailed, UnstableFiles
from wsync.protocol import records, scripts
from wsync.transports.local import LocalTransport

KiB = 1024


@pytest.fixture(params=["dash", "busybox"])
def guest_path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return guest_shell_path(request.param, tmp_path / "tools")


def _staged(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "staging").iterdir() if p.name.startswith("s"))


def _pulled(tmp_path: Path) -> tuple[Path, Path]:
    """A small workspace and the DEST a first pull made of it."""
    ws = make_tree(tmp_path / "ws", big=2 * KiB, small=3)
    dest = tmp_path / "out"
    run_pull(local(), ws, dest, options(tmp_path))
    return ws, dest


@pytest.mark.parametrize("clean", [True, False], ids=["clean", "keep"])
def test_an_admission_removes_the_staging_of_a_stream_it_carried_whole(
    tmp_path: Path, guest_path: str, clean: bool
) -> None:
    small = make_tree(tmp_path / "small", big=2 * KiB, small=3)
    env = {"PATH": guest_path, "HOME": str(tmp_path)}

    async def go(snapshot: str) -> records.StatusReport | None:
        session = GuestSession(LocalTransport(env=env), options(tmp_path), CallStats())
        plan = await session.probe(str(small))
        await session.admit(snapshot, str(small), plan.compressor, status_wait=5.0, clean=clean)
        return session.first_status

    # the long poll answers once the index grows, waiting 10 ms at most for the done
    # record after the producer's last steps began: on a loaded machine (a CI run beside
    # other tests) they can take longer, and the stream then comes in reads, as a big
    # one does.  A few admissions: at least one must carry it whole
    for attempt in range(5):
        snapshot = f"s-small-{attempt}"
        status = asyncio.run(go(snapshot))
        assert status is not None
        if status.done is not None:
            break
        assert status.inline is None and not status.cleaned  # not whole: nothing removed
        assert (tmp_path / "staging" / snapshot).is_dir()
    assert status.done is not None and status.inline is not None
    assert len(status.inline) == status.done.length
    assert status.cleaned is clean
    assert (Path(tmp_path / "staging" / snapshot).exists()) is not clean


def test_a_stream_too_big_to_come_whole_keeps_its_staging(tmp_path: Path) -> None:
    big = make_tree(tmp_path / "big", big=2 * scripts.STATUS_INLINE_MAX, small=3)

    async def go() -> records.StatusReport | None:
        session = GuestSession(local(), options(tmp_path), CallStats())
        plan = await session.probe(str(big))
        await session.admit("s-big", str(big), plan.compressor, status_wait=5.0, clean=True)
        return session.first_status

    status = asyncio.run(go())
    assert status is not None and status.inline is None and not status.cleaned
    assert (tmp_path / "staging" / "s-big" / "data").is_file()


def test_a_small_pull_makes_no_cleanup_call_and_leaves_no_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = make_tree(tmp_path / "ws", big=2 * KiB, small=3)
    dest = tmp_path / "out"
    calls = counting_cleanups(monkeypatch)
    opts = options(tmp_path, helpers=False)  # one exec per call: execs count the calls
    first = run_pull(local(), ws, dest, opts)
    assert first.ok and first.mode == "full" and not first.warnings, first.warnings
    assert_exact(ws, dest)
    (ws / "src" / "f1.txt").write_text("changed\n")
    second = run_pull(local(), ws, dest, opts)
    assert second.ok and second.mode == "incremental" and second.changed_files == 1
    assert_exact(ws, dest)
    third = run_pull(local(), ws, dest, opts)  # nothing changed
    assert third.ok and third.changed_files == 0 and not third.warnings
    assert calls == [] and _staged(tmp_path) == []
    # probe and two admissions (the producer installed once, by the first); probe and one
    assert (third.execs, second.execs) == (2, 4)  # the list's upload is the second's fourth


def test_keep_staging_keeps_a_small_runs_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The content run's staging stays for the operator to look at (the listing's goes
    beside the diff, as for any run)."""
    ws = make_tree(tmp_path / "ws", big=2 * KiB, small=3)
    calls = counting_cleanups(monkeypatch)
    result = run_pull(local(), ws, tmp_path / "out", options(tmp_path, keep_staging=True))
    assert result.ok
    assert _staged(tmp_path) == [result.snapshot]
    assert len(calls) == 1 and result.snapshot not in calls[0], calls


def test_a_stream_that_is_not_its_index_after_its_staging_went_starts_the_pull_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer's envelope verified, so the guest's base64 encoded other bytes than the
    stream (right on the probe's text, wrong here) and its staging is gone: the pull
    starts afresh once, its admissions removing nothing, reads what the copies get wrong
    and ends exact, with a warning."""
    ws = make_tree(tmp_path / "ws", big=2 * KiB, small=3)
    real = records._inline

    def lying(text: str | None, size: int) -> bytes | None:
        data = real(text, size)
        return None if data is None else bytes(b ^ 0xFF for b in data)

    monkeypatch.setattr(records, "_inline", lying)
    dest = tmp_path / "out"
    result = run_pull(local(), ws, dest, options(tmp_path))
    assert result.ok and result.faults.get("chunk-hash-mismatch", 0) >= 2, result.faults
    assert_exact(ws, dest)
    assert any("staging was lost" in w for w in result.warnings), result.warnings
    assert _staged(tmp_path) == []


def test_a_list_whose_staging_went_before_its_admission_is_uploaded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed run's admission may still be removing a snapshot it carried whole while
    the rerun uploads that snapshot's list again (the upload sees it launched and keeps
    it); the admission then finds no list: the list goes up once more, and the pull ends
    exact rather than failing the run."""
    ws, dest = _pulled(tmp_path)
    (ws / "src" / "f2.txt").write_text("changed\n")
    real = GuestSession.upload_list
    uploads: list[str] = []

    async def upload_then_lose(session: GuestSession, snapshot: str, data: bytes) -> None:
        await real(session, snapshot, data)
        uploads.append(snapshot)
        if len(uploads) == 1:  # the staging goes, as that late removal would take it
            shutil.rmtree(Path(session.staging_root, snapshot))

    monkeypatch.setattr(GuestSession, "upload_list", upload_then_lose)
    result = run_pull(local(), ws, dest, options(tmp_path))
    assert result.ok and result.changed_files == 1, result
    assert_exact(ws, dest)
    assert len(uploads) == 2 and uploads[0] == uploads[1]


def test_a_guest_whose_base64_lies_keeps_its_staging_and_the_pull_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's own text, encoded wrong: no run cleans itself, the copies that come
    whole fail their hashes and are read from the staging, and the pull is exact."""
    ws = make_tree(tmp_path / "ws", big=2 * KiB, small=3)
    env = _shimmed(tmp_path, "base64", _LYING_BASE64)

    async def probe() -> bool:
        session = GuestSession(LocalTransport(env=env), options(tmp_path), CallStats())
        return (await session.probe(str(ws))).probe.has("base64_exact")

    assert not asyncio.run(probe())
    calls = counting_cleanups(monkeypatch)
    result = run_pull(LocalTransport(env=env), ws, tmp_path / "out", options(tmp_path))
    assert result.ok and result.faults.get("chunk-hash-mismatch", 0) >= 1, result.faults
    assert_exact(ws, tmp_path / "out")
    assert len(calls) == 1 and _staged(tmp_path) == []


def test_a_snapshot_removed_under_a_retried_admission_starts_the_pull_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An admission given up on at its deadline goes on in the guest and may remove the
    staging of the stream it carried while the retry of that admission, which adopted
    the same snapshot, still reads it: the snapshot is gone for this pull.  It starts
    afresh once, its admissions no longer asking for that, and ends exact."""
    ws = make_tree(tmp_path / "ws", big=2 * KiB, small=3)
    real = GuestSession.admit
    vanished: list[str] = []

    async def admit(self: GuestSession, snapshot: str, *args: Any, **kwargs: Any) -> bool:
        adopted = await real(self, snapshot, *args, **kwargs)
        if kwargs.get("mode", "tar") == "tar" and not vanished:
            # the retry's answer (a status before the stream was done), then the late
            # removal by the attempt given up on
            vanished.append(snapshot)
            self.first_status = None
            shutil.rmtree(Path(self.staging_root, snapshot), ignore_errors=True)
        return adopted

    monkeypatch.setattr(GuestSession, "admit", admit)
    calls = counting_cleanups(monkeypatch)
    result = run_pull(local(), ws, tmp_path / "out", options(tmp_path))
    assert result.ok and vanished, result
    assert_exact(ws, tmp_path / "out")
    assert any("staging was lost" in w for w in result.warnings), result.warnings
    # the vanished run discarded; the fresh start's two runs kept their staging for the
    # pull's last cleanup
    assert [len(c) for c in calls] == [1, 2] and _staged(tmp_path) == []


# a mkdir that, once armed, lets the given-up attempt's removal land right after the
# retry's ``mkdir -p "$d"`` (the carrying admission renames the snapshot away first)
_MKDIR_THEN_LOST = """#!/bin/sh
{real} "$@"
rc=$?
if [ "$1" = -p ] && [ -e {arm} ]; then
  case $2 in */s*) rm -f {arm}; mv "$2" "$2.lost" ;; esac
fi
exit $rc
"""


def test_a_snapshot_removed_inside_a_retried_admission_starts_the_pull_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race as above, landing inside the retry: between its ``mkdir -p`` of the
    snapshot and its admission token.  The token cannot be written ("token-failed"),
    which was a plain staging failure, so the pull failed where it starts afresh when the
    removal lands a moment later.  (Found by a review of the guest scripts' races.)"""
    ws = make_tree(tmp_path / "ws", big=2 * KiB, small=3)
    shims, arm = tmp_path / "shims", tmp_path / "arm"
    shims.mkdir()
    mkdir = shims / "mkdir"
    mkdir.write_text(_MKDIR_THEN_LOST.format(real=shutil.which("mkdir"), arm=arm))
    mkdir.chmod(0o755)
    env = {"PATH": f"{shims}:{os.environ['PATH']}"}
    real = GuestSession.admit
    fired: list[str] = []

    async def admit(self: GuestSession, snapshot: str, *args: Any, **kwargs: Any) -> bool:
        if kwargs.get("mode", "tar") == "tar" and not fired:
            fired.append(snapshot)
            # the attempt given up on: launched, its producer done, its removal to come
            await real(self, snapshot, *args, **{**kwargs, "status_wait": None, "clean": False})
            for _ in range(600):
                if (await self.status(0, 1.0)).done is not None:
                    break
            arm.write_text("")
        return await real(self, snapshot, *args, **kwargs)

    monkeypatch.setattr(GuestSession, "admit", admit)
    result = run_pull(local(env), ws, tmp_path / "out", options(tmp_path))
    assert fired and not arm.exists()  # the removal landed inside the retry
    assert result.ok and any("staging was lost" in w for w in result.warnings), result
    assert_exact(ws, tmp_path / "out")


def test_a_small_run_with_a_gone_or_unstable_list_keeps_its_staging_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host reads a run's ``gone`` and ``unstable`` lists after its stream: a run that
    has one keeps its staging (and the pull's last cleanup takes it).  Here a changed file
    is deleted between the listing and the select run: DEST loses it, as the guest did."""
    ws, dest = _pulled(tmp_path)
    (ws / "src" / "f2.txt").write_text("changed\n")
    (ws / "src" / "f1.txt").write_text("changed too\n")
    real = GuestSession.upload_list

    async def upload_after_delete(session: GuestSession, snapshot: str, data: bytes) -> None:
        (ws / "src" / "f2.txt").unlink()
        await real(session, snapshot, data)

    monkeypatch.setattr(GuestSession, "upload_list", upload_after_delete)
    calls = counting_cleanups(monkeypatch)
    result = run_pull(local(), ws, dest, options(tmp_path))
    assert result.ok, result
    assert not (dest / "src" / "f2.txt").exists()
    assert (dest / "src" / "f1.txt").read_text() == "changed too\n"
    assert len(calls) == 1 and _staged(tmp_path) == []
    # (the deletion came after the listing, which gave src's mtime: the next pull has it)
    run_pull(local(), ws, dest, options(tmp_path))
    assert_exact(ws, dest)


@pytest.mark.parametrize("best_effort", [True, False], ids=["best-effort", "strict"])
def test_a_small_workspace_with_a_file_that_keeps_changing(
    tmp_path: Path, best_effort: bool
) -> None:
    """A log appended to all the time: never the same twice while read, so it is named
    unstable (exit 24), or taken as last read with ``--best-effort``: its list is read
    from the staging the run keeps.

    Besides the writer, every read of the guest's tar appends a line too: a loaded
    machine can starve the writer through a whole read of this small tree (twice in
    fresh-clone CI runs), and a log that did not change while read is rightly taken as
    it was."""
    ws = make_tree(tmp_path / "ws", big=2 * KiB, small=3)
    log = ws / "app.log"
    log.write_text("start\n")
    guest = writer_around_tar(tmp_path, 'echo "read $N" >> "$WS/app.log"\nreal_tar "$@"')
    writer = subprocess.Popen(
        ["sh", "-c", 'while :; do echo appended >> "$1"; done', "sh", str(log)],
        start_new_session=True,
    )
    try:
        opts = options(tmp_path, best_effort=best_effort)
        if best_effort:
            result = run_pull(guest, ws, tmp_path / "out", opts)
            assert result.ok and any("app.log" in f for f in result.unstable_files), result
        else:
            with pytest.raises(UnstableFiles, match=r"app\.log"):
                run_pull(guest, ws, tmp_path / "out", opts)
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait()


#: the status's first program after it read the ``done`` record (with the shell's read)
#: is the ``wc`` that measures the index (with no looks, as here: a look may run a ``wc``
#: of its own): the snapshot is renamed away right after it (an admission attempt given
#: up on, removing what it carried whole)
_WC_THEN_GONE = """#!/bin/sh
{real} "$@"
[ -e {snap}.gone ] || mv {snap} {snap}.gone
"""


def test_a_status_of_a_snapshot_removed_while_it_was_read_says_it_is_gone(
    tmp_path: Path, guest_path: str
) -> None:
    """Read half before, half after the rename: a torn answer (a ``done`` record and no
    index) would be a false integrity alarm; it says ``exists 0`` instead, which the pull
    takes for a snapshot gone (and starts afresh)."""
    small = make_tree(tmp_path / "small", big=2 * KiB, small=3)
    env = {"PATH": guest_path, "HOME": str(tmp_path)}

    async def finished() -> Path:
        session = GuestSession(LocalTransport(env=env), options(tmp_path), CallStats())
        plan = await session.probe(str(small))
        await session.admit("s-torn", str(small), plan.compressor, status_wait=5.0)
        for _ in range(600):  # (the admission's status may come before the end)
            if (await session.status(0, 1.0)).done is not None:
                return Path(session.staging_root)
        raise AssertionError("the producer never finished")

    root = asyncio.run(finished())
    shim = tmp_path / "shim"
    shim.mkdir()
    real = shutil.which("wc", path=guest_path)
    snap = shlex.quote(str(root / "s-torn"))
    (shim / "wc").write_text(_WC_THEN_GONE.format(real=real, snap=snap))
    (shim / "wc").chmod(0o755)
    argv = ["sh", str(root / scripts.PRODUCER_NAME), "--status", str(root / "s-torn")]
    answer = subprocess.run(
        [*argv, "0", "0", "0", "0"],
        env={"PATH": f"{shim}:{guest_path}"},
        capture_output=True,
        check=True,
    ).stdout
    assert (root / "s-torn.gone").is_dir()  # the rename really came in the middle
    assert answer == b"exists 0"


def _list_lost_after_upload(monkeypatch: pytest.MonkeyPatch, times: int | None) -> list[str]:
    """``upload_list`` leaves the end state of the race below after its first ``times``
    uploads (None: every one): the list gone, the snapshot launched.  Returns the snapshots
    that lost it."""
    real = GuestSession.upload_list
    lost: list[str] = []

    async def upload_then_lose(session: GuestSession, snapshot: str, data: bytes) -> None:
        await real(session, snapshot, data)
        if times is None or len(lost) < times:
            lost.append(snapshot)
            staged = Path(session.staging_root, snapshot)
            (staged / "list").unlink()
            (staged / "launch").mkdir()  # the end state of that race

    monkeypatch.setattr(GuestSession, "upload_list", upload_then_lose)
    return lost


def test_a_select_run_launched_without_its_list_fails_and_dest_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a rerun's admission passed the list check on a launched snapshot that was
    then removed and made again, a select producer starts with no list: it fails
    ("missing"), never archives nothing as if nothing changed."""
    ws, dest = _pulled(tmp_path)
    (ws / "src" / "f2.txt").write_text("changed, and longer than before\n")
    before = (dest / "src" / "f2.txt").read_bytes()
    _list_lost_after_upload(monkeypatch, None)
    with pytest.raises(StagingFailed, match="list of entries to archive is missing"):
        run_pull(local(), ws, dest, options(tmp_path))
    assert (dest / "src" / "f2.txt").read_bytes() == before
    monkeypatch.undo()
    assert run_pull(local(), ws, dest, options(tmp_path)).ok
    assert_exact(ws, dest)


def test_a_select_run_that_lost_its_list_once_starts_the_pull_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same end state once, as the race leaves it where the admission given up on
    removed the snapshot between the list check of its retry and that retry's ``mkdir``
    (found by a review of the guest scripts): the pull starts afresh, as where the
    snapshot was gone, and ends exact, instead of failing."""
    ws, dest = _pulled(tmp_path)
    (ws / "src" / "f2.txt").write_text("changed, and longer than before\n")
    lost = _list_lost_after_upload(monkeypatch, 1)
    result = run_pull(local(), ws, dest, options(tmp_path))
    assert lost and result.ok and result.mode == "incremental", result.error
    assert any("staging was lost" in w for w in result.warnings), result.warnings
    assert_exact(ws, dest)


def test_a_list_upload_refused_once_goes_up_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed run's admission renaming the snapshot away in the middle of the rerun's
    upload makes the guest refuse the list ("cannot write the list"): it is uploaded once
    more, and the pull ends exact."""
    ws, dest = _pulled(tmp_path)
    (ws / "src" / "f0.txt").write_text("changed\n")
    real = GuestSession.upload_list
    uploads: list[str] = []

    async def refused_once(session: GuestSession, snapshot: str, data: bytes) -> None:
        uploads.append(snapshot)
        if len(uploads) == 1:
            raise StagingFailed("uploading the list: cannot write the list")
        await real(session, snapshot, data)

    monkeypatch.setattr(GuestSession, "upload_list", refused_once)
    result = run_pull(local(), ws, dest, options(tmp_path))
    assert result.ok and result.changed_files == 1, result
    assert_exact(ws, dest)
    assert len(uploads) == 2
