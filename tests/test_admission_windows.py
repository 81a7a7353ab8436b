"""An admission killed part-way, at each window, and a retried or later admission.

A backend that gives up on a command kills its whole process group (Daytona's 408,
daytonaio/daytona#5144; the local transport on a deadline).  When that lands on the
admission after ``launch/`` was created but before the producer detached (``setsid``),
nothing runs and nothing will: the retry of the same run must start the producer
again, not answer ``admitted`` over an empty snapshot (the ``the guest producer died
without a result`` failure, exit 5, seen once with the Daytona emulator's faults on).

Each window is hit exactly, with the guest's ``setsid`` shimmed in front of the real one
that kills the admission's process group at that point, as the backend would.  Under
dash and a busybox guest.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import os
import shutil
import signal
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ProcessWatch
from helpers import assert_exact, guest_shell_path, make_tree, options, run_pull
from test_staging_security import _slow_tar
from wsync.emulators.daytona import DaytonaEmulatorThread, DaytonaFaults
from wsync.engine.guest import GuestSession
from wsync.engine.guestcall import CallStats
from wsync.engine.pull import pull_uri
from wsync.protocol import records, scripts
from wsync.transports.local import LocalTransport

KiB = 1024

#: wait (at most ~20 s) for a file ($w, or $w2 when set), then SIGKILL our own
#: process group: the admission's shell and every child still in it, as a backend's
#: timeout does
_KILL_WHEN = """
i=0
while [ ! -s "$w" ] && [ ! -s "${{w2:-$w}}" ] && [ $i -lt 2000 ]; do
  {sleep} 0.01
  i=$((i + 1))
done
kill -KILL 0
"""

#: ``setsid sh PRODUCER DIR ...``: $3 is the snapshot directory
_SETSID = """#!/bin/sh
if [ ! -e {mark} ]; then
  : > {mark}
  w=$3/{wait} w2=$3/pid
  {kill}
fi
exec {real} "$@"
"""

#: ``setsid sh PRODUCER DIR ...`` the first time: the producer starts in its own session
#: (this shim's child), and once it has indexed a chunk the admission's group is killed.
#: The admission cannot have answered by then: it waits for its launch (this shim) to
#: detach or end, up to 10 s; the mark says the kill came while the index was there
_DETACHED = """#!/bin/sh
if [ ! -e {mark}.started ]; then
  : > {mark}.started
  {real} "$@" </dev/null >/dev/null 2>&1 &
  i=0
  while [ ! -s "$3/index" ] && [ $i -lt 500 ]; do
    {sleep} 0.01
    i=$((i + 1))
  done
  [ -s "$3/index" ] && : > {mark}
  kill -KILL 0
fi
exec {real} "$@"
"""


def shim(bindir: Path, tool: str, text: str, path: str, mark: Path, wait: str = "") -> None:
    """Put ``tool`` in ``bindir`` in front of the real one found on ``path``."""
    real = shutil.which(tool, path=path)
    sleep = shutil.which("sleep")
    assert real and sleep
    kill = _KILL_WHEN.format(sleep=sleep)
    if not wait:  # kill at once
        kill = "kill -KILL 0"
    script = text.format(mark=mark, wait=wait, kill=kill, real=real, sleep=sleep)
    (bindir / tool).write_text(script)
    (bindir / tool).chmod(0o755)


@pytest.fixture(params=["dash", "busybox"])
def guest_path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return guest_shell_path(request.param, tmp_path / "tools")


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A process of ours that is no producer: what a reused pid names."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "ws", big=300 * KiB, small=10)


def shimmed_env(tmp_path: Path, path: str, tool: str, text: str, wait: str = "") -> dict[str, str]:
    bindir = tmp_path / "shim"
    bindir.mkdir()
    shim(bindir, tool, text, path, tmp_path / "killed", wait)
    return {"PATH": f"{bindir}:{path}", "HOME": str(tmp_path)}


# -- the windows, through a whole pull --------------------------------------------


@pytest.mark.parametrize(
    "tool, text, wait",
    [
        # launch/ and launch/by written, the producer not yet detached (it dies too)
        ("setsid", _SETSID, ""),
        # the launch's pid recorded, the producer not yet detached: nothing written
        ("setsid", _SETSID, "pid.launch"),
    ],
    ids=["before-detach", "pid-recorded"],
)
def test_an_admission_killed_before_the_producer_detached_is_relaunched(
    tmp_path: Path, workspace: Path, guest_path: str, tool: str, text: str, wait: str
) -> None:
    env = shimmed_env(tmp_path, guest_path, tool, text, wait)
    dest = tmp_path / "out"
    run_pull(LocalTransport(env=env), workspace, dest, options(tmp_path))
    assert (tmp_path / "killed").exists()  # the window was really hit
    assert_exact(workspace, dest)


def test_a_detached_producer_survives_the_admissions_kill(
    tmp_path: Path, workspace: Path, guest_path: str
) -> None:
    """Killed once the producer is writing, before the answer: the producer (its own
    session) lives on, and the retry adopts it rather than starting a second one."""
    env = shimmed_env(tmp_path, guest_path, "setsid", _DETACHED, wait="x")
    dest = tmp_path / "out"
    opts = options(tmp_path, keep_staging=True)
    run_pull(LocalTransport(env=env), workspace, dest, opts)
    assert (tmp_path / "killed").exists()
    assert_exact(workspace, dest)
    # one producer claimed the snapshot: the one started before the kill
    (snap,) = (p for p in (tmp_path / "staging").iterdir() if p.name.startswith("s"))
    assert sorted(p.name for p in snap.glob("lock.*")) == ["lock.1"]


#: the producer's install removes its parts after the join: killed after the first rm
_RM = """#!/bin/sh
{real} "$@"
case $* in
  *.part*)
    if [ ! -e {mark} ]; then
      : > {mark}
      {kill}
    fi ;;
