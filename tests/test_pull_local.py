"""End-to-end pulls through the real ``local:`` transport: real guest scripts, real files."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import (
    assert_exact,
    busybox_bin,
    local,
    make_tree,
    options,
    run_pull,
    tool_dir,
    writer_around_tar,
)
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.fsutil import rmtree
from wsync.errors import (
    GuestToolsMissing,
    HostileArchive,
    IntegrityFailed,
    StagingFailed,
    UnstableFiles,
    UsageError,
    WsyncError,
)
from wsync.protocol import records, scripts
from wsync.protocol.hashing import ALGORITHMS
from wsync.transports.local import LocalTransport


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "ws")


def test_exact_tree_default_guest(tmp_path: Path, workspace: Path) -> None:
    dest = tmp_path / "out"
    opts = options(tmp_path, chunk_size=1024 * 1024)
    result = run_pull(local(), workspace, dest, opts)
    assert_exact(workspace, dest)
    assert result.ok and result.chunks >= 3 and result.retries == 0
    assert result.bytes > 0 and result.transferred_bytes >= result.bytes
    # hardlinks stay hardlinks
    assert (dest / "blob.bin").stat().st_ino == (dest / "hardlink.bin").stat().st_ino
    # staging removed and the journal forgotten after success
    # only the (content-addressed, shared) producer script stays in the root
    assert [p.name for p in Path(opts.staging_root).iterdir()] == [scripts.PRODUCER_NAME]
    assert list((opts.state_dir / "pulls").iterdir()) == []


def test_empty_workspace(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    dest = tmp_path / "out"
    result = run_pull(local(), ws, dest, options(tmp_path))
    assert_exact(ws, dest)
    assert result.chunks == 1 and result.files == 0


def test_busybox_guest_with_sha256_and_gzip(tmp_path: Path, workspace: Path) -> None:
    """A guest with only busybox: sh, tar, gzip, sha256sum — no zstd, no xxhsum."""
    path = busybox_bin(tmp_path / "bb")
    transport = LocalTransport(env={"PATH": str(path), "HOME": str(tmp_path)})
    dest = tmp_path / "out"
    result = run_pull(transport, workspace, dest, options(tmp_path, chunk_size=1024 * 1024))
    assert_exact(workspace, dest)
    assert result.ok


@pytest.mark.parametrize("guest", ["default", "busybox"])
def test_chunks_grow_from_a_small_first_one(tmp_path: Path, guest: str) -> None:
    """Issue 13: the producer cuts 256 KiB, then 1 MiB but at most the chunk size (512 KiB
    here), under dash and under busybox's sh alike, and the host takes that schedule."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "noise.bin").write_bytes(os.urandom(1_000_000))  # zstd and gzip keep its size
    env = {"HOME": str(tmp_path)}
    if guest == "busybox":
        env["PATH"] = str(busybox_bin(tmp_path / "bb"))
    dest = tmp_path / "out"
    result = run_pull(LocalTransport(env=env), ws, dest, options(tmp_path, chunk_size=512 * 1024))
    assert_exact(ws, dest)
    # 256 + 512 KiB = 786,432 bytes, and the rest (the archive is a little over
    # 1,000,000 bytes) in a third; with whole 512 KiB chunks it would be two
    assert result.chunks == 3 and result.retries == 0


@pytest.mark.parametrize("guest", ["default", "busybox"])
def test_the_producer_is_woken_when_its_archive_ends(tmp_path: Path, guest: str) -> None:
    """Issue 13: the producer's loop sleeps between looks at the stream; the pipeline's
    end cuts the sleep short, so the done record never waits out a look.  Here tar takes
    half a second and the loop's second sleep (0.02 s) lasts 120 s: only the wake-up
    lets the pull finish inside its 60 s deadline."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("a")
    env = {"HOME": str(tmp_path)}
    if guest == "busybox":
        bb = shutil.which("busybox")
        real = {"sleep": f"{bb} sleep", "tar": f"{bb} tar"}
        path = str(busybox_bin(tmp_path / "bb"))
    else:
        real = {"sleep": str(shutil.which("sleep")), "tar": str(shutil.which("tar"))}
        path = os.environ["PATH"]
    slow = tmp_path / "slow"
    slow.mkdir()
    sleep_text = f'case $1 in 0.02) exec {real["sleep"]} 120 ;; esac\nexec {real["sleep"]} "$@"\n'
    (slow / "sleep").write_text("#!/bin/sh\n" + sleep_text)
    (slow / "tar").write_text(f'#!/bin/sh\n{real["sleep"]} 0.5\nexec {real["tar"]} "$@"\n')
    for tool in ("sleep", "tar"):
        (slow / tool).chmod(0o755)
    env["PATH"] = f"{slow}:{path}"
    dest = tmp_path / "out"
    result = run_pull(LocalTransport(env=env), ws, dest, options(tmp_path, timeout=60.0))
    assert_exact(ws, dest)
    assert result.ok


def test_no_xxhsum_falls_back_to_b2sum(tmp_path: Path, workspace: Path) -> None:
    """dash with coreutils but without xxhsum: BLAKE2b is used and verified."""
    tools = (
        "sh",
        "tar",
        "zstd",
        "b2sum",
        "dd",
        "wc",
        "find",
        "mkdir",
        "rm",
        "mv",
        "cat",
        "sleep",
        "head",
        "tr",
        "sed",
        "cut",
        "touch",
        "id",
        "df",
        "awk",
        "setsid",
        "nohup",
        "base64",
        "kill",
        "ls",
        "du",
    )
    bindir = tool_dir(tmp_path / "bin", tools)
    env = {"PATH": str(bindir), "HOME": str(tmp_path)}
    transport = LocalTransport(env=env)
    dest = tmp_path / "out"
    run_pull(transport, workspace, dest, options(tmp_path))
    assert_exact(workspace, dest)
    assert ALGORITHMS["b2"].tool == "b2sum"


def test_guest_without_a_hash_tool_is_refused_clearly(tmp_path: Path, workspace: Path) -> None:
    tools = (
        "sh",
        "tar",
        "gzip",
        "dd",
        "wc",
        "mkdir",
        "printf",
        "cat",
        "head",
        "df",
        "awk",
        "ls",
        "id",
    )
    bindir = tool_dir(tmp_path / "bin", tools)
    transport = LocalTransport(env={"PATH": str(bindir), "HOME": str(tmp_path)})
    dest = tmp_path / "out"
    with pytest.raises(GuestToolsMissing, match="hash tool"):
        run_pull(transport, workspace, dest, options(tmp_path))
    assert not dest.exists()


def test_replacing_a_previous_pull_and_refusing_foreign_dirs(
    tmp_path: Path, workspace: Path
) -> None:
    dest = tmp_path / "out"
    opts = options(tmp_path)
    run_pull(local(), workspace, dest, opts)
    (workspace / "new-file").write_text("second turn\n")
    os.chmod(workspace / "readonly", 0o755)
    shutil.rmtree(workspace / "readonly")
    run_pull(local(), workspace, dest, opts)  # wsync wrote DEST before: replaced
    assert_exact(workspace, dest)

    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("do not lose me\n")
    with pytest.raises(UsageError, match="--force"):
        run_pull(local(), workspace, foreign, opts)
    assert (foreign / "thesis.tex").read_text() == "do not lose me\n"
    run_pull(local(), workspace, foreign, options(tmp_path, force=True))
    assert_exact(workspace, foreign)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("dest-is-file", "not a directory"),
        ("dest-in-source", "inside the source"),
        ("source-in-dest", "inside DEST"),
        ("dest-parent-missing", "does not exist"),
        ("dest-symlink", "symlink"),
        ("missing-workspace", "does not exist in the sandbox"),
        ("workspace-is-file", "not a readable directory"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_touched(
    tmp_path: Path, workspace: Path, case: str, message: str
) -> None:
    source, dest = workspace, tmp_path / "out"
    if case == "dest-is-file":
        dest.write_text("a file")
    elif case == "dest-in-source":
        dest = workspace / "src" / "copy"
    elif case == "source-in-dest":
        dest = tmp_path
    elif case == "dest-parent-missing":
        dest = tmp_path / "no" / "such" / "out"
    elif case == "dest-symlink":
        (tmp_path / "real").mkdir()
        dest.symlink_to(tmp_path / "real")
    elif case == "missing-workspace":
        source = tmp_path / "nope"
    elif case == "workspace-is-file":
        source = workspace / "blob.bin"
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(UsageError, match=message):
        run_pull(local(), source, dest, options(tmp_path, force=True))
    after = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("state", "staging"))
    assert after == [b for b in before if b not in ("state", "staging")]


class UlimitTransport(LocalTransport):
    """Runs every guest command under ``ulimit -f``: the guest's disk "fills up"."""

    async def exec(self, argv, **kw):  # type: ignore[no-untyped-def,override]
        wrapped = ["sh", "-c", 'ulimit -f 64; exec "$@"', "sh", *argv]
        return await super().exec(wrapped, **kw)

    async def open_channel(self, argv, **kw):  # type: ignore[no-untyped-def,override]
        wrapped = ["sh", "-c", 'ulimit -f 64; exec "$@"', "sh", *argv]
        return await super().open_channel(wrapped, **kw)


