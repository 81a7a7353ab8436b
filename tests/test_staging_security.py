"""Issue 7, items 1 and 13: the guest staging root is private to the pulling user.

Another user of the guest must not get code run (a planted producer script),
choose what gets killed (a planted ``pid`` file), or read or steer the archive
(a root they own, can write, or can swap).  A staging root that overlaps the
workspace is a usage error found before anything is written.  Each refusal is
checked under dash and under a busybox-only guest.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ProcessWatch
from helpers import BUSYBOX_APPLETS, assert_exact, busybox_bin, options, run_pull, tool_dir
from wsync.engine.api import PullOptions
from wsync.engine.guest import GuestSession
from wsync.engine.guestcall import CallStats
from wsync.errors import StagingFailed, UsageError, WsyncError
from wsync.protocol import callsh, scripts
from wsync.transports.local import LocalTransport

NOBODY = 65534


@pytest.fixture(params=["dash", "busybox"])
def guest(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str] | None:
    """The guest's environment: the host's tools (dash), or busybox applets only."""
    if request.param == "dash":
        return None
    return {"PATH": str(busybox_bin(tmp_path / "bb")), "HOME": str(tmp_path)}


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("hello\n")
    (ws / "sub").mkdir()
    (ws / "sub" / "b.bin").write_bytes(os.urandom(100_000))
    return ws


def planted_producer(root: Path, marker: Path) -> Path:
    """What another user would plant: a script that would run as the puller."""
    script = root / scripts.PRODUCER_NAME
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    return script


def pull(env: dict[str, str] | None, ws: Path, dest: Path, opts: PullOptions) -> None:
    run_pull(LocalTransport(env=env), ws, dest, opts)


# -- a planted producer is never run -------------------------------------------


def test_a_planted_producer_in_our_own_root_is_replaced_not_run(
    tmp_path: Path, workspace: Path, guest: dict[str, str] | None
) -> None:
    root = tmp_path / "staging"
    root.mkdir(mode=0o700)
    marker = tmp_path / "PWNED"
    planted_producer(root, marker)
    dest = tmp_path / "out"
    pull(guest, workspace, dest, options(tmp_path, staging_root=str(root)))
    assert not marker.exists()
    assert_exact(workspace, dest)
    # the installed producer is ours again
    assert (root / scripts.PRODUCER_NAME).read_text() == scripts.PRODUCER


@pytest.mark.parametrize("case", ["foreign-owner", "world-writable", "group-writable", "symlink"])
def test_an_unsafe_root_is_refused_naming_it(
    tmp_path: Path, workspace: Path, guest: dict[str, str] | None, case: str
) -> None:
    root = tmp_path / "staging"
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    marker = tmp_path / "PWNED"
    planted_producer(real, marker)
    if case == "symlink":
        root.symlink_to(real)
    else:
        real.rename(root)
    if case == "foreign-owner":
        os.chown(root, NOBODY, NOBODY)
        expect = r"owned by \S+ \(uid 65534\), not by the pulling user \(uid 0\)"
    elif case == "world-writable":
        os.chmod(root, 0o777)
        expect = r"writable by other users \(mode drwxrwxrwx"
    elif case == "group-writable":
        os.chmod(root, 0o770)
        expect = r"writable by other users \(mode drwxrwx---"
    else:
        expect = "is a symlink"
    dest = tmp_path / "out"
    with pytest.raises(StagingFailed, match=expect) as info:
        pull(guest, workspace, dest, options(tmp_path, staging_root=str(root)))
    assert info.value.exit_code == 5
    assert str(root) in str(info.value)
    assert not marker.exists() and not dest.exists()
    # nothing of ours was put into the refused root
    target = root.resolve()
    assert sorted(p.name for p in target.iterdir()) == [scripts.PRODUCER_NAME]


@pytest.mark.parametrize(
    ("parent_mode", "parent_owner", "refused"),
    [
        (0o777, 0, True),  # anyone may rename our root away and put theirs there
        (0o1777, 0, False),  # sticky, like /tmp: fine
        (0o755, NOBODY, True),  # another user owns a parent
        (0o755, 0, False),
    ],
)
def test_parents_of_the_root_are_checked_like_strictmodes(
    tmp_path: Path,
    workspace: Path,
    guest: dict[str, str] | None,
    parent_mode: int,
    parent_owner: int,
    refused: bool,
) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, parent_mode)
    os.chown(parent, parent_owner, parent_owner)
    root = parent / "mine" / "staging"
    dest = tmp_path / "out"
    opts = options(tmp_path, staging_root=str(root))
    if not refused:
        pull(guest, workspace, dest, opts)
        assert_exact(workspace, dest)
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert stat.S_IMODE((parent / "mine").stat().st_mode) == 0o700
        return
    with pytest.raises(StagingFailed, match=f"{parent}, a parent of the staging root") as info:
        pull(guest, workspace, dest, opts)
    assert info.value.exit_code == 5
    assert not (parent / "mine").exists()  # checked before anything was created


def test_the_default_root_is_per_user_and_private(
    tmp_path: Path, workspace: Path, guest: dict[str, str] | None
) -> None:
    """The default is ``/tmp/wsync-UID``, resolved in the guest; the journal keys
    on the configured (empty) value, so a resumed pull finds its snapshot."""

    async def probe() -> str:
        transport = LocalTransport(env=guest)
        try:
            session = GuestSession(transport, PullOptions(state_dir=tmp_path), CallStats())
            await session.probe(str(workspace))
            return session.staging_root
        finally:
            await transport.aclose()

    root = asyncio.run(probe())
    assert root == f"/tmp/wsync-{os.getuid()}"
    info = os.lstat(root)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
    assert stat.S_IMODE(info.st_mode) & 0o077 == 0
    assert PullOptions().staging_root == ""


def test_a_root_under_home_is_expanded_and_private(tmp_path: Path, workspace: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    dest = tmp_path / "out"
    pull(env, workspace, dest, options(tmp_path, staging_root="~/.cache/wsync"))
    assert_exact(workspace, dest)
    assert stat.S_IMODE((home / ".cache" / "wsync").stat().st_mode) == 0o700


# -- item 13: a staging root overlapping the workspace -------------------------


@pytest.mark.parametrize("case", ["inside", "equal", "contains", "via-symlink"])
def test_a_root_overlapping_the_workspace_is_a_usage_error(
    tmp_path: Path, workspace: Path, guest: dict[str, str] | None, case: str
) -> None:
    if case == "inside":
        root = workspace / "sub" / "stage" / "deeper"
    elif case == "equal":
        root = workspace
    elif case == "contains":
        root = tmp_path
    else:
        (tmp_path / "door").symlink_to(workspace)
        root = tmp_path / "door" / "stage"
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    dest = tmp_path / "out"
    with pytest.raises(UsageError, match="overlap") as info:
        pull(guest, workspace, dest, options(tmp_path, staging_root=str(root)))
    assert info.value.exit_code == 2
    assert "\n" not in str(info.value)
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert [p for p in after if p.parts[0] not in ("state", "bb")] == [
        p for p in before if p.parts[0] not in ("state", "bb")
    ]


@pytest.mark.parametrize("bad", ["relative/dir", "/tmp/../etc", "/tmp/./x", "/tmp/a\nb"])
def test_a_malformed_staging_dir_is_a_usage_error(bad: str) -> None:
    with pytest.raises(UsageError):
        scripts.check_staging_root(bad)
    assert scripts.check_staging_root("/tmp//x/") == "/tmp/x"
    assert scripts.check_staging_root("~/stage") == "~/stage"


# -- nothing read back from staging chooses what gets killed --------------------


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this user in a session of its own (its pid is its group):
    what a planted ``pid`` file would point at."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def stale_snapshot(root: Path, name: str, pid: str) -> Path:
    d = root / name
    (d / "launch").mkdir(parents=True)
    (d / "pid").write_text(pid + "\n")
    old = time.time() - 3 * 3600
    os.utime(d, (old, old))
    return d


def test_gc_does_not_kill_a_planted_pid(
    tmp_path: Path,
    workspace: Path,
    guest: dict[str, str] | None,
    bystander: subprocess.Popen[bytes],
) -> None:
    opts = options(tmp_path, staging_ttl=60)
    root = Path(opts.staging_root)
    root.mkdir(mode=0o700)
    stale = stale_snapshot(root, "s20200101-000000-0badf00d", str(bystander.pid))
    pull(guest, workspace, tmp_path / "out", opts)
    assert not stale.exists()  # the stale snapshot is still collected
    time.sleep(0.2)
    assert bystander.poll() is None, "a planted pid was killed"


def test_cleanup_does_not_kill_a_planted_pid(
    tmp_path: Path,
    workspace: Path,
    guest: dict[str, str] | None,
    bystander: subprocess.Popen[bytes],
) -> None:
    opts = options(tmp_path)

    async def go() -> None:
        transport = LocalTransport(env=guest)
        try:
            session = GuestSession(transport, opts, CallStats())
            plan = await session.probe(str(workspace))
            await session.admit("s-planted", str(workspace), plan.compressor)
            for _ in range(600):
                if (await session.status()).done:
                    break
                await asyncio.sleep(0.05)
            pid = Path(opts.staging_root, "s-planted", "pid")
            pid.write_text(f"{bystander.pid}\n")  # noqa: ASYNC240
            await session.cleanup()
        finally:
            await transport.aclose()

    asyncio.run(go())
    assert not (Path(opts.staging_root) / "s-planted").exists()
    time.sleep(0.2)
    assert bystander.poll() is None, "a planted pid was killed"


def _slow_tar(tmp_path: Path, arg: str, guest: dict[str, str] | None) -> dict[str, str]:
    """The guest's tar holds the producer running (``sleep ARG``) after archiving."""
    bindir = tmp_path / "slow-tar"
    bindir.mkdir()
    real = shutil.which("tar", path=(guest or os.environ)["PATH"])
    sleep = shutil.which("sleep")
    (bindir / "tar").write_text(
        f'#!/bin/sh\n{real} "$@"\ncase " $* " in *" -cf "*) exec {sleep} {arg} ;; esac\nexit 0\n'
    )
    (bindir / "tar").chmod(0o755)
    env = dict(guest or os.environ)
    env["PATH"] = f"{bindir}:{env['PATH']}"
    return env