esac
"""


def test_an_install_killed_while_removing_its_parts_is_retried(
    tmp_path: Path, workspace: Path, guest_path: str
) -> None:
    """The install's last call joins the parts, moves the producer into place and
    removes the parts; killed between two removals, its retry must not try to join
    again from what is left (it answered "cannot write the producer script")."""
    env = shimmed_env(tmp_path, guest_path, "rm", _RM)
    dest = tmp_path / "out"
    run_pull(LocalTransport(env=env), workspace, dest, options(tmp_path))
    assert (tmp_path / "killed").exists()
    assert_exact(workspace, dest)


def test_a_daytona_admission_killed_before_the_producer_detached_is_relaunched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same window through the Daytona emulator, whose shells inherit its PATH."""
    env = shimmed_env(tmp_path, os.environ["PATH"], "setsid", _SETSID)
    monkeypatch.setenv("PATH", env["PATH"])
    with DaytonaEmulatorThread(tmp_path / "daytona") as emu:
        emu.set_faults(DaytonaFaults.off())
        ws = make_tree(emu.create_sandbox("win") / "work", big=200 * KiB, small=5)
        dest = tmp_path / "out"
        asyncio.run(
            pull_uri(f"daytona://win{ws}", dest, options(tmp_path), emu.transport_options())
        )
    assert (tmp_path / "killed").exists()
    assert_exact(ws, dest)


# -- the guest scripts by hand: a snapshot left in each state ----------------------


async def _session(env: dict[str, str], tmp_path: Path, ws: Path) -> tuple[GuestSession, str]:
    session = GuestSession(LocalTransport(env=env), options(tmp_path), CallStats())
    plan = await session.probe(str(ws))
    return session, plan.compressor


async def _finished(session: GuestSession) -> records.StatusReport:
    for _ in range(1200):
        status = await session.status()
        if status.done is not None or status.failed is not None:
            return status
        await asyncio.sleep(0.05)
    raise AssertionError("the producer never finished")


def _generations(snap: Path) -> list[str]:
    return sorted(p.name for p in snap.glob("lock.*"))


#: ``setsid``, slow to start: the launch stays in the admission's process group a while
_SLOW_SETSID = """#!/bin/sh
sleep 0.5
exec {real} "$@"
"""


@pytest.mark.parametrize("status_wait", [None, 0.005], ids=["plain", "carried-status"])
def test_the_admission_answers_only_once_its_producer_detached(
    tmp_path: Path, workspace: Path, guest_path: str, status_wait: float | None
) -> None:
    """A backend may kill the admission's process group as soon as it answers: the
    answer waits for the producer's own pid record (it has left the group by then),
    also where the answer carries a first status that gave up looking long before
    (one look, 5 ms, where the launch takes half a second to detach)."""
    env = shimmed_env(tmp_path, guest_path, "setsid", _SLOW_SETSID)

    async def go() -> None:
        session, comp = await _session(env, tmp_path, workspace)
        assert not await session.admit("s-slow", str(workspace), comp, status_wait=status_wait)
        snap = Path(session.staging_root, "s-slow")
        assert (snap / "pid").read_text().strip() == (snap / "pid.launch").read_text().strip()
        if status_wait is not None:
            assert session.first_status is not None  # the status came along
        status = await _finished(session)
        assert status.done is not None and status.failed is None
        await session.cleanup()

    asyncio.run(go())


