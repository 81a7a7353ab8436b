"""Incremental pulls end to end (issue 8): every kind of change between two pulls gives an
exact DEST, an unchanged workspace changes nothing, over local: and a real sshd."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import assert_exact, make_tree, options
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.pull import pull
from wsync.errors import Fenced, HostIOError, StagingFailed
from wsync.testing.sshd import SshdServer
from wsync.transports.base import Transport
from wsync.transports.local import LocalTransport
from wsync.transports.ssh import SshTransport
from wsync.uri import parse

Make = Callable[[Path], tuple[Transport, str]]


def _local(ws: Path) -> tuple[Transport, str]:
    return LocalTransport(), str(ws)


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.ssh)])
def make(request: pytest.FixtureRequest) -> Make:
    if request.param == "local":
        return _local
    server: SshdServer = request.getfixturevalue("sshd")

    def ssh(ws: Path) -> tuple[Transport, str]:
        uri = parse(server.uri(str(ws)))
        return SshTransport.from_uri(uri, server.transport_options()), str(ws)

    return ssh


def go(make: Make, ws: Path, dest: Path, opts: PullOptions) -> PullResult:
    async def run() -> PullResult:
        transport, path = make(ws)
        try:
            return await pull(transport, path, dest, opts)
        finally:
            await transport.aclose()

    return asyncio.run(run())


def change_everything(ws: Path) -> None:
    """One of each kind of change the issue lists."""
    small = sorted((ws / "src").glob("f*.txt"))
    # append
    with small[0].open("ab") as f:
        f.write(b"appended\n")
    # same-size rewrite, mtime put back
    victim = small[1]
    st = victim.stat()
    data = victim.read_bytes()
    victim.write_bytes(bytes(b ^ 0xFF for b in data[:16]) + data[16:])
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    # delete a file, a directory
    small[2].unlink()
    (ws / "gone-dir" / "sub").mkdir(parents=True, exist_ok=True)
    # new files and directories, one with a non-UTF-8 name
    (ws / "new-dir" / "deeper").mkdir(parents=True)
    (ws / "new-dir" / "deeper" / "n.txt").write_bytes(b"new\n")
    (Path(os.fsdecode(bytes(ws) + b"/caf\xe9-\xff.bin"))).write_bytes(b"latin-1 name\n")
    # rename a file and a directory
    small[3].rename(small[3].with_name(small[3].name + ".renamed"))
    (ws / "tree-a").rename(ws / "tree-a-renamed")
    # file -> directory, directory -> file
    (ws / "f2d").unlink()
    (ws / "f2d").mkdir()
    (ws / "f2d" / "inside").write_bytes(b"was a file\n")
    shutil.rmtree(ws / "d2f")
    (ws / "d2f").write_bytes(b"was a directory\n")
    # symlink retargeted, file -> symlink, symlink -> file
    (ws / "link").unlink()
    (ws / "link").symlink_to("f2d/inside")
    (ws / "f2l").unlink()
    (ws / "f2l").symlink_to("d2f")
    (ws / "l2f").unlink()
    (ws / "l2f").write_bytes(b"was a link\n")
    # chmod +x / -x
    (ws / "exe").chmod(0o755)
    (ws / "noexe").chmod(0o644)
    # empty dirs added and removed
    (ws / "empty-new").mkdir()
    (ws / "empty-old").rmdir()
    shutil.rmtree(ws / "gone-dir")


def prepare(ws: Path) -> None:
    make_tree(ws, big=256 * 1024, small=30)
    (ws / "tree-a" / "x").mkdir(parents=True)
    (ws / "tree-a" / "x" / "y.txt").write_bytes(b"y\n")
    (ws / "f2d").write_bytes(b"file\n")
    (ws / "d2f").mkdir()
    (ws / "d2f" / "z").write_bytes(b"z\n")
    (ws / "link").symlink_to("f2d")
    (ws / "f2l").write_bytes(b"file\n")
    (ws / "l2f").symlink_to("f2l")
    (ws / "exe").write_bytes(b"#!/bin/sh\n")
    (ws / "exe").chmod(0o644)
    (ws / "noexe").write_bytes(b"#!/bin/sh\n")
    (ws / "noexe").chmod(0o755)
    (ws / "empty-old").mkdir()
    (ws / "gone-dir").mkdir()
    (ws / "gone-dir" / "g").write_bytes(b"g\n")


def test_every_kind_of_change_is_exact(tmp_path: Path, make: Make) -> None:
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    opts = options(tmp_path, chunk_size=256 * 1024)
    first = go(make, ws, dest, opts)
    assert first.mode == "full"
    assert_exact(ws, dest)

    change_everything(ws)
    second = go(make, ws, dest, opts)
    assert_exact(ws, dest)
    assert second.mode == "incremental"
    assert second.changed_files > 0 and second.deleted_files > 0
    assert second.transferred_bytes < first.transferred_bytes

    # unchanged: nothing fetched, DEST not written at all
    before = os.stat(dest)
    third = go(make, ws, dest, opts)
    assert third.mode == "incremental" and third.changed_files == 0
    assert third.deleted_files == 0 and third.chunks == 0
    after = os.stat(dest)
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    assert_exact(ws, dest)


def test_full_forces_a_full_pull(tmp_path: Path) -> None:
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    opts = options(tmp_path)
    go(_local, ws, dest, opts)
    (ws / "exe").write_bytes(b"changed\n")
    result = go(_local, ws, dest, options(tmp_path, full=True))
    assert result.mode == "full"
    assert_exact(ws, dest)
    # and the full pull left a baseline: the next one is incremental again
    assert go(_local, ws, dest, opts).mode == "incremental"
    assert_exact(ws, dest)


def test_hardlinked_files_are_fetched_together(tmp_path: Path) -> None:
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    (ws / "h1").write_bytes(b"one inode\n")
    os.link(ws / "h1", ws / "h2")
    opts = options(tmp_path)
    go(_local, ws, dest, opts)
    with (ws / "h1").open("ab") as f:
        f.write(b"more\n")
    result = go(_local, ws, dest, opts)
    assert result.mode == "incremental"
    assert_exact(ws, dest)
    assert os.stat(dest / "h1").st_ino == os.stat(dest / "h2").st_ino


def test_a_kept_file_shares_no_write_with_the_old_tree(tmp_path: Path) -> None:
    """Replace mode: a changed file is a new inode; the old tree's inode keeps its bytes
    (a reader holding the old DEST open sees the old content, never a mix)."""
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    opts = options(tmp_path)
    go(_local, ws, dest, opts)
    target = sorted(p for p in dest.rglob("*.bin") if p.is_file())[0]
    rel = target.relative_to(dest)
    old_bytes = target.read_bytes()
    with target.open("rb") as held:
        (ws / rel).write_bytes(b"rewritten\n")
        go(_local, ws, dest, opts)
        assert held.read() == old_bytes
    assert (dest / rel).read_bytes() == b"rewritten\n"


#: what the Sprites emulator counts of the faults it injects into execs
SPRITES_FAULTS = (
    "ring_dropped_bytes",
    "severed",
    "zero_frames",
    "no_exit_frame",
    "data_after_exit",
)


@pytest.mark.parametrize("helpers", [True, False], ids=["helpers", "exec-per-call"])
def test_every_kind_of_change_over_sprites_with_every_fault_on(
    tmp_path: Path, helpers: bool
) -> None:
    from wsync.emulators.sprites import EmulatorThread, SpritesFaults
    from wsync.engine.pull import pull_uri

    with EmulatorThread(tmp_path / "emu") as emu:
        ws = emu.create_sprite("incr") / "work"
        prepare(ws)
        dest = tmp_path / "out"
        opts = options(tmp_path, chunk_size=128 * 1024, helpers=helpers)
        uri = f"sprites://incr{ws}"

        def sprite_pull() -> PullResult:
            return asyncio.run(pull_uri(uri, dest, opts, emu.transport_options()))

        faults = SpritesFaults.all_on(seed=21)
        if helpers:
            # a few execs: data after the exit drawn for each, so a helper's channel
            # surely meets it (its answers held for an exit that does not come)
            faults = dataclasses.replace(faults, data_after_exit=1.0)
        else:
            # a third of the execs severed within their first 256 bytes (answers are
            # short): the engine's retries surely run; the other faults a transport may
            # absorb, and an incremental pull is a dozen execs
            faults = dataclasses.replace(faults, sever=0.3, sever_max_bytes=256)
        emu.set_faults(faults)
        assert sprite_pull().mode == "full"
        assert_exact(ws, dest)
        change_everything(ws)
        before = dict(emu.stats)
        result = sprite_pull()
        assert result.mode == "incremental"
        hit = {k: emu.stats[k] - before.get(k, 0) for k in (*SPRITES_FAULTS, "held_released")}
        if helpers:
            assert hit["held_released"] > 0, hit
        else:
            assert sum(hit[k] for k in SPRITES_FAULTS) > 0, hit  # the exec path's own faults
            assert result.retries > 0  # and the engine's retries met them
        assert_exact(ws, dest)
        assert sprite_pull().changed_files == 0
        assert_exact(ws, dest)


@pytest.mark.parametrize("backend", ["daytona", "cloudflare"])
def test_no_stdin_backends_take_the_list_in_argv_parts(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """Cloudflare and Daytona have no stdin: the list travels base64 in argv parts."""
    from wsync.engine.pull import pull_uri

    emu = request.getfixturevalue(f"{backend}_emulator")
    ws = tmp_path / "ws"
    prepare(ws)
    dest = tmp_path / "out"
    opts = options(tmp_path)
    # the emulators serve the host's files: the workspace path is the host path
    name = "conformance"
    uri = f"{backend}://{name}{ws}"

    def once() -> PullResult:
        return asyncio.run(pull_uri(uri, dest, opts, emu.transport_options()))

    once()
    change_everything(ws)
    for i in range(300):  # a list longer than one argv part
        (ws / "src" / f"added-{i:04d}-{'n' * 40}").write_bytes(b"%d\n" % i)
    result = once()
    assert result.mode == "incremental"
    assert_exact(ws, dest)


@pytest.mark.parametrize("batches", [True, False], ids=["stat-batches", "stat-each"])
def test_busybox_only_guest_pulls_incrementally(tmp_path: Path, batches: bool) -> None:
    """busybox find has no -printf: the manifest goes through stat -c, whole seconds, one
    stat per batch of names; where a batch fails (a name vanished: here a stat that
    refuses more than one name) a stat per name, the listing the same."""
    from helpers import busybox_bin, tool_dir

    path = busybox_bin(tmp_path / "bb")
    busybox = shutil.which("busybox")
    tool_dir(path, ("stat", "readlink"), target=busybox)
    if not batches:
        (path / "stat").unlink()
        (path / "stat").write_text(
            f'#!{busybox} sh\n[ $# -le 4 ] || exit 1\nexec {busybox} stat "$@"\n'
        )
        (path / "stat").chmod(0o755)
    env = {"PATH": str(path), "HOME": str(tmp_path)}

    def bb(ws: Path) -> tuple[Transport, str]:
        return LocalTransport(env=env), str(ws)

    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    opts = options(tmp_path, chunk_size=256 * 1024)
    assert go(bb, ws, dest, opts).mode == "full"
    assert_exact(ws, dest)
    change_everything(ws)
    result = go(bb, ws, dest, opts)
    assert result.mode == "incremental"
    assert_exact(ws, dest)
    again = go(bb, ws, dest, opts)
    assert again.mode == "incremental" and again.changed_files == 0


def _busybox_guest(tmp_path: Path) -> tuple[Callable[[Path], tuple[Transport, str]], Path]:
    """A guest of busybox applets (find, tar, stat, readlink...): its maker and its PATH."""
    from helpers import busybox_bin, tool_dir

    path = busybox_bin(tmp_path / "bb")
    tool_dir(path, ("stat", "readlink"), target=shutil.which("busybox"))
    env = {"PATH": str(path), "HOME": str(tmp_path)}
    return (lambda ws: (LocalTransport(env=env), str(ws))), path


def test_a_busybox_select_run_keeps_hardlink_groups_across_its_batches(tmp_path: Path) -> None:
    """busybox tar takes the list through xargs, one archive per batch: two names of one
    inode in two batches arrived as two files, and every later pull kept them apart (the
    names were recorded as fetched).  The host joins them from the manifest's inodes."""
    bb, _ = _busybox_guest(tmp_path)
    ws, dest = tmp_path / "ws", tmp_path / "out"
    ws.mkdir()
    (ws / "base").write_text("base\n")
    opts = options(tmp_path)
    assert go(bb, ws, dest, opts).mode == "full"
    (ws / "aaa_first").write_text("shared\n")
    long = "x" * 120
    for i in range(1500):  # ~190 KB of names: more than one xargs batch
        (ws / f"m_{long}_{i:05d}").write_text(str(i))
    os.link(ws / "aaa_first", ws / "zzz_last")
    os.link(ws / "aaa_first", ws / f"m_{long}_00700b")
    result = go(bb, ws, dest, opts)
    assert result.mode == "incremental" and result.changed_files == 1504  # and the root
    assert_exact(ws, dest)
    names = ("aaa_first", "zzz_last", f"m_{long}_00700b")
    assert len({os.lstat(dest / n).st_ino for n in names}) == 1
    assert os.lstat(dest / "aaa_first").st_nlink == 3
    again = go(bb, ws, dest, opts)
    assert again.changed_files == again.deleted_files == 0