def test_our_own_producer_is_still_stopped_by_cleanup_and_gc(
    tmp_path: Path, workspace: Path, guest: dict[str, str] | None, procs: ProcessWatch
) -> None:
    """The checks keep the real case working: wsync's producer, run by this
    user, is stopped when its snapshot is cleaned up or garbage-collected."""
    opts = options(tmp_path, staging_ttl=60)
    first, second = procs.sleep_arg(300), procs.sleep_arg(300)
    env = _slow_tar(tmp_path, first, guest)

    async def go() -> None:
        transport = LocalTransport(env=env)
        try:
            session = GuestSession(transport, opts, CallStats())
            plan = await session.probe(str(workspace))
            await session.admit("s-first", str(workspace), plan.compressor)
            assert procs.wait_present(first, timeout=30)
            # cleanup stops a live producer
            await session.cleanup()
            assert procs.wait_gone(first, timeout=30) == []
        finally:
            await transport.aclose()

    asyncio.run(go())
    shutil.rmtree(tmp_path / "slow-tar")
    env = _slow_tar(tmp_path, second, guest)

    async def gc() -> None:
        transport = LocalTransport(env=env)
        try:
            session = GuestSession(transport, opts, CallStats())
            plan = await session.probe(str(workspace))
            await session.admit("s-stale", str(workspace), plan.compressor)
            stale_pids = set(procs.wait_present(second, timeout=30))
            assert stale_pids
            stale = Path(session.staging_root, "s-stale")
            old = time.time() - 3 * 3600
            os.utime(stale, (old, old))
            # a pull collects once, at its first admission: its next leaves them
            await session.admit("s-same", str(workspace), plan.compressor)
            assert stale.exists()  # noqa: ASYNC240
            assert stale_pids <= set(procs.pids(second))
            await session.cleanup("s-same")
            # another pull's admission collects the stale one and its producer (the new
            # snapshot's own tar sleeps with the same argument)
            session = GuestSession(transport, opts, CallStats())
            plan = await session.probe(str(workspace))
            await session.admit("s-next", str(workspace), plan.compressor)
            for _ in range(600):
                if not stale_pids & set(procs.pids(second)):
                    break
                await asyncio.sleep(0.05)
            assert not stale_pids & set(procs.pids(second))
            assert not stale.exists()  # noqa: ASYNC240
            await session.cleanup()
        finally:
            await transport.aclose()

    asyncio.run(gc())