def test_guest_write_failure_is_a_failure_never_a_success(tmp_path: Path, workspace: Path) -> None:
    """Field report 3, finding 1: a failed staging write must not end in 'done'."""
    dest = tmp_path / "out"
    opts = options(tmp_path, keep_staging=True)
    with pytest.raises(StagingFailed) as info:
        run_pull(UlimitTransport(), workspace, dest, opts)
    assert info.value.exit_code == 5
    assert not dest.exists()
    staged = list(Path(opts.staging_root).glob("s*"))
    assert len(staged) == 1
    assert (staged[0] / "failed").exists() and not (staged[0] / "done").exists()
    assert "compressor exited" in str(info.value) or "cannot" in str(info.value)


def test_failed_snapshot_is_discarded_at_once(tmp_path: Path, workspace: Path) -> None:
    """Issue 7 item 8: a snapshot that failed for good is removed from the guest at once
    (a full guest disk does not stay full) and the next run starts afresh, not resumes it."""
    dest = tmp_path / "out"
    opts = options(tmp_path)
    with pytest.raises(StagingFailed):
        run_pull(UlimitTransport(), workspace, dest, opts)
    assert list(Path(opts.staging_root).glob("s*")) == []
    result = run_pull(local(), workspace, dest, opts)
    assert not result.reconciled and result.resumed_chunks == 0
    assert_exact(workspace, dest)


def test_stale_staging_is_garbage_collected_and_nothing_else(
    tmp_path: Path, workspace: Path
) -> None:
    opts = options(tmp_path, staging_ttl=120)
    root = Path(opts.staging_root)
    old = time.time() - 3600

    def snapshot_dir(name: str, *, ours: bool, age: float) -> Path:
        d = root / name
        (d / "launch").mkdir(parents=True) if ours else d.mkdir(parents=True)
        (d / "data").write_bytes(b"x" * 1000)
        os.utime(d, (age, age))
        return d

    stale = snapshot_dir("s20200101-000000-deadbeef", ours=True, age=old)
    fresh = snapshot_dir("s20200101-000000-feedf00d", ours=True, age=time.time())
    # a staging root shared with other things: an old directory that is not ours
    foreign = snapshot_dir("some-users-data", ours=False, age=old)
    shaped = snapshot_dir("s-looks-like-ours-but-has-no-token", ours=False, age=old)
    # what installs cut off left (parts, a join, a decode's temp file), an old one's and a
    # live one's; a file of another program named near them
    parts = [".producer-0123456789abcdef.sh.00ff.gz64.part", ".producer-00.sh.aa.raw.part"]
    cut = [root / f"{parts[0]}0", root / f"{parts[0]}3", root / parts[0], root / f"{parts[0]}.z"]
    live = [root / f"{parts[1]}0", root / f"{parts[1]}1"]
    others = [root / "producer-notes.part1", root / ".producer-0123456789abcdef.sh"]
    for path in cut + live + others:
        path.write_text("x")
    for path in cut + others:
        os.utime(path, (old, old))
    run_pull(local(), workspace, tmp_path / "out", opts)
    assert not stale.exists()
    assert fresh.exists() and foreign.exists() and shaped.exists()
    assert [p.name for p in cut if p.exists()] == []
    assert all(p.exists() for p in live + others)


def test_admission_is_idempotent_and_adoption_is_reported(tmp_path: Path, workspace: Path) -> None:
    """Admitting a snapshot another run started adopts it and says so (``reconciled``);
    a retry of our own admission (its answer lost on the wire) is still ``admitted``."""
    import asyncio

    from wsync.engine.guest import GuestSession
    from wsync.engine.guestcall import CallStats

    opts = options(tmp_path)

    async def admit() -> tuple[bool, bool, bool]:
        transport = local()
        try:
            first = GuestSession(transport, opts, CallStats())
            plan = await first.probe(str(workspace))
            a = await first.admit("s-twice", str(workspace), plan.compressor)
            retried = await first.admit("s-twice", str(workspace), plan.compressor)
            other = GuestSession(transport, opts, CallStats())
            await other.probe(str(workspace))
            b = await other.admit("s-twice", str(workspace), plan.compressor)
            return a, retried, b
        finally:
            await transport.aclose()

    assert asyncio.run(admit()) == (False, False, True)