def test_a_busybox_listing_that_cannot_read_a_directory_fails(tmp_path: Path) -> None:
    """A guest user who may not open a directory: busybox find says so and goes on, and
    xargs's status hid find's, so the listing lacked the directory's entries and the pull
    deleted them from DEST (exit 0, one warning).  It fails now, as with GNU find (exit 5),
    DEST untouched.  (Tests run as root, who opens anything: a find wrapper says it.)"""
    bb, bindir = _busybox_guest(tmp_path)
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    opts = options(tmp_path)
    go(bb, ws, dest, opts)
    before = {p.relative_to(dest) for p in dest.rglob("*")}
    (bindir / "find").unlink()
    (bindir / "find").write_text(
        f"#!{sys.executable}\n"
        "import subprocess, sys\n"
        f"out = subprocess.run([{shutil.which('busybox')!r}, 'find', *sys.argv[1:]],"
        " stdout=subprocess.PIPE).stdout\n"
        "sys.stdout.buffer.write(b'\\0'.join(p for p in out.split(b'\\0')"
        " if not p.startswith(b'./src/')))\n"
        "sys.stderr.write('find: ./src: Permission denied\\n')\n"
        "sys.exit(1)\n"
    )
    (bindir / "find").chmod(0o755)
    (ws / "README.md").write_text("something to pull\n")
    with pytest.raises(
        StagingFailed, match=r"listing \(find\) exited 2: find: \./src: Perm"
    ) as failed:
        go(bb, ws, dest, opts)
    assert failed.value.exit_code == 5
    assert {p.relative_to(dest) for p in dest.rglob("*")} == before