def test_only_our_producer_counts_as_killable(
    tmp_path: Path,
    workspace: Path,
    guest: dict[str, str] | None,
    procs: ProcessWatch,
    bystander: subprocess.Popen[bytes],
) -> None:
    """The guest's kill decision itself, asked about real processes: the live
    producer of that snapshot yes; pid 1, odd spellings, a process of ours that is not
    the producer, and the producer asked about as another snapshot's no.  (The producer
    also ends itself when its directory goes, so the tests above could not tell a kill
    from that.)  The last: a stale snapshot's pid file naming a pid that another pull's
    producer now holds (a sandbox whose pid namespace restarted, its staging kept) had
    that producer killed by the gc, and its pull failed."""
    arg = procs.sleep_arg(300)
    env = _slow_tar(tmp_path, arg, guest)
    opts = options(tmp_path)
    ask = callsh.compact(
        callsh.PRELUDE
        + callsh.KILL
        + 'pn=$1 d=$2; shift 2; for p; do mine "$p" "$d" && echo y || echo n; done'
    )

    async def go() -> tuple[list[str], list[str]]:
        transport = LocalTransport(env=env)
        try:
            session = GuestSession(transport, opts, CallStats())
            plan = await session.probe(str(workspace))
            await session.admit("s-live", str(workspace), plan.compressor)
            assert procs.wait_present(arg, timeout=30)
            live = f"{session.staging_root}/s-live"
            pid = Path(live, "pid").read_text().strip()  # noqa: ASYNC240
            candidates = [pid, "1", f"0{pid}", f"{pid} ", f"-{pid}", str(bystander.pid), ""]
            argv = ["sh", "-c", ask, "wsync", "0", "n", "md5", "raw", scripts.PRODUCER_NAME]
            result = await transport.exec([*argv, live, *candidates], timeout=30)
            other = f"{session.staging_root}/s-li"  # (a prefix of the live one's name too)
            elsewhere = await transport.exec([*argv, other, pid], timeout=30)
            await session.cleanup()
            return result.stdout.decode().split(), elsewhere.stdout.decode().split()
        finally:
            await transport.aclose()

    assert asyncio.run(go()) == (["y", "n", "n", "n", "n", "n", "n"], ["n"])