def _tar_wrapper(tmp_path: Path, exit_code: int) -> LocalTransport:
    """A guest whose tar works but exits with ``exit_code`` and complains on stderr."""
    bindir = tmp_path / "fake-tar"
    bindir.mkdir()
    real = shutil.which("tar")
    script = bindir / "tar"
    script.write_text(
        f"#!/bin/sh\n{real} \"$@\"\necho 'tar: ./src/f1.txt: file changed as we read it' >&2\n"
        f"exit {exit_code}\n"
    )
    script.chmod(0o755)
    return LocalTransport(env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"})


def test_tar_exit_1_is_a_warning_with_its_message(tmp_path: Path, workspace: Path) -> None:
    dest = tmp_path / "out"
    result = run_pull(_tar_wrapper(tmp_path, 1), workspace, dest, options(tmp_path))
    assert_exact(workspace, dest)
    assert len(result.warnings) == 1
    assert "file changed as we read it" in result.warnings[0]


def test_tar_exit_2_is_a_staging_failure(tmp_path: Path, workspace: Path) -> None:
    dest = tmp_path / "out"
    with pytest.raises(StagingFailed, match="tar exited 2"):
        run_pull(_tar_wrapper(tmp_path, 2), workspace, dest, options(tmp_path))
    assert not dest.exists()


def test_overall_deadline_is_a_clear_failure(tmp_path: Path, workspace: Path) -> None:
    from wsync.chaos import ChaosTransport, FaultPlan
    from wsync.errors import IntegrityFailed

    transport = ChaosTransport(local(), FaultPlan(rates={"W": 1.0}, hang=0.5))
    dest = tmp_path / "out"
    with pytest.raises(IntegrityFailed, match="deadline"):
        run_pull(transport, workspace, dest, options(tmp_path, timeout=2.0))
    assert not dest.exists()


def test_an_adopted_failed_snapshot_is_replaced_by_a_fresh_one(
    tmp_path: Path, workspace: Path
) -> None:
    """A guest failure must not stick: a run that finds its journal naming a failed
    snapshot (its own run was killed before it could discard it) starts afresh instead of
    adopting the failed snapshot forever."""
    from wsync.engine.journal import Journal

    dest = tmp_path / "out"
    opts = options(tmp_path, keep_staging=True)
    with pytest.MonkeyPatch.context() as mp:  # killed before the discard
        mp.setattr(Journal, "forget", lambda self: None)
        with pytest.raises(StagingFailed):
            run_pull(UlimitTransport(), workspace, dest, opts)
    result = run_pull(local(), workspace, dest, opts)
    assert_exact(workspace, dest)
    assert any("started afresh" in w for w in result.warnings)


def test_busybox_tar_exit_1_is_a_failure_not_a_warning(tmp_path: Path, workspace: Path) -> None:
    """Busybox tar exits 1 when it leaves unreadable files out: not an exact copy."""
    path = busybox_bin(tmp_path / "bb")
    (path / "tar").unlink()
    wrapper = path / "tar"
    wrapper.write_text(f'#!{path}/sh\n{shutil.which("busybox")} tar "$@"\nexit 1\n')
    wrapper.chmod(0o755)
    transport = LocalTransport(env={"PATH": str(path), "HOME": str(tmp_path)})
    dest = tmp_path / "out"
    with pytest.raises(StagingFailed, match="tar exited 1"):
        run_pull(transport, workspace, dest, options(tmp_path))
    assert not dest.exists()


def _held_open_archive(tmp_path: Path) -> tuple[Path, LocalTransport]:
    """A 24 MiB random workspace (multithreaded zstd emits output in jobs of several MiB:
    give it a few) and a guest whose ``tar -cf`` holds the pipe open for a minute after
    its last byte, so the producer runs on, not done, however slow this machine is (the
    probe is unaffected)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "blob").write_bytes(os.urandom(24 * 1024 * 1024))
    bindir = tmp_path / "slow-tar"
    bindir.mkdir()
    (bindir / "tar").write_text(
        f'#!/bin/sh\n{shutil.which("tar")} "$@"\ncase " $* " in *" -cf "*) exec sleep 60 ;; esac\nexit 0\n'
    )
    (bindir / "tar").chmod(0o755)
    return ws, LocalTransport(env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"})


def test_the_producer_indexes_chunks_while_it_still_runs(tmp_path: Path) -> None:
    """Chunks become readable before the archive is finished (pull overlaps produce)."""
    import asyncio

    from wsync.engine.guest import GuestSession
    from wsync.engine.guestcall import CallStats

    ws, transport = _held_open_archive(tmp_path)
    opts = options(tmp_path, chunk_size=1024 * 1024)

    async def watch() -> tuple[int, bool]:
        try:
            session = GuestSession(transport, opts, CallStats())
            plan = await session.probe(str(ws))
            await session.admit("s-streaming", str(ws), plan.compressor)
            for _ in range(600):
                status = await session.status()
                if status.index_size or status.done:
                    return status.index_size, status.done is not None
                await asyncio.sleep(0.05)
            return 0, False
        finally:
            with contextlib.suppress(WsyncError):
                await session.cleanup()  # stops the producer still waiting on tar
            await transport.aclose()

    indexed, finished = asyncio.run(watch())
    assert indexed > 0 and not finished


def test_a_status_long_poll_answers_when_a_chunk_lands_and_carries_the_index(
    tmp_path: Path,
) -> None:
    """Issue 13: ``status(index_from, wait)`` waits in the guest until the index grows past
    ``index_from`` and brings the index from there, byte for byte what a read of it
    returns; with nothing new it waits its whole budget and brings nothing."""
    import asyncio
    import time

    from wsync.engine.guest import GuestSession
    from wsync.engine.guestcall import CallStats

    ws, transport = _held_open_archive(tmp_path)
    opts = options(tmp_path, chunk_size=1024 * 1024)

    async def watch() -> tuple[float, bytes, bytes, int, bytes, float]:
        session = GuestSession(transport, opts, CallStats())
        try:
            plan = await session.probe(str(ws))
            await session.admit("s-longpoll", str(ws), plan.compressor)
            started = time.monotonic()
            first = await session.status(0, wait=25.0)
            waited = time.monotonic() - started
            read = await session.read("index", 0, len(first.index_tail))
            # zstd holds its last block until tar's pipe closes, a minute away: once the
            # full chunks are indexed nothing new comes, and a wait runs out empty-handed
            known = len(first.index_tail)
            for _ in range(200):
                started = time.monotonic()
                idle = await session.status(known, wait=1.0)
                idle_s = time.monotonic() - started
                if not idle.index_tail:
                    break
                known += len(idle.index_tail)
            return waited, first.index_tail, read, known, idle.index_tail, idle_s
        finally:
            with contextlib.suppress(WsyncError):
                await session.cleanup()
            await transport.aclose()

    waited, tail, read, known, idle_tail, idle_s = asyncio.run(watch())
    assert tail and tail == read and tail.startswith(b"C 0 0 ")
    assert waited < 20, "the long poll did not answer when the first chunk landed"
    assert known >= len(tail) and idle_tail == b"" and idle_s >= 1.0


def test_the_status_scripts_numbers_are_the_ones_the_host_counts_with() -> None:
    """The guest script is constant text: its look and its index bound are literals that
    the host's STATUS_LOOK (the long poll's deadline allowance) and STATUS_INDEX_MAX mirror."""
    text = scripts.SCRIPTS["status"]
    assert f"sleep {scripts.STATUS_LOOK} " in text and f"sleep {scripts.FAST_LOOK} " in text
    assert f"if [ $k -lt {scripts.FAST_LOOKS} ]" in text
    assert scripts.looks_seconds(scripts.status_looks(1.0)) == pytest.approx(1.0)
    assert scripts.looks_seconds(scripts.status_looks(0.05)) == pytest.approx(0.05)
    assert f"count={scripts.STATUS_INDEX_MAX};" in text


@pytest.fixture
def deep(tmp_path: Path) -> Iterator[Callable[[Path, int, str], None]]:
    """Builds ``top/d/d/…`` ``depth`` levels deep with ``leaf`` at the bottom (``fifo``:
    a FIFO); every deep tree under ``tmp_path`` is removed afterwards with wsync's own
    remover, as pytest's recursive cleanup cannot."""

    def build(top: Path, depth: int, leaf: str) -> None:
        top.mkdir()
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        try:
            if leaf == "fifo":
                os.mkfifo("fifo", dir_fd=fd)
            else:
                os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        finally:
            os.close(fd)

    yield build
    for entry in tmp_path.iterdir():
        rmtree(entry)


@pytest.mark.parametrize("keep_prev", [False, True], ids=["default", "keep-prev"])
def test_a_deep_tree_pulls_twice_in_a_row(
    tmp_path: Path, deep: Callable[[Path, int, str], None], keep_prev: bool
) -> None:
    """Issue 7 item 7: the second pull's removal of the old 1,200-deep tree raised
    RecursionError in finish(), and every later pull failed the same way.  With
    --keep-prev the incremental pulls keep the old tree (and walk it), the full one
    removes both."""
    workspace = tmp_path / "ws"
    deep(workspace, 1200, "leaf")
    dest = tmp_path / "out"
    for turn, full in enumerate((True, False, False, True)):
        (workspace / "turn").write_text(f"{turn}\n")
        opts = options(tmp_path, full=full, keep_prev=keep_prev)
        result = run_pull(local(), workspace, dest, opts)
        assert result.ok and result.warnings == []
        assert result.mode == ("full" if full else "incremental")
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit + 4 * 1200)  # for treediff's os.walk, not for wsync
        try:
            assert_exact(workspace, dest)
        finally:
            sys.setrecursionlimit(limit)
        left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out."))
        assert left == ([".out.wsync-prev"] if keep_prev and not full else [])


def test_a_refusal_after_a_deep_tree_is_still_the_refusal(
    tmp_path: Path, deep: Callable[[Path, int, str], None]
) -> None:
    """The cleanup of a 1,200-deep half-extracted tree must not turn exit 7 into an
    internal error (it raised RecursionError), nor leave the tmp tree behind."""
    workspace = tmp_path / "ws"
    deep(workspace, 1200, "fifo")  # refused, after the whole deep path
    dest = tmp_path / "out"
    with pytest.raises(HostileArchive, match="FIFO"):
        run_pull(local(), workspace, dest, options(tmp_path))
    assert not dest.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")) == []