def test_a_busybox_guest_pulls_files_dated_in_the_future(tmp_path: Path) -> None:
    """Without -cnewer only mtimes tell what changed during the read, and a file dated in
    the future (clock skew, an unpacked archive) is newer than any mark: it was unstable
    in every pull, --full included (exit 24).  Whole-tree and select runs both pull it."""
    bb, _ = _busybox_guest(tmp_path)
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    future = time.time() + 5 * 365 * 86400
    os.utime(ws / "f2d", (future, future))
    os.symlink("f2d", ws / "ahead")
    os.utime(ws / "ahead", (future, future), follow_symlinks=False)
    opts = options(tmp_path)
    assert go(bb, ws, dest, opts).mode == "full"
    assert_exact(ws, dest)
    (ws / "later.txt").write_text("later\n")
    os.utime(ws / "later.txt", (future, future))
    result = go(bb, ws, dest, opts)
    assert result.mode == "incremental" and not result.unstable_files
    assert_exact(ws, dest)


def test_only_a_directory_changed_is_an_empty_select_run(tmp_path: Path) -> None:
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    opts = options(tmp_path)
    go(_local, ws, dest, opts)
    (ws / "src").chmod(0o700)
    os.utime(ws / "empty", ns=(0, 1_500_000_000_123_456_789))
    result = go(_local, ws, dest, opts)
    assert result.mode == "incremental" and result.changed_files == 2
    assert_exact(ws, dest)