def test_a_planted_pid_1_is_never_signalled(tmp_path: Path, workspace: Path) -> None:
    """``kill -TERM -1`` would hit every process of the user.  Run inside a pid
    namespace, so that the old behaviour could not harm the machine: a process
    there (the bystander) must survive an admission that collects a snapshot
    whose ``pid`` file says ``1``."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.decode().strip()}")
    opts = options(tmp_path, staging_ttl=60)
    root = Path(opts.staging_root)
    root.mkdir(mode=0o700)
    stale = stale_snapshot(root, "s20200101-000000-00000001", "1")
    verdict = tmp_path / "verdict"

    class Namespaced(LocalTransport):
        """Each call runs in a fresh pid namespace beside a bystander ``sleep``."""

        async def exec(self, argv, **kw):  # type: ignore[no-untyped-def,override]
            wrap = (
                'v=$1; shift; sleep 300 & s=$!; "$@"; sleep 0.3; '
                'if kill -0 "$s"; then echo alive > "$v"; else echo killed > "$v"; fi; kill "$s"'
            )
            return await super().exec(
                ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", wrap, "sh",
                 str(verdict), *argv],
                **kw,
            )  # fmt: skip

    async def go() -> None:
        transport = Namespaced()
        try:
            session = GuestSession(transport, opts, CallStats())
            plan = await session.probe(str(workspace))
            with contextlib.suppress(WsyncError):
                await session.admit("s-namespaced", str(workspace), plan.compressor)
        finally:
            await transport.aclose()

    asyncio.run(go())
    assert not stale.exists()
    assert verdict.read_text().strip() == "alive"


def test_without_proc_nothing_is_killed_and_staging_still_goes(
    tmp_path: Path, workspace: Path, bystander: subprocess.Popen[bytes]
) -> None:
    """Where ``/proc`` is missing the pid cannot be checked: remove, never kill."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    hide = subprocess.run(
        ["unshare", "--mount", "sh", "-c", "mount -t tmpfs none /proc && true"],
        capture_output=True,
    )
    if hide.returncode != 0:
        pytest.skip(f"cannot hide /proc here: {hide.stderr.decode().strip()}")
    opts = options(tmp_path, staging_ttl=60)
    root = Path(opts.staging_root)
    root.mkdir(mode=0o700)
    d = stale_snapshot(root, "s-noproc", str(bystander.pid))

    class NoProc(LocalTransport):
        async def exec(self, argv, **kw):  # type: ignore[no-untyped-def,override]
            wrap = 'mount -t tmpfs none /proc && exec "$@"'
            return await super().exec(["unshare", "--mount", "sh", "-c", wrap, "sh", *argv], **kw)

    async def go() -> None:
        transport = NoProc()
        try:
            session = GuestSession(transport, opts, CallStats())
            await session.probe(str(workspace))
            session.snapshot = "s-noproc"
            await session.cleanup()
        finally:
            await transport.aclose()

    asyncio.run(go())
    assert not d.exists()
    time.sleep(0.2)
    assert bystander.poll() is None