def test_a_host_limit_keeps_the_snapshot_for_the_next_run(tmp_path: Path, workspace: Path) -> None:
    """A pull stopped by a host limit (here --max-bytes) is not the snapshot's fault: the
    guest staging and the journal stay, and the run with the limit raised resumes it."""
    from wsync.engine.api import ExtractLimits
    from wsync.errors import LimitExceeded

    dest = tmp_path / "out"
    tight = options(
        tmp_path, chunk_size=256 * 1024, limits=ExtractLimits(max_bytes=1024, min_free_bytes=0)
    )
    with pytest.raises(LimitExceeded):
        run_pull(local(), workspace, dest, tight)
    (kept,) = Path(tight.staging_root).glob("s*")
    result = run_pull(local(), workspace, dest, options(tmp_path, chunk_size=256 * 1024))
    assert_exact(workspace, dest)
    assert result.reconciled and result.snapshot == kept.name  # adopted, not tarred again
    assert result.compress_level == 0  # the earlier run's producer: its level unknown here


def _over_the_file_limit(tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    """A workspace of 12 entries, a DEST and options that allow 8: every pull fails."""
    from wsync.engine.api import ExtractLimits

    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(11):
        (ws / f"f{i}").write_text(f"{i}\n")
    limits = ExtractLimits(max_files=8, min_free_bytes=0)
    return ws, tmp_path / "out", options(tmp_path, chunk_size=256 * 1024, limits=limits)


def _journaled(opts: PullOptions) -> list[str]:
    """The snapshots the pulls' journals hold, their phases' too (what the next run
    resumes)."""
    metas = Path(opts.state_dir, "pulls").glob("**/meta.json")
    return sorted({json.loads(meta.read_text())["snapshot"] for meta in metas})


@pytest.mark.parametrize("incremental", [False, True], ids=["first-pull", "incremental"])
def test_a_snapshot_over_the_limits_gives_way_to_the_workspace_as_it_is_now(
    tmp_path: Path, incremental: bool
) -> None:
    """A snapshot refused by a host limit is kept to resume when the limit is raised; but
    with the limit as it was, it failed every later run even after the user deleted what
    was too big (and a daemon's pulls stayed stuck for a day).  A resumed snapshot over
    the limits is now given up once for a fresh one, with a warning; one that is still
    over them fails as before, and is kept."""
    from wsync.engine.api import ExtractLimits
    from wsync.errors import LimitExceeded

    ws, dest, tight = _over_the_file_limit(tmp_path)
    too_big = [ws / f"f{i}" for i in range(6)]
    if incremental:  # DEST from an earlier pull; then a file over --max-bytes is fetched
        for path in ws.iterdir():
            path.unlink()
        tight = dataclasses.replace(tight, limits=ExtractLimits(max_bytes=50_000))
        assert run_pull(local(), ws, dest, tight).mode == "full"
        too_big = [ws / "big"]
        too_big[0].write_bytes(os.urandom(100_000))
    with pytest.raises(LimitExceeded):
        run_pull(local(), ws, dest, tight)
    first = _journaled(tight)
    assert first
    with pytest.raises(LimitExceeded) as refusal:  # nothing changed: refused again, once
        run_pull(local(), ws, dest, tight)
    failed = PullResult.from_error("local", dest, refusal.value, 0.0)  # (--json's, a job's)
    assert [w for w in failed.warnings if "over this run's limits" in w], failed
    kept = _journaled(tight)
    assert kept and not set(kept) & set(first)  # the fresh one, over the limits too, stays
    for path in too_big:
        path.unlink()
    result = run_pull(local(), ws, dest, tight)
    assert_exact(ws, dest)
    assert result.snapshot not in kept
    assert [w for w in result.warnings if "over this run's limits" in w], result.warnings
    again = run_pull(local(), ws, dest, tight)  # nothing is left to resume
    assert again.ok and not again.warnings and not again.reconciled
    assert_exact(ws, dest)


def _refused(tmp_path: Path) -> tuple[Path, Path, PullOptions, list[str]]:
    """:func:`_over_the_file_limit` pulled once (refused), and the snapshots kept."""
    from wsync.errors import LimitExceeded

    ws, dest, tight = _over_the_file_limit(tmp_path)
    with pytest.raises(LimitExceeded):
        run_pull(local(), ws, dest, tight)
    # a first refusal gives nothing up (it took one snapshot, and forgot none)
    assert not list(Path(tight.state_dir, "pulls").glob("*/forgotten.json"))
    return ws, dest, tight, _journaled(tight)


def test_a_workspace_that_stays_over_the_limits_is_not_snapshotted_afresh_every_run(
    tmp_path: Path,
) -> None:
    """Each fresh start of a workspace still over the limits costs the guest's archive and
    the reads up to the limit: a daemon pulling every minute did that every minute.  The
    first two fresh starts are at once; then each waits twice as long as the last (1, 2
    ... minutes), the refused snapshot failing fast meanwhile.  Time passing is written
    into the journal's record, as a clock would have left it."""
    from wsync.engine.journal import AFRESH_FIRST_WAIT_S
    from wsync.errors import LimitExceeded

    ws, dest, tight, kept = _refused(tmp_path)
    (record,) = Path(tight.state_dir, "pulls").glob("*/refused.json")

    def refused_run() -> list[str]:
        with pytest.raises(LimitExceeded):
            run_pull(local(), ws, dest, tight)
        return _journaled(tight)

    def waited(seconds: float) -> None:
        data = json.loads(record.read_text())
        data["at"] -= seconds
        record.write_text(json.dumps(data))

    for _ in range(2):  # given way at once, twice
        fresh = refused_run()
        assert not set(fresh) & set(kept)
        kept = fresh
    assert refused_run() == kept  # the third waits a minute: the same snapshot, refused
    waited(AFRESH_FIRST_WAIT_S - 5)
    assert refused_run() == kept
    waited(10)
    fresh = refused_run()
    assert not set(fresh) & set(kept)
    waited(AFRESH_FIRST_WAIT_S + 5)  # the fourth waits two minutes
    assert refused_run() == fresh
    waited(-3600)  # (a clock set back by an hour since the last: no wait that long)
    kept, fresh = fresh, refused_run()
    assert not set(fresh) & set(kept)
    for i in range(6):
        (ws / f"f{i}").unlink()
    waited(4 * AFRESH_FIRST_WAIT_S)  # the fifth waits four minutes
    result = run_pull(local(), ws, dest, tight)
    assert_exact(ws, dest)
    assert [w for w in result.warnings if "over this run's limits" in w], result.warnings
    assert not record.exists()  # success: the run of refusals is over


@pytest.mark.parametrize("hostile", ["at-beyond-floats", "nested"])
def test_a_hostile_refusal_record_does_not_crash_a_pull(tmp_path: Path, hostile: str) -> None:
    """The refusal record is the user's own file, but whatever it holds must not crash a
    pull: an ``at`` no float can hold (OverflowError) is a clock far ahead, so no wait;
    a record nested deeper than the parser recurses (RecursionError) is no record."""
    from wsync.errors import LimitExceeded

    ws, dest, tight, kept = _refused(tmp_path)
    (record,) = Path(tight.state_dir, "pulls").glob("*/refused.json")
    if hostile == "nested":
        record.write_text("[" * 100_000)
    else:
        record.write_text(f'{{"snapshots": {json.dumps(kept)}, "afresh": 5, "at": 1{"0" * 400}}}')
    with pytest.raises(LimitExceeded):
        run_pull(local(), ws, dest, tight)
    if hostile == "nested":  # no refusal on record: kept, and the refusal recorded now
        assert _journaled(tight) == kept
    else:  # given way
        assert not set(_journaled(tight)) & set(kept)


@pytest.mark.parametrize("count", ["-1000", "true", "2.5"])
def test_a_refusal_record_with_a_count_that_is_no_count_still_backs_off(
    tmp_path: Path, count: str
) -> None:
    """A fresh-start count that is no plain count (negative, boolean, fractional) counts as
    none: two fresh starts at once, then the wait.  A count of -1000 put the wait off for a
    thousand fresh starts, each the guest's whole archive."""
    from wsync.errors import LimitExceeded

    ws, dest, tight, kept = _refused(tmp_path)
    (record,) = Path(tight.state_dir, "pulls").glob("*/refused.json")
    record.write_text(f'{{"snapshots": {json.dumps(kept)}, "afresh": {count}, "at": 0}}')
    for _ in range(2):
        with pytest.raises(LimitExceeded):
            run_pull(local(), ws, dest, tight)
        fresh = _journaled(tight)
        assert not set(fresh) & set(kept)
        kept = fresh
    with pytest.raises(LimitExceeded):
        run_pull(local(), ws, dest, tight)
    assert _journaled(tight) == kept  # the third waits
    assert json.loads(record.read_text())["afresh"] == 2


def test_journal_files_nested_past_the_json_parsers_depth_cost_a_fresh_start(
    tmp_path: Path,
) -> None:
    """Every file of a pull's journal read back damaged (here: JSON nested deeper than the
    parser goes, which raised RecursionError at every pull's start) is no record."""
    ws, dest, tight, _ = _refused(tmp_path)
    journal = next(Path(tight.state_dir, "pulls").iterdir())
    for name in ("meta.json", "forgotten.json", "refused.json", "done.json"):
        for where in (journal, *journal.glob("phase-*")):
            (where / name).write_text("[" * 100_000)
    result = run_pull(local(), ws, dest, options(tmp_path, chunk_size=256 * 1024))
    assert result.ok and not result.reconciled
    assert_exact(ws, dest)


def test_a_raised_limit_still_resumes_the_snapshot(tmp_path: Path) -> None:
    from wsync.engine.api import ExtractLimits

    ws, dest, tight, kept = _refused(tmp_path)
    raised = dataclasses.replace(tight, limits=ExtractLimits(max_files=100, min_free_bytes=0))
    result = run_pull(local(), ws, dest, raised)
    assert result.reconciled and result.snapshot in kept and not result.warnings
    assert_exact(ws, dest)


def test_a_dry_run_never_gives_up_a_snapshot_over_the_limits(tmp_path: Path) -> None:
    from wsync.errors import LimitExceeded

    ws, dest, tight, kept = _refused(tmp_path)
    for i in range(6):
        (ws / f"f{i}").unlink()
    with contextlib.suppress(LimitExceeded):
        run_pull(local(), ws, dest, dataclasses.replace(tight, dry_run=True))
    assert _journaled(tight) == kept
    result = run_pull(local(), ws, dest, tight)
    assert result.ok and result.snapshot not in kept


@pytest.mark.parametrize("long_window", [True, False])
def test_zstd_long_is_used_where_the_guest_zstd_has_it(tmp_path: Path, long_window: bool) -> None:
    """Issue 13: a guest zstd that takes ``--long=25`` compresses with a 32 MiB window
    (``zstdl``); one that refuses it gets plain ``zstd``; both pull exactly, and a
    repetition 8 MiB apart (beyond the default window) costs almost nothing with it."""
    import asyncio

    from wsync.engine.guest import GuestSession
    from wsync.engine.guestcall import CallStats

    ws = make_tree(tmp_path / "ws")
    block = os.urandom(8 * 1024 * 1024)
    (ws / "twice.bin").write_bytes(block + block)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    if not long_window:  # a zstd older than 1.3.2: --long is an unknown option
        (bindir / "zstd").write_text(
            f'#!/bin/sh\nfor a; do case $a in --long*) exit 1 ;; esac; done\nexec {shutil.which("zstd")} "$@"\n'
        )
        (bindir / "zstd").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}

    async def plan_of() -> str:
        transport = LocalTransport(env=env)
        try:
            return (
                await GuestSession(transport, options(tmp_path), CallStats()).probe(str(ws))
            ).compressor
        finally:
            await transport.aclose()

    assert asyncio.run(plan_of()) == ("zstdl" if long_window else "zstd")
    result = run_pull(LocalTransport(env=env), ws, tmp_path / "out", options(tmp_path))
    assert_exact(ws, tmp_path / "out")
    # the tree holds 3 MiB of other random bytes: 11 MiB to send with the window, 19 without
    if long_window:
        assert result.bytes < 13 * 1024 * 1024, result.bytes
    else:
        assert result.bytes > 18 * 1024 * 1024, result.bytes