def test_a_later_run_restarts_a_snapshot_whose_producer_died_mid_stream(
    tmp_path: Path, workspace: Path, guest_path: str, procs: ProcessWatch
) -> None:
    """Another run's snapshot, its producer killed part-way (a partial stream, no
    record): adopting it would wait on a corpse, so it is launched again, answered
    ``admitted`` (a new stream: the adopter's journaled chunks are worthless), and
    the dead generation's leftovers are gone from the new stream."""
    arg = procs.sleep_arg(300)
    env = {"PATH": guest_path, "HOME": str(tmp_path)}
    slow = _slow_tar(tmp_path, arg, env)

    async def go() -> None:
        first, comp = await _session(slow, tmp_path, workspace)
        assert not await first.admit("s-died", str(workspace), comp)
        snap = Path(first.staging_root, "s-died")
        assert procs.wait_present(arg, timeout=30)
        pid = int((snap / "pid").read_text())
        os.killpg(pid, signal.SIGKILL)  # the producer and its pipeline
        assert procs.wait_gone(arg, timeout=30) == []
        (snap / "tar.err").write_text("tar: stale complaint of the dead run\n")
        assert not (snap / "done").exists() and not (snap / "failed").exists()
        later, comp = await _session(env, tmp_path, workspace)
        assert not await later.admit("s-died", str(workspace), comp)  # not adopted
        status = await _finished(later)
        assert status.done is not None and status.failed is None
        assert "stale" not in status.tar_errors
        assert _generations(snap) == ["lock.1", "lock.2"]
        # and a third run adopts the finished snapshot as it is
        third, comp = await _session(env, tmp_path, workspace)
        assert await third.admit("s-died", str(workspace), comp)
        assert _generations(snap) == ["lock.1", "lock.2"]
        await third.cleanup()

    asyncio.run(go())


def test_a_live_producer_is_adopted_never_doubled_and_a_reused_pid_is_not_one(
    tmp_path: Path,
    workspace: Path,
    guest_path: str,
    procs: ProcessWatch,
    stranger: subprocess.Popen[bytes],
) -> None:
    arg = procs.sleep_arg(300)
    env = {"PATH": guest_path, "HOME": str(tmp_path)}
    slow = _slow_tar(tmp_path, arg, env)

    async def go() -> None:
        first, comp = await _session(slow, tmp_path, workspace)
        assert not await first.admit("s-live", str(workspace), comp)
        snap = Path(first.staging_root, "s-live")
        assert procs.wait_present(arg, timeout=30)
        # another run, and this run again: the running producer is adopted as it is
        other, comp = await _session(slow, tmp_path, workspace)
        assert await other.admit("s-live", str(workspace), comp)
        assert not await first.admit("s-live", str(workspace), comp)
        assert _generations(snap) == ["lock.1"]
        assert len(set(procs.pids(arg))) == 1  # one producer's tar, still sleeping
        status = await first.status()
        assert status.alive
        # the producer dies and its pid now names some other process of ours
        pid = int((snap / "pid").read_text())
        os.killpg(pid, signal.SIGKILL)
        assert procs.wait_gone(arg, timeout=30) == []
        for name in ("pid", "pid.launch", "lock.1/pid"):
            (snap / name).write_text(f"{stranger.pid}\n")
        assert not (await first.status()).alive
        again, comp = await _session(env, tmp_path, workspace)
        assert not await again.admit("s-live", str(workspace), comp)
        status = await _finished(again)
        assert status.done is not None
        assert stranger.poll() is None  # never signalled
        await again.cleanup()

    asyncio.run(go())