def _plant_dead_launch(snap: Path, pid: int) -> None:
    """What a launch of ``snap`` whose producer died leaves: its token and its claim, and
    the dead producer's ``pid``."""
    (snap / "lock.1").mkdir(parents=True)
    (snap / "launch").mkdir()
    (snap / "launch" / "by").write_text("0123456789abcdef")
    for name in ("pid", "pid.launch", "lock.1/pid"):
        (snap / name).write_text(f"{pid}\n")


async def _produced_afresh(session: GuestSession, workspace: Path, compressor: str) -> None:
    """An admission of the planted ``s-dead`` starts it again (not adopted) and it ends
    done, not failed."""
    assert not await session.admit("s-dead", str(workspace), compressor)
    for _ in range(600):
        status = await session.status()
        if status.done is not None or status.failed is not None:
            break
        await asyncio.sleep(0.05)
    assert status.done is not None and status.failed is None


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as another user, which needs root")
def test_another_users_process_on_a_dead_producers_pid_is_not_our_producer(
    tmp_path: Path, workspace: Path, guest: dict[str, str] | None
) -> None:
    """Found by a review: a snapshot whose producer died without a result, its pid now
    a process of ANOTHER user of the guest whose argv spells ``/.producer-`` and the
    snapshot's directory (anyone may run ``sleep``-like programs with any argv).  The
    liveness check looked only at /proc's cmdline, never at the owner: the status said
    the producer ran, an admission adopted it (``reconciled``) instead of starting it
    again, and a pull waited for it until its ``--timeout`` (an hour by default), on
    every rerun.  Only a process of the pulling user may count as its producer; the
    co-tenant's is never signalled."""
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv to run a process as another user")
    opts = options(tmp_path)
    snap = Path(opts.staging_root, "s-dead")

    async def go(cotenant: subprocess.Popen[bytes]) -> None:
        transport = LocalTransport(env=guest)
        try:
            session = GuestSession(transport, opts, CallStats())
            plan = await session.probe(str(workspace))
            # the dead producer's pid, which the co-tenant's process now holds
            _plant_dead_launch(snap, cotenant.pid)
            session.snapshot = "s-dead"
            assert not (await session.status()).alive
            await _produced_afresh(session, workspace, plan.compressor)
            await session.cleanup()
        finally:
            await transport.aclose()

    argv = ["import sys, time; time.sleep(300)", f"/x/{scripts.PRODUCER_NAME}", str(snap)]
    cotenant = subprocess.Popen(
        [*_NOBODY, sys.executable, "-c", *argv], start_new_session=True
    )  # fmt: skip
    try:
        for _ in range(200):  # (its argv is the co-tenant's once python runs)
            if (
                f"/x/{scripts.PRODUCER_NAME}".encode()
                in Path(f"/proc/{cotenant.pid}/cmdline").read_bytes()
            ):
                break
            time.sleep(0.01)
        asyncio.run(go(cotenant))
        assert cotenant.poll() is None  # never signalled
    finally:
        cotenant.kill()
        cotenant.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as another user, which needs root")