def test_a_stop_that_lands_just_after_the_swap_is_a_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI's random-signal test caught a SIGINT between the swap and the cleanup (while
    the progress ticker was put away): the pull said "interrupted" (exit 130) with DEST
    already swapped.  DEST is complete then, so the pull is a success with a warning."""
    import asyncio

    from wsync.engine import pull as pull_module

    ws = make_tree(tmp_path / "ws")
    swap_in = pull_module._Pull.swap_in

    def swap_then_stop(self: pull_module._Pull, tmp: str, tmp_fd: int) -> str | None:
        old = swap_in(self, tmp, tmp_fd)
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # delivered at the pull's next await
        return old

    monkeypatch.setattr(pull_module._Pull, "swap_in", swap_then_stop)
    result = run_pull(local(), ws, tmp_path / "out", options(tmp_path))
    assert result.ok and "stopped while cleaning up; DEST is complete" in result.warnings
    assert_exact(ws, tmp_path / "out")
    assert not list((tmp_path / "state" / "pulls").glob("*/meta.json"))  # journal gone


def test_closing_the_transport_stays_within_the_overall_deadline(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend's close waits for its kills of the guest's readers (docker up to 12 s):
    a pull that failed at --timeout returned 6-11 s after it.  The close gets what is left
    of the deadline, at least a second; the connection dies with the process anyway."""
    import asyncio

    from wsync.engine.pull import pull_uri

    closing: list[float] = []

    async def slow_close(self: LocalTransport) -> None:
        started = time.monotonic()
        try:
            await asyncio.sleep(60)
        finally:
            closing.append(time.monotonic() - started)

    monkeypatch.setattr(LocalTransport, "aclose", slow_close)
    opts = options(tmp_path, timeout=1.0)  # a deadline that has passed by the close
    with contextlib.suppress(Exception):
        asyncio.run(pull_uri(f"local:{workspace}", tmp_path / "out2", opts))
    assert len(closing) == 1 and closing[0] < 5  # one second's grace, not the ten before


@pytest.fixture
def changed_after_a_pull(tmp_path: Path, workspace: Path) -> tuple[Path, PullOptions]:
    """DEST pulled once, then a file changed in the workspace: the next pull fetches it."""
    dest = tmp_path / "out"
    opts = options(tmp_path)
    assert run_pull(LocalTransport(), workspace, dest, opts).ok
    (workspace / "src" / "f1.txt").write_text("changed\n")
    return dest, opts


def watch_cleanups(
    monkeypatch: pytest.MonkeyPatch, before: Callable[[int], Awaitable[None]]
) -> list[tuple[str, ...]]:
    """The snapshots each guest cleanup call names, from now on; ``before(n)`` is awaited
    ahead of the n-th."""
    from wsync.engine.guest import GuestSession

    cleanup = GuestSession.cleanup
    calls: list[tuple[str, ...]] = []

    async def cleaning(session: GuestSession, *snapshots: str) -> None:
        calls.append(snapshots or (session.snapshot,))
        await before(len(calls))
        await cleanup(session, *snapshots)

    monkeypatch.setattr(GuestSession, "cleanup", cleaning)
    return calls


def repull(
    tmp_path: Path, workspace: Path, dest: Path, opts: PullOptions, calls: list[tuple[str, ...]]
) -> None:
    """The incremental pull after ``changed_after_a_pull``: exact, no warning, both
    snapshots' staging removed, in one call."""
    result = run_pull(LocalTransport(), workspace, dest, opts)
    assert result.ok and result.mode == "incremental" and not result.warnings, result.warnings
    assert_exact(workspace, dest)
    assert len(calls) == 1 and len(calls[0]) == 2, calls
    assert [p.name for p in (tmp_path / "staging").iterdir() if p.name in calls[0]] == []