def test_a_lapsed_lease_stops_the_swap_of_an_apply_run(tmp_path: Path) -> None:
    """The fleet's fence is the last word before every swap, the farm-only apply run's too
    (a deletion has nothing to fetch): a daemon whose lease ran out leaves DEST as it was."""
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    go(_local, ws, dest, options(tmp_path))
    before = sorted(p.relative_to(dest) for p in dest.rglob("*"))
    victim = sorted((ws / "src").glob("f*.txt"))[0]
    victim.unlink()

    def lapsed() -> None:
        raise Fenced("lease lost")

    with pytest.raises(Fenced):
        go(_local, ws, dest, options(tmp_path, fence=lapsed))
    assert sorted(p.relative_to(dest) for p in dest.rglob("*")) == before
    result = go(_local, ws, dest, options(tmp_path))
    assert result.mode == "incremental" and result.deleted_files == 1
    assert_exact(ws, dest)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wsync", "pull", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_excludes_and_dry_run_from_the_command_line(tmp_path: Path) -> None:
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    (ws / "node_modules" / "pkg").mkdir(parents=True)
    (ws / "node_modules" / "pkg" / "big.js").write_bytes(os.urandom(2 * 1024 * 1024))
    (ws / "src" / "x.pyc").write_bytes(b"bytecode")
    common = ["--state-dir", str(tmp_path / "state"), "--staging-dir", str(tmp_path / "st")]
    # the first pull takes everything
    first = cli(f"local:{ws}", str(dest), "--json", *common)
    assert first.returncode == 0, first.stderr
    assert (dest / "node_modules" / "pkg" / "big.js").exists()
    # a dry run lists what excluding would delete, and writes nothing
    excl = ["--exclude", "node_modules/", "--exclude-from", str(tmp_path / "ex")]
    (tmp_path / "ex").write_text("# comment\n*.pyc\n")
    before = sorted(str(p) for p in dest.rglob("*"))
    dry = cli(f"local:{ws}", str(dest), "--dry-run", *excl, *common)
    assert dry.returncode == 0, dry.stderr
    assert "*deleting   node_modules/pkg/big.js" in dry.stdout
    assert "*deleting   src/x.pyc" in dry.stdout
    assert sorted(str(p) for p in dest.rglob("*")) == before
    # the real pull deletes the excluded entries, and their bytes never cross
    real = cli(f"local:{ws}", str(dest), "--json", *excl, *common)
    assert real.returncode == 0, real.stderr
    result = json.loads(real.stdout)
    assert result["mode"] == "incremental" and result["deleted_files"] >= 3
    assert not (dest / "node_modules").exists() and not (dest / "src" / "x.pyc").exists()
    times = {d: os.stat(d).st_mtime_ns for d in (ws, ws / "src")}
    shutil.rmtree(ws / "node_modules")
    (ws / "src" / "x.pyc").unlink()
    for d, t in times.items():
        os.utime(d, ns=(t, t))
    assert_exact(ws, dest)
    # a first pull with excludes never reads the excluded bytes
    (ws / "node_modules" / "pkg").mkdir(parents=True)
    (ws / "node_modules" / "pkg" / "big.js").write_bytes(os.urandom(2 * 1024 * 1024))
    other = tmp_path / "other"
    fresh = cli(f"local:{ws}", str(other), "--json", *excl, *common)
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout)["transferred_bytes"] < 1024 * 1024
    assert not (other / "node_modules").exists()