def test_a_relaunch_kills_no_process_group_of_another_user(
    tmp_path: Path, workspace: Path, guest: dict[str, str] | None
) -> None:
    """Found by a review: a producer that starts a snapshot's next generation kills what
    the dead one left (its pipeline, by the dead producer's process group) with
    ``kill -KILL -PID``, checking only that no process PID lives.  Where that id is now
    the group of ANOTHER user's processes (its leader exited, its children run on), a
    pull as root killed them.  The group is killed only when every process in it is the
    pulling user's, and the snapshot is still produced afresh."""
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv to run a process as another user")
    opts = options(tmp_path)
    snap = Path(opts.staging_root, "s-dead")
    # the co-tenant's group: its leader has exited, its child sleeps on in it
    leader = subprocess.Popen(
        [*_NOBODY, "sh", "-c", "sleep 300 & echo $!"], start_new_session=True, stdout=subprocess.PIPE
    )  # fmt: skip
    assert leader.stdout is not None
    with leader.stdout:
        member = int(leader.stdout.readline())
    leader.wait()

    async def go() -> None:
        transport = LocalTransport(env=guest)
        try:
            session = GuestSession(transport, opts, CallStats())
            plan = await session.probe(str(workspace))
            # the dead producer's pid, now the id of the co-tenant's group
            _plant_dead_launch(snap, leader.pid)
            await _produced_afresh(session, workspace, plan.compressor)
            assert sorted(p.name for p in snap.glob("lock.*")) == ["lock.1", "lock.2"]  # noqa: ASYNC240
            await session.cleanup()
        finally:
            await transport.aclose()

    try:
        asyncio.run(go())
        try:
            state = Path(f"/proc/{member}/stat").read_text().rsplit(") ", 1)[1][0]
        except FileNotFoundError:
            state = "reaped"
        assert state not in ("Z", "reaped"), "another user's process was killed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, 9)


def test_a_relaunch_still_stops_the_dead_generations_own_pipeline(
    tmp_path: Path, workspace: Path, guest: dict[str, str] | None, procs: ProcessWatch
) -> None:
    """The other side of the check above: where only the producer's shell died, its
    pipeline (this user's, in its group) is still stopped by the next generation."""
    arg = procs.sleep_arg(300)
    env = _slow_tar(tmp_path, arg, guest)
    opts = options(tmp_path)

    async def go() -> None:
        transport = LocalTransport(env=env)
        try:
            session = GuestSession(transport, opts, CallStats())
            plan = await session.probe(str(workspace))
            await session.admit("s-shell", str(workspace), plan.compressor)
            assert procs.wait_present(arg, timeout=30)
            snap = Path(session.staging_root, "s-shell")
            os.kill(int((snap / "pid").read_text()), signal.SIGKILL)
            for _ in range(200):
                if not (await session.status()).alive:
                    break
                await asyncio.sleep(0.05)
            assert procs.pids(arg)  # the dead shell's tar still runs
            session.transport = LocalTransport(env=guest)  # (a tar that does not wait)
            try:
                assert not await session.admit("s-shell", str(workspace), plan.compressor)
                assert procs.wait_gone(arg, timeout=30) == []
                await session.cleanup()
            finally:
                await session.transport.aclose()
        finally:
            await transport.aclose()

    asyncio.run(go())