@pytest.mark.usefixtures("no_inline")  # (a run that comes whole cleans itself)
def test_the_guest_staging_goes_while_the_host_commits(
    tmp_path: Path,
    workspace: Path,
    changed_after_a_pull: tuple[Path, PullOptions],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the swap the guest's staging (the listing's and the content run's, in one
    call) is removed beside the host's own cleanup, not after it: on a remote backend
    that is a round trip less per pull.  The commit here waits for the guest cleanup call
    to have started, and that call waits for the commit to have started: one after the
    other, either would wait in vain."""
    import asyncio
    import threading

    from wsync.engine.incremental import Incremental

    called, committing_now = threading.Event(), threading.Event()
    commit = Incremental.commit

    async def before(n: int) -> None:
        called.set()
        assert await asyncio.to_thread(committing_now.wait, 30), "no commit meanwhile"

    def committing(inc: Incremental, **kw: bool) -> None:
        committing_now.set()
        assert called.wait(30), "the guest staging was not being removed meanwhile"
        commit(inc, **kw)

    calls = watch_cleanups(monkeypatch, before)
    monkeypatch.setattr(Incremental, "commit", committing)
    repull(tmp_path, workspace, *changed_after_a_pull, calls)


def test_with_keep_staging_the_manifests_staging_goes_while_the_diff_runs(
    tmp_path: Path,
    workspace: Path,
    changed_after_a_pull: tuple[Path, PullOptions],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--keep-staging keeps the content run's staging, so no last cleanup comes: the
    listing's is removed as soon as its stream is in, beside the diff (the guest cleanup
    call here and the diff each wait for the other to have started: one after the other,
    either would wait in vain)."""
    import asyncio
    import dataclasses
    import threading

    from wsync.engine.incstate import PullState

    diffing, cleaning = threading.Event(), threading.Event()
    diff = PullState.diff

    async def before(n: int) -> None:
        cleaning.set()
        assert await asyncio.to_thread(diffing.wait, 30), "the diff did not run meanwhile"

    def diffing_now(state: PullState, *args: object) -> object:
        diffing.set()
        assert cleaning.wait(30), "the listing's staging was not being removed meanwhile"
        return diff(state, *args)  # type: ignore[arg-type]

    calls = watch_cleanups(monkeypatch, before)
    monkeypatch.setattr(PullState, "diff", diffing_now)
    dest, opts = changed_after_a_pull
    result = run_pull(
        LocalTransport(), workspace, dest, dataclasses.replace(opts, keep_staging=True)
    )
    assert result.ok and result.mode == "incremental" and not result.warnings, result.warnings
    assert_exact(workspace, dest)
    assert len(calls) == 1 and len(calls[0]) == 1, calls  # the listing's
    staged = [p.name for p in (tmp_path / "staging").iterdir() if p.name.startswith("s")]
    assert len(staged) == 1 and staged[0] not in calls[0]  # the content run's, kept