def test_a_dead_producers_pid_taken_by_another_snapshots_producer_is_not_busy(
    tmp_path: Path, workspace: Path, guest_path: str, procs: ProcessWatch
) -> None:
    """A producer dies without a result and its pid is taken by the producer of another
    snapshot (a sandbox whose pid namespace restarted with its staging kept): that
    process runs wsync's producer, but not on this snapshot.  The status says nothing
    runs and an admission starts the snapshot again, where both read the other
    snapshot's producer as this one's: the pull waited for it to end, or for its
    ``--timeout``.  The other producer is never signalled."""
    arg = procs.sleep_arg(300)
    env = {"PATH": guest_path, "HOME": str(tmp_path)}
    slow = _slow_tar(tmp_path, arg, env)

    async def go() -> None:
        other, comp = await _session(slow, tmp_path, workspace)
        assert not await other.admit("s-other", str(workspace), comp)
        assert procs.wait_present(arg, timeout=30)
        first, comp = await _session(slow, tmp_path, workspace)
        assert not await first.admit("s-dead", str(workspace), comp)
        snap = Path(first.staging_root, "s-dead")
        for _ in range(600):
            if len(procs.pids(arg)) == 2 and (snap / "pid").exists():
                break
            await asyncio.sleep(0.05)
        assert len(procs.pids(arg)) == 2
        os.killpg(int((snap / "pid").read_text()), signal.SIGKILL)
        for _ in range(600):
            if len(procs.pids(arg)) == 1:
                break
            await asyncio.sleep(0.05)
        assert len(procs.pids(arg)) == 1
        taken = int((snap.parent / "s-other" / "pid").read_text())
        for name in ("pid", "pid.launch", "lock.1/pid"):
            (snap / name).write_text(f"{taken}\n")
        assert not (await first.status()).alive
        again, comp = await _session(env, tmp_path, workspace)
        assert not await again.admit("s-dead", str(workspace), comp)  # started again
        status = await _finished(again)
        assert status.done is not None and status.failed is None
        assert _generations(snap) == ["lock.1", "lock.2"]
        await again.cleanup()
        assert len(procs.pids(arg)) == 1  # the other snapshot's producer runs on
        assert (await other.status()).alive
        await other.cleanup()

    asyncio.run(go())


def test_concurrent_relaunches_start_one_producer(
    tmp_path: Path, workspace: Path, guest_path: str
) -> None:
    """A launched snapshot with nothing running, admitted by several runs at once
    (retries overlapping an abandoned attempt do that): one new generation, one
    stream, and it is whole."""
    env = {"PATH": guest_path, "HOME": str(tmp_path)}

    async def go() -> None:
        sessions = [(await _session(env, tmp_path, workspace))[0] for _ in range(6)]
        comp = (await sessions[0].probe(str(workspace))).compressor
        root = Path(sessions[0].staging_root)
        # the state the killed admission leaves: launch/ and its token, nothing else
        await sessions[0].install_producer()
        snap = root / "s-idle"
        (snap / "launch").mkdir(parents=True)
        (snap / "launch" / "by").write_text("0123456789abcdef")
        (snap / "launch" / "size").write_text("1 1")
        answers = await asyncio.gather(*(s.admit("s-idle", str(workspace), comp) for s in sessions))
        # one relaunched (a new stream); the others adopted its launch, or relaunched
        # too and lost the producer's claim: one generation either way
        assert not all(answers)
        status = await _finished(sessions[0])
        assert status.done is not None and status.failed is None
        assert _generations(snap) == ["lock.1"]
        await sessions[0].cleanup()

    asyncio.run(go())


def test_producers_started_at_once_write_one_stream(
    tmp_path: Path, workspace: Path, guest_path: str
) -> None:
    """The claim itself: producers launched on one snapshot at the same moment (as
    overlapping relaunches can) leave one generation and one whole stream."""
    env = {"PATH": guest_path, "HOME": str(tmp_path)}

    async def install() -> Path:
        session, _ = await _session(env, tmp_path, workspace)
        await session.install_producer()
        return Path(session.staging_root)

    root = asyncio.run(install())
    snap = root / "s-race"
    (snap / "launch").mkdir(parents=True)
    argv = ["sh", str(root / scripts.PRODUCER_NAME), str(snap), str(workspace)]
    argv += [str(scripts.BLOCK), "sha256", "gzip:1", "tar", scripts.NONE]
    racers = [subprocess.Popen(argv, env=env, start_new_session=True) for _ in range(8)]
    for racer in racers:
        racer.wait(timeout=120)
    assert (snap / "done").exists() and not (snap / "failed").exists()
    assert _generations(snap) == ["lock.1"]
    done = dict(line.split(" ", 1) for line in (snap / "done").read_text().splitlines())
    data = (snap / "data").read_bytes()
    assert int(done["length"]) == len(data)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as archive:
        names = archive.getnames()
    assert "./blob.bin" in names and "./src/deep/er/est/leaf" in names