def test_every_guest_call_fits_a_url_based_exec_endpoint() -> None:
    """Scripts travel in argv, and some backends put argv into a URL whose
    request line servers cap at 8 KiB: every call stays well below."""
    from urllib.parse import quote

    wire = scripts.Wire(gate=True, nonce="0" * 16, algorithm="b2", b64=True, staging_root="/s" * 20)
    gz64 = scripts.INSTALL_PART_GZ64
    calls = [
        scripts.probe(
            gate=True, nonce="0" * 16, b64=True, workspace="/w" * 20, staging_root="/s" * 20
        ),
        *(
            scripts.install_producer(**wire, part=i, run="f" * 16)
            for i in range(scripts.install_parts())
        ),
        *(
            scripts.install_producer(**wire, part=i, run="f" * 16, part_size=gz64, encoding="gz64")
            for i in range(scripts.install_parts(gz64, "gz64"))
        ),
        scripts.status(**wire, snapshot="s" * 64, index_from=2**40, looks=600),
        scripts.read(**wire, snapshot="s" * 64, file="data", offset=2**40, length=2**22),
        scripts.cleanup(**wire, snapshots=["s" * 64] * 2),
        scripts.admit(
            **wire,
            snapshot="s" * 64,
            workspace="/w" * 20,
            chunk_size=4 * 2**20,
            compressor="zstdl",
            ttl_minutes=1440,
            run="r" * 16,
            producer_hash="0" * 128,
            need_kb=scripts.NEED_KB_MAX - 1,  # the longest size it is given
            tools="gcps",  # the longest tools
        ),
    ]
    for argv in calls:
        assert sum(len(quote(a, safe="")) + 5 for a in argv) < 7600, argv[2][:40]
        assert len(argv[2]) < 6 * 1024


def test_an_admission_carries_its_status_in_a_url_only_while_it_fits() -> None:
    """The admission that also answers the first status is a few hundred bytes longer than
    the plain one (the status itself runs from the producer's hashed text).  Sprites and
    Kubernetes put argv in a URL: it goes to them while that URL stays under
    ``URL_ARGV_MAX`` (a usual workspace path), and a long path sends the plain admission.
    ``url_length`` measures what their URL builders write."""
    from wsync.engine.guest import GuestSession
    from wsync.transports import k8s_protocol, sprites_protocol
    from wsync.transports.k8s import K8sTransport
    from wsync.transports.sprites import SpritesTransport

    wire = scripts.Wire(gate=False, nonce="0" * 16, algorithm="xxh128", b64=False, staging_root="-")

    def carried(workspace: str) -> list[str]:
        return scripts.admit(
            **wire,
            snapshot="s20261204-124327-a5eaeed7",
            workspace=workspace,
            chunk_size=4 * 2**20,
            compressor="zstdl:3",
            ttl_minutes=1440,
            run="r" * 16,
            producer_hash="0" * 32,
            need_kb=scripts.NEED_KB_MAX - 1,
            status_looks=20,
            inline=scripts.STATUS_INLINE_MAX,
            tools="gcps",
        )

    usual, deep = carried("/home/user/workspace/project"), carried("/w" * 600)
    assert scripts.url_length(usual) < scripts.URL_ARGV_MAX - 500
    assert scripts.url_length(deep) > scripts.URL_ARGV_MAX
    # the measure is the URL builders' own (Kubernetes' exactly; Sprites' parameter name
    # is 4 bytes shorter an argument)
    grown = scripts.url_length(usual) - scripts.url_length(["x"])
    url = sprites_protocol.exec_url("https://api.example", "sb", usual, stdin=False)
    plain = sprites_protocol.exec_url("https://api.example", "sb", ["x"], stdin=False)
    assert len(url) - len(plain) == grown - len("mand") * (len(usual) - 1)
    path = k8s_protocol.exec_path("ns", "pod", usual, container=None, stdin=False)
    short = k8s_protocol.exec_path("ns", "pod", ["x"], container=None, stdin=False)
    assert len(path) - len(short) == grown
    for url_based in (SpritesTransport, K8sTransport):
        assert not url_based.capabilities.long_argv, url_based
    session = GuestSession.__new__(GuestSession)
    session.long_argv = False
    assert session._exec_fits(usual) and not session._exec_fits(deep)