class ScriptLog(LocalTransport):
    """Notes which of wsync's guest scripts each call runs, by exec or through a helper."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.ran: list[str] = []

    def note(self, text: str) -> None:
        names = [name for name, script in scripts.SCRIPTS.items() if script == text]
        self.ran.append(names[0] if names else "?")

    async def exec(self, argv, **kw):  # type: ignore[no-untyped-def,override]
        if len(argv) > 2 and argv[:2] == ["sh", "-c"]:
            self.note(argv[2])
        return await super().exec(argv, **kw)

    async def open_channel(self, argv, **kw):  # type: ignore[no-untyped-def,override]
        channel = await super().open_channel(argv, **kw)
        send = channel.send

        async def noted(data: bytes) -> None:
            # a request: its header line, then the call's argv as one shell command line
            command = data.decode("utf-8", "surrogateescape").split("\n", 1)[1]
            self.note(shlex.split(command, comments=True)[2])
            await send(data)

        channel.send = noted  # type: ignore[method-assign]
        return channel


def _small_workspace(root: Path) -> Path:
    root.mkdir()
    (root / "notes.txt").write_text("what the agent wrote\n")
    (root / "bin").mkdir()
    (root / "bin" / "blob").write_bytes(bytes(range(256)) * 8)
    return root


@pytest.mark.parametrize("helpers", [False, True], ids=["exec-per-call", "helper"])
def test_a_small_workspace_is_pulled_without_a_read_call(tmp_path: Path, helpers: bool) -> None:
    """A small workspace's manifest and archive each come whole with the status that
    finds them done, and the admission carries that status itself: each run is one call,
    no status and no read (before: an admission, a status and a read each).  Through a
    guest helper or one exec per call alike (``local:``'s argv may be long).  The carried
    status looks for 0.1 s: on a loaded machine a run may take longer, and a status call
    follows, or a run's index line comes in the look but its ``done`` after it, and its
    chunk is read; so status calls are not counted here and reads are bounded (one a run)."""
    ws = _small_workspace(tmp_path / "ws")
    transport = ScriptLog()
    result = run_pull(transport, ws, tmp_path / "out", options(tmp_path, helpers=helpers))
    assert_exact(ws, tmp_path / "out")
    assert result.chunks == 1
    # (a loaded machine: a run whose index line came in the carried look but its ``done``
    # after it is read by a read call, once, as any chunk is)
    assert transport.ran.count("read") <= 2 and "?" not in transport.ran, transport.ran
    # (the first admission finds no producer installed, and is made again after)
    assert transport.ran.count("admit_status") == 3, transport.ran
    assert "admit" not in transport.ran, transport.ran


def test_an_admission_too_long_for_an_ssh_command_line_does_not_carry_its_status(
    tmp_path: Path,
) -> None:
    """By exec the admission that carries its status stays under 8 KiB as a command line
    (Dropbear refuses 9,000 bytes); with 300 ``--exclude`` names pruned in the guest the
    manifest run's admission would not, and goes without the status (then a status call).
    The archive run prunes nothing and still carries it.  The tree is exact either way."""
    from wsync.engine.excludes import Excludes

    ws = _small_workspace(tmp_path / "ws")
    names = [f"an-excluded-name-of-some-length-{i:03d}" for i in range(300)]
    (ws / names[7]).write_text("left in the guest\n")
    excludes = Excludes.from_options(names, [])
    assert sum(len(n) + 3 for n in excludes.guest_prune()) > scripts.EXEC_CARRY_MAX
    transport = ScriptLog()
    opts = options(tmp_path, helpers=False, excludes=excludes)
    run_pull(transport, ws, tmp_path / "out", opts)
    assert not (tmp_path / "out" / names[7]).exists()
    (ws / names[7]).unlink()
    assert_exact(ws, tmp_path / "out")
    # the manifest run: admit (producer missing), admit again, status; then the select
    # run (the excludes make it one): admit_status (a loaded machine may need a status call
    # more after either: counted at least)
    assert transport.ran.count("admit") == 2 and transport.ran.count("status") >= 1, transport.ran
    assert transport.ran.count("admit_status") == 1, transport.ran


@pytest.mark.parametrize("deep", [False, True], ids=["usual-path", "deep-path"])
def test_an_exec_whose_argv_must_stay_short_carries_the_status_only_while_it_fits(
    tmp_path: Path, deep: bool
) -> None:
    """Where an exec's argv travels in a URL (Sprites, Kubernetes: ``long_argv`` off) the
    admission carries the first status while its URL stays under ``URL_ARGV_MAX``: with a
    usual workspace path each producer run is one call, and no plain admission is sent.  A
    workspace path of 1,500 bytes (4.5 KB in a URL) sends the plain admission and a status
    call instead.  (A status call may follow either way where the producer is still at
    work after the admission's look: a loaded machine; so status calls are counted at
    least, never exactly.)"""
    ws = tmp_path / "ws"
    if deep:
        ws = ws.joinpath(*["d" * 250] * 6)
    ws.mkdir(parents=True)
    (ws / "one.txt").write_text("one\n")
    transport = ScriptLog()
    transport.capabilities = dataclasses.replace(transport.capabilities, long_argv=False)  # type: ignore[misc]
    result = run_pull(transport, ws, tmp_path / "out", options(tmp_path, helpers=False))
    assert_exact(ws, tmp_path / "out")
    assert result.chunks == 1
    if deep:
        assert "admit_status" not in transport.ran, transport.ran
        assert transport.ran.count("admit") == 3, transport.ran
        assert transport.ran.count("status") >= 2, transport.ran
    else:
        assert "admit" not in transport.ran, transport.ran
        assert transport.ran.count("admit_status") == 3, transport.ran


@pytest.mark.parametrize("long_argv", [True, False], ids=["long-argv", "short-argv"])
def test_a_list_without_stdin_goes_in_parts_as_large_as_the_exec_takes(
    tmp_path: Path, long_argv: bool
) -> None:
    """Without stdin (Cloudflare, Daytona) the select run's list travels in argv parts of
    base64: 64 KiB each where an exec's argv may be long, 4 KiB where it may not.  A
    16 KB list (in base64) is one upload call, not five (a round trip each on an HTTP
    backend)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    names = [f"a-file-with-a-rather-long-name-{i:03d}.txt" for i in range(300)]
    for name in names:
        (ws / name).write_text("first\n")
    dest = tmp_path / "out"
    opts = options(tmp_path, helpers=False)
    run_pull(ScriptLog(), ws, dest, opts)
    for name in names:
        with (ws / name).open("a") as f:
            f.write("second\n")
    transport = ScriptLog()
    transport.capabilities = dataclasses.replace(  # type: ignore[misc]
        transport.capabilities, stdin=False, long_argv=long_argv
    )
    result = run_pull(transport, ws, dest, opts)
    assert result.mode == "incremental" and result.changed_files == len(names)
    assert_exact(ws, dest)
    listed = sum(len(f"./{name}\0") for name in names)
    parts = -(-4 * -(-listed // 3) // (64 * 1024 if long_argv else 4096))
    assert transport.ran.count("upload") == parts == (1 if long_argv else 5), transport.ran


_LYING_BASE64 = """#!/bin/sh
# the guest's base64, but of other bytes of the same length (each byte moved by 128)
{real} "$@" | {real} -d | tr '\\000-\\177\\200-\\377' '\\200-\\377\\000-\\177' | {real}
"""


def _shimmed(tmp_path: Path, tool: str, script: str) -> dict[str, str]:
    """A guest environment whose ``tool`` is ``script`` (``{real}`` in it: the real one)."""
    real = shutil.which(tool)
    assert real
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / tool).write_text(script.format(real=real))
    (shims / tool).chmod(0o755)
    return {"PATH": f"{shims}:{os.environ['PATH']}", "HOME": str(tmp_path)}


def test_a_stream_that_comes_whole_but_wrong_is_read_again(tmp_path: Path) -> None:
    """A guest whose ``base64`` encodes other bytes than the stream's: each chunk taken
    from the status fails the index's hash, is counted as a mismatch and read; the tree
    is exact."""
    ws = _small_workspace(tmp_path / "ws")
    env = _shimmed(tmp_path, "base64", _LYING_BASE64)
    transport = ScriptLog(env=env)
    result = run_pull(transport, ws, tmp_path / "out", options(tmp_path, helpers=False))
    assert_exact(ws, tmp_path / "out")
    assert transport.ran.count("read") == 2, transport.ran  # the manifest's, the archive's
    # each copy was seen to be wrong (not merely absent), and cost a read, not a retry (a
    # loaded machine: a run whose status came before its ``done`` carried no copy, and was
    # read at once)
    assert 1 <= result.faults.get("chunk-hash-mismatch", 0) <= 2, result.faults
    assert result.retries == 0


_FAILING_TAR = """#!/bin/sh
# the guest's tar, failing an archive run on a file whose name is not UTF-8, as busybox
# tar prints it: raw
case "$*" in *-cf*) printf 'tar: ./caf\\351: Cannot open: Permission denied\\n' >&2; exit 2 ;; esac
exec {real} "$@"
"""


def test_a_run_that_failed_on_a_name_not_utf8_fails_once_and_the_next_pull_works(
    tmp_path: Path,
) -> None:
    """A failed run's message names a file in bytes that are not UTF-8 (a busybox tar):
    the status that carries it is read (the name escaped), the pull fails with the guest's
    reason, and the next pull starts afresh.  Refusing the record made every later pull
    fail the same way, ``--full`` too: nothing ever learnt that the run had failed."""
    ws = _small_workspace(tmp_path / "ws")
    env = _shimmed(tmp_path, "tar", _FAILING_TAR)
    dest = tmp_path / "out"
    opts = options(tmp_path, helpers=False)
    with pytest.raises(StagingFailed, match=r"tar exited 2: tar: \./caf\\xe9: Cannot open"):
        run_pull(LocalTransport(env=env), ws, dest, opts)
    assert not dest.exists()
    result = run_pull(LocalTransport(env={"HOME": str(tmp_path)}), ws, dest, opts)
    assert result.ok
    assert_exact(ws, dest)


class StagedFileEdited(ScriptLog):
    """A guest whose staged stream changes under its index before the first read (another
    user of the guest, a full disk's torn write): each read's envelope hashes what the
    guest sent, which is not the bytes the index hashed."""

    def __init__(self, staging: Path, **kw: object) -> None:
        super().__init__(**kw)
        self.staging = staging
        self.edited: list[Path] = []

    def note(self, text: str) -> None:
        super().note(text)
        if self.ran[-1] == "read" and not self.edited:
            for data in sorted(self.staging.glob("*/data")):
                with data.open("r+b") as f:
                    first = f.read(1)
                    f.seek(0)
                    f.write(bytes([first[0] ^ 0x80]))
                self.edited.append(data)


def test_a_chunk_whose_reads_never_match_its_index_fails_integrity(tmp_path: Path) -> None:
    """Every read of the chunk verifies (the guest hashes what it sends) and every one
    disagrees with the index: after the attempt budget the pull fails with integrity not
    established (exit 6), each attempt counted, and DEST is not created."""
    ws = make_tree(tmp_path / "ws", big=2 * 1024 * 1024, small=5)
    transport = StagedFileEdited(tmp_path / "staging")
    opts = options(tmp_path, helpers=False, max_attempts=3, chunk_size=512 * 1024)
    with pytest.raises(IntegrityFailed) as failed:
        run_pull(transport, ws, tmp_path / "out", opts)
    assert transport.edited, transport.ran
    assert failed.value.exit_code == 6
    assert "never matched its index hash" in str(failed.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("digest", "whole stream"),
        ("chunks", "index lists"),
        ("length", "index covers"),
    ],
)
def test_a_done_record_that_disagrees_with_the_stream_fails_integrity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, message: str
) -> None:
    """The guest's ``done`` record is the last word on the stream: every chunk may verify and
    the tree extract, and a record that names another whole-stream hash, chunk count or
    length still fails the pull (exit 6) before DEST is touched."""
    real = records.parse_status

    def lying(payload: bytes, algorithm: Any, index_from: int = -1) -> records.StatusReport:
        report = real(payload, algorithm, index_from)
        if report.done is None:
            return report
        done = report.done
        lie = {"digest": "0" * len(done.digest), "chunks": done.chunks + 1,
               "length": done.length + 1}[field]  # fmt: skip
        return dataclasses.replace(report, done=dataclasses.replace(done, **{field: lie}))

    monkeypatch.setattr(records, "parse_status", lying)
    ws = make_tree(tmp_path / "ws", big=300 * 1024, small=5)
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "kept").write_text("what DEST held before\n")
    opts = options(tmp_path, helpers=False, force=True)
    with pytest.raises(IntegrityFailed, match=message) as failed:
        run_pull(LocalTransport(), ws, dest, opts)
    assert failed.value.exit_code == 6
    assert sorted(os.listdir(dest)) == ["kept"]