def test_exclude_from_dash_reads_standard_input(tmp_path: Path) -> None:
    """``--exclude-from -`` reads the patterns from stdin, as rsync does (it was taken for
    a file named "-")."""
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    (ws / "src" / "x.pyc").write_bytes(b"bytecode")
    args = [f"local:{ws}", str(dest), "--exclude-from", "-", "--state-dir", str(tmp_path / "st")]
    proc = subprocess.run(
        [sys.executable, "-m", "wsync", "pull", *args, "--staging-dir", str(tmp_path / "sg")],
        input="# from a pipe\n*.pyc\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert not (dest / "src" / "x.pyc").exists()
    t = os.stat(ws / "src").st_mtime_ns
    (ws / "src" / "x.pyc").unlink()
    os.utime(ws / "src", ns=(t, t))
    assert_exact(ws, dest)


def test_a_missing_exclude_file_is_exit_2(tmp_path: Path) -> None:
    proc = cli("local:/tmp", str(tmp_path / "o"), "--exclude-from", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("stdin", [True, False])
def test_every_kind_of_change_through_chaos_all(tmp_path: Path, stdin: bool) -> None:
    """--chaos all on every call, the list upload included (on stdin, or in argv parts)."""
    from wsync.chaos import ChaosTransport, FaultPlan
    from wsync.transports.base import Capabilities

    def chaotic(ws: Path) -> tuple[Transport, str]:
        # without stdin nothing gates the output: the pre-attach ring eats reads above
        # it, so it must be larger than the smallest read (64 KiB on binary channels)
        ring = "" if stdin else ",ring=98304"
        plan = FaultPlan.parse("all=0.05,seed=7,hang=0.2" + ring)
        transport = ChaosTransport(LocalTransport(), plan)
        if not stdin:
            transport.capabilities = Capabilities(stdin=False)  # type: ignore[misc]
        return transport, str(ws)

    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    opts = options(tmp_path, chunk_size=128 * 1024)
    go(chaotic, ws, dest, opts)
    assert_exact(ws, dest)
    change_everything(ws)
    result = go(chaotic, ws, dest, opts)
    assert result.mode == "incremental" and result.retries > 0
    assert_exact(ws, dest)


def test_excludes_on_a_guest_that_cannot_list_fail_clearly(tmp_path: Path) -> None:
    """Without find -printf or stat, a full tar would carry the excluded bytes: refused."""
    from helpers import busybox_bin
    from wsync.engine.excludes import Excludes
    from wsync.errors import GuestToolsMissing

    path = busybox_bin(tmp_path / "bb")  # busybox find, but no stat or readlink
    env = {"PATH": str(path), "HOME": str(tmp_path)}
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    opts = options(tmp_path, excludes=Excludes.from_options(["*.bin"], []))
    with pytest.raises(GuestToolsMissing):
        go(lambda w: (LocalTransport(env=env), str(w)), ws, dest, opts)
    assert not dest.exists()


@pytest.mark.parametrize("where", ["state/pulls", "state", "holds-state"])
def test_a_dest_over_the_state_directory_is_refused(tmp_path: Path, where: str) -> None:
    """DEST being, inside or around --state-dir: the swap would put the guest's tree over
    the journal (or move the state away), and the pull then failed after changing DEST."""
    ws = tmp_path / "ws"
    prepare(ws)
    state = tmp_path / ("holds-state/.st" if where == "holds-state" else "state")
    first = cli(f"local:{ws}", str(tmp_path / "a"), "--state-dir", str(state), "--json")
    assert first.returncode == 0, first.stderr
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "ws" not in p.parts)
    dest = tmp_path / where
    done = cli(f"local:{ws}", str(dest), "--state-dir", str(state), "--force", "--json")
    assert done.returncode == 2, done.stderr
    assert "state directory" in json.loads(done.stdout)["error"]
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "ws" not in p.parts)
    assert after == before


def test_an_immutable_file_in_dest_says_what_to_do(tmp_path: Path) -> None:
    """A DEST file made immutable (``chattr +i``) cannot be hard-linked into the new tree:
    a red team got "building the new tree, a: Operation not permitted" on every pull.  It
    says why and what lifts it now; DEST stays as it was, and --full works."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a").write_text("a\n")
    (ws / "b").write_text("b\n")
    dest = tmp_path / "out"
    opts = options(tmp_path)
    asyncio.run(pull(LocalTransport(), str(ws), dest, opts))
    if subprocess.run(["chattr", "+i", str(dest / "a")], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        (ws / "b").write_text("b, changed\n")
        with pytest.raises(HostIOError, match=r"chattr -i.*--full") as info:
            asyncio.run(pull(LocalTransport(), str(ws), dest, opts))
        assert info.value.exit_code == 8
        assert (dest / "b").read_text() == "b\n"
        full = asyncio.run(pull(LocalTransport(), str(ws), dest, options(tmp_path, full=True)))
        assert full.ok, full.error
    finally:
        for leftover in [dest / "a", *tmp_path.glob(".out.wsync-*/a")]:
            subprocess.run(["chattr", "-i", str(leftover)], capture_output=True)
    assert_exact(ws, dest)