def test_the_cli_refuses_a_staging_dir_inside_the_workspace(
    tmp_path: Path, workspace: Path
) -> None:
    """``wsync pull --staging-dir WS/x``: exit 2, one line, nothing written."""
    import sys

    dest = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "wsync", "pull", f"local:{workspace}", str(dest),
         "--state-dir", str(tmp_path / "state"), "--staging-dir", str(workspace / "stage")],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "overlap" in proc.stderr
    assert not (workspace / "stage").exists() and not dest.exists()


_NOBODY = (shutil.which("setpriv") or "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


class _AsNobody(LocalTransport):
    """The local guest, every call run as nobody."""

    async def exec(self, argv, **kw):  # type: ignore[no-untyped-def,override]
        return await super().exec([*_NOBODY, *argv], **kw)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a probe as another user, which needs root")
@pytest.mark.parametrize("shell", ["dash", "busybox"])
def test_an_admission_runs_no_producer_from_a_root_its_user_does_not_own(
    tmp_path: Path, shell: str
) -> None:
    """Found by a review: the admission took the uid the probe saw instead of asking
    ``id``, so where the probe ran as another user than the admission (an exec user that
    changed between calls) it would have run that user's producer, from that user's
    staging root.  The admission asks ``test -O`` itself: a probe as nobody makes and
    reports nobody's root, and root's admission into it is refused, no snapshot made."""
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv to run the probe as another user")
    top = Path(tempfile.mkdtemp(prefix="wsync-owner-", dir="/tmp"))
    try:
        top.chmod(0o1777)  # like /tmp: nobody makes its staging root here
        ws = top / "ws"
        ws.mkdir()
        (ws / "f").write_text("f\n")
        ws.chmod(0o755)
        path = str(busybox_bin(top / "bb")) if shell == "busybox" else os.environ["PATH"]
        if shell == "busybox":
            for p in (top / "bb", *(top / "bb").iterdir()):
                os.lchown(p, 0, 0)
            (top / "bb").chmod(0o755)
        env = {"PATH": path, "HOME": str(top)}
        opts = options(top, helpers=False, staging_root=str(top / "stage"))

        async def go() -> None:
            session = GuestSession(_AsNobody(env=env), opts, CallStats())
            plan = await session.probe(str(ws))
            assert os.stat(session.staging_root).st_uid == 65534
            session.transport = LocalTransport(env=env)  # the admission runs as root
            with pytest.raises(StagingFailed, match="no longer a private directory"):
                await session.admit("s-theirs", str(ws), plan.compressor)

        asyncio.run(go())
        assert list((top / "stage").iterdir()) == []  # no snapshot, no producer installed
    finally:
        shutil.rmtree(top)


def test_an_admission_without_ls_does_not_take_a_root_others_may_write(tmp_path: Path) -> None:
    """Found by a review: the root's mode comes from ``ls``; where it gave none (``ls``
    gone since the probe) the writable check matched nothing and ``test -O`` alone let a
    root of mode 777 through.  A mode that is not a private directory's is refused."""
    from wsync.protocol.envelope import parse_envelope
    from wsync.protocol.hashing import ALGORITHMS

    root = tmp_path / "root"
    root.mkdir()
    root.chmod(0o777)
    (tmp_path / "ws").mkdir()
    tools = tuple(t for t in BUSYBOX_APPLETS if t != "ls")
    path = str(tool_dir(tmp_path / "bb", tools, target=shutil.which("busybox")))
    argv = scripts.admit(
        gate=False, nonce="0" * 16, algorithm="sha256", b64=False, staging_root=str(root),
        snapshot="s1", workspace=str(tmp_path / "ws"), chunk_size=4 * 2**20,
        compressor="gzip:1", ttl_minutes=60, run="r" * 16, producer_hash="0" * 64,
    )  # fmt: skip
    out = subprocess.run(argv, env={"PATH": path}, capture_output=True, timeout=60).stdout
    envelope = parse_envelope(out, "0" * 16, algorithm=ALGORITHMS["sha256"], max_length=4096)
    assert not envelope.ok and envelope.text == "unsafe-root"