@pytest.mark.parametrize("closing", ["transport", "helpers"])
def test_a_stop_while_the_pull_closes_its_connections_is_its_success(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch, closing: str
) -> None:
    """Once the pull returned, DEST is swapped: a stop that lands while the guest helpers
    or the transport close is that success, never an interruption (which promises DEST
    untouched).  Seen as a random-signal test's run that said 130 with DEST in place."""
    from wsync.engine.helpers import HelperPool
    from wsync.engine.pull import pull_uri

    entered: list[asyncio.Event] = []

    async def slow_close(self: object) -> None:
        entered[0].set()
        await asyncio.sleep(30)

    owner = LocalTransport if closing == "transport" else HelperPool
    monkeypatch.setattr(owner, "aclose", slow_close)
    dest = tmp_path / "out"

    async def go() -> object:
        entered.append(asyncio.Event())
        task = asyncio.create_task(pull_uri(f"local:{workspace}", dest, options(tmp_path)))
        await asyncio.wait_for(entered[0].wait(), 120)
        assert dest.exists()
        task.cancel()
        return await task

    result = asyncio.run(go())
    assert getattr(result, "ok", False), result
    assert_exact(workspace, dest)


@pytest.mark.parametrize("long_argv", [True, False], ids=["long-argv", "short-argv"])
def test_the_producer_installs_in_parts_as_large_as_the_exec_takes(
    tmp_path: Path, long_argv: bool
) -> None:
    """A fresh sandbox gets the producer first, in parts, each a round trip on the HTTP
    backends: gzipped, in base64 (which a URL keeps nearly as it is), 3 calls for the
    12 KB producer where 1.5 KiB parts of its text take 9; where an exec's argv may be
    long the parts are larger (each command line under Dropbear's limit)."""
    ws = _small_workspace(tmp_path / "ws")
    transport = ScriptLog()
    transport.capabilities = dataclasses.replace(transport.capabilities, long_argv=long_argv)  # type: ignore[misc]
    run_pull(transport, ws, tmp_path / "out", options(tmp_path, helpers=False))
    assert_exact(ws, tmp_path / "out")
    # this guest has gzip and base64: the script goes compressed
    size = scripts.INSTALL_PART_LONG if long_argv else scripts.INSTALL_PART_GZ64
    parts = scripts.install_parts(size, "gz64")
    assert transport.ran.count("install") == parts
    assert parts * 2 < scripts.install_parts()
    wire = scripts.Wire(
        gate=True, nonce="0" * 16, algorithm="sha256", b64=True, staging_root="/s" * 20
    )
    for encoding in ("raw", "gz64"):
        for part in range(scripts.install_parts(scripts.INSTALL_PART_LONG, encoding)):
            argv = scripts.install_producer(
                **wire,
                part=part,
                run="f" * 32,
                part_size=scripts.INSTALL_PART_LONG,
                encoding=encoding,
            )
            assert scripts.exec_length(argv) < scripts.EXEC_CARRY_MAX, (encoding, part)


def test_a_guest_whose_gzip_fails_gets_the_producer_plain(tmp_path: Path) -> None:
    """Where the compressed install cannot be decoded (a ``gzip`` that fails), the producer
    goes again in plain parts, and the pull is exact."""
    ws = _small_workspace(tmp_path / "ws")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "gzip"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    transport = ScriptLog(env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    transport.capabilities = dataclasses.replace(transport.capabilities, long_argv=False)  # type: ignore[misc]
    opts = options(tmp_path, helpers=False, compressor="zstd")
    run_pull(transport, ws, tmp_path / "out", opts)
    assert_exact(ws, tmp_path / "out")
    gz64 = scripts.install_parts(scripts.INSTALL_PART_GZ64, "gz64")
    assert transport.ran.count("install") == gz64 + scripts.install_parts()


def test_pulls_in_one_process_leave_no_writer_threads(tmp_path: Path) -> None:
    """The daemon pulls in its own process, every few minutes: a pull with nothing to swap,
    a dry run and a failed pull end their journal and writer threads like any other."""
    ws = _small_workspace(tmp_path / "ws")
    dest = tmp_path / "out"
    opts = options(tmp_path)

    def writer_threads() -> list[str]:
        names = [t.name for t in threading.enumerate()]
        return [n for n in names if n.startswith(("wsync-journal", "wsync-writer"))]

    run_pull(LocalTransport(), ws, dest, opts)  # the first, a full pull
    run_pull(LocalTransport(), ws, dest, opts)  # nothing changed
    (ws / "new.txt").write_text("new\n")
    run_pull(LocalTransport(), ws, dest, dataclasses.replace(opts, dry_run=True))
    with pytest.raises(UsageError):
        run_pull(LocalTransport(), ws / "missing", tmp_path / "other", opts)
    run_pull(LocalTransport(), ws, dest, opts)
    deadline = time.monotonic() + 30
    while writer_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writer_threads() == []


@pytest.mark.parametrize(
    ("before", "change", "says"),
    [
        # rm -rf d && touch d: a file where the first read put a directory
        ("dir", 'rm -rf "$WS/d"; echo file > "$WS/d"', "a directory, then a non-directory"),
        # the reverse, rm d && mkdir d: a directory where the first read put a file
        (
            "file",
            'rm -f "$WS/d"; mkdir "$WS/d"; echo x > "$WS/d/inner"',
            "a non-directory, then a directory",
        ),
    ],
)
def test_an_entry_that_changed_kind_while_read_is_a_change_not_a_hostile_archive(
    tmp_path: Path, before: str, change: str, says: str
) -> None:
    """``d`` changes kind while the guest's tar reads the workspace: the re-read round
    archives it as the other kind.  That is a workspace that changed while read (exit 24,
    run again), not a hostile archive (exit 7); DEST is not made, and the next pull, the
    workspace at rest, is exact."""
    ws = tmp_path / "ws"
    ws.mkdir()
    if before == "dir":
        (ws / "d").mkdir()
        (ws / "d" / "inner").write_text("inner\n")
    else:
        (ws / "d").write_text("a file first\n")
    (ws / "keep").write_text("keep\n")
    guest = writer_around_tar(
        tmp_path, f'real_tar "$@"; rc=$?\n[ $N = 1 ] && {{ {change}; }}\nexit $rc'
    )
    dest = tmp_path / "out"
    opts = options(tmp_path, helpers=False)
    with pytest.raises(UnstableFiles, match=says) as failed:
        run_pull(guest, ws, dest, opts)
    assert failed.value.exit_code == 24
    assert not dest.exists()
    run_pull(LocalTransport(), ws, dest, opts)
    assert_exact(ws, dest)


def test_gnu_tar_behind_a_noisy_wrapper_is_still_taken_for_gnu_tar(tmp_path: Path) -> None:
    """Found by a review: the host told GNU tar by the first line of ``tar --version``
    (stderr included) while the producer looks at all of it; a tar behind something that
    warns first (a failed ``LD_PRELOAD``) had its exit 1, GNU tar's "a file changed while
    read", taken for busybox's failure.  The probe's ``has_gnu_tar`` decides both."""
    ws = make_tree(tmp_path / "ws")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    real = shutil.which("tar")
    (bindir / "tar").write_text(
        "#!/bin/sh\n"
        "echo \"ERROR: ld.so: object 'x.so' from LD_PRELOAD cannot be preloaded\" >&2\n"
        f'{real} "$@"; rc=$?\n'
        # GNU tar's exit for a file that changed while it was read
        'case " $* " in *" -cf "*) [ "$rc" = 0 ] && exit 1 ;; esac\n'
        "exit $rc\n"
    )
    (bindir / "tar").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    result = run_pull(LocalTransport(env=env), ws, tmp_path / "out", options(tmp_path))
    assert_exact(ws, tmp_path / "out")
    assert any("changed while archiving (exit 1)" in w for w in result.warnings), result.warnings
