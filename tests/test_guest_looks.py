"""What the guest's waiting loops cost: a status long poll's looks fork nothing.

Every look of a status long poll used to fork ``wc`` for the index's size and ``cat``
and ``tr`` (twice each) to see whether the producer still runs; with the producer's own
loop, the reads and the answers, a 250 MB first pull ran about 625 programs in the
guest, a fifth of a loopback pull's CPU on a two-core machine (issue 13).  Now the pid
files and ``/proc/PID/cmdline`` are read with the shell's ``read``, and the index's size
comes from ``isize``, which the producer rewrites after each index line.  ``isize`` is
only a hint: the answer still measures the index, so a stale, missing or forged
``isize`` costs a look, never a wrong index.

Each test runs the status script by hand on a snapshot laid out as the producer
leaves it, with ``wc``, ``cat`` and ``tr`` shimmed to count their runs, under dash,
bash and a busybox-only guest.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import (
    GUEST_SHELLS,
    guest_shell_path,
    make_tree,
    options,
    run_status,
    shim_tools,
    tool_runs,
)
from wsync.engine.guest import GuestSession
from wsync.engine.guestcall import CallStats
from wsync.protocol import records, scripts
from wsync.protocol.hashing import ALGORITHMS
from wsync.transports.local import LocalTransport

COUNTED = ("wc", "cat", "tr")


@pytest.fixture(params=GUEST_SHELLS)
def guest_path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return guest_shell_path(request.param, tmp_path)


@pytest.fixture
def counted(tmp_path: Path, guest_path: str) -> tuple[str, Path]:
    """A PATH with ``wc``, ``cat`` and ``tr`` counting their runs in the returned log."""
    return shim_tools(tmp_path, guest_path, dict.fromkeys(COUNTED))


@pytest.fixture
def producer(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A snapshot directory whose ``pid`` and ``pid.launch`` name a live process that
    runs a file named like wsync's producer on that directory (a ``sh`` that waits)."""
    root = tmp_path / "staging"
    root.mkdir(mode=0o700)
    fake = root / ".producer-0000000000000000.sh"
    fake.write_text("sleep 300\n:\n")
    snap = root / "s-look"
    snap.mkdir()
    proc = subprocess.Popen(["sh", str(fake), str(snap), "/ws"], start_new_session=True)
    try:
        for name in ("pid", "pid.launch"):
            (snap / name).write_text(f"{proc.pid}\n")
        yield snap, proc.pid
    finally:
        proc.kill()
        proc.wait()


def _status(snap: Path, path: str, index_from: int, looks: int) -> records.StatusReport:
    return run_status(snap, path, index_from, looks)


def _proc(pid: int) -> dict[str, object]:
    """What /proc says of ``pid`` now (for a failure's message)."""
    found: dict[str, object] = {}
    for name in ("cmdline", "stat"):
        try:
            found[name] = Path(f"/proc/{pid}/{name}").read_bytes()
        except OSError as exc:
            found[name] = exc
    return found


def _runs(log: Path) -> dict[str, int]:
    return {tool: tool_runs(log, tool) for tool in COUNTED}


LINE = b"C 0 0 262144 " + b"a" * 64 + b"\n"


def test_a_long_poll_of_many_looks_forks_no_tool_per_look(
    producer: tuple[Path, int], counted: tuple[str, Path]
) -> None:
    """20 looks (0.6 s) on an index that does not grow: the answer's own measures only
    (the index and the data, each once; the envelope's length is the shell's own
    ``${#}``), nothing per look, and the live producer is seen without ``tr``."""
    snap, pid = producer
    path, log = counted
    (snap / "index").write_bytes(LINE)
    (snap / "isize").write_text(f"{len(LINE)}\n")
    (snap / "data").write_bytes(b"x" * 100)
    # tr is the fallback of a liveness check (4 in a status: 2 pid files, looked at before
    # and after the looks) whose read of /proc/PID/cmdline missed the producer's path; one
    # fresh-clone CI run on a loaded 2-core machine saw 2 such misses, which this machine
    # never showed in 20,000 reads. So a look's own work is counted in every round, and
    # "seen without tr" needs one round of three
    tr_runs = []
    for _ in range(3):
        log.unlink(missing_ok=True)
        report = _status(snap, path, len(LINE), looks=20)
        # (seen once in a CI run: not alive; what /proc said then, for the next time)
        assert report.alive, (report, _proc(pid), _runs(log))
        assert report.index_size == len(LINE) and report.index_tail == b""
        runs = _runs(log)
        assert runs["wc"] == 2 and runs["cat"] == 0 and runs["tr"] <= 4, runs
        tr_runs.append(runs["tr"])  # before: 23 wc, 4 cat, 4 tr
        if runs["tr"] == 0:
            break
    assert 0 in tr_runs, tr_runs


@pytest.mark.parametrize(
    "isize", ["", "garbage\n", "09\n", "0777\n", "999999999\n", "12345678901234567890\n", None]
)
def test_isize_is_a_hint_the_answer_measures_the_index(
    producer: tuple[Path, int], counted: tuple[str, Path], isize: str | None
) -> None:
    """A stale, forged, oversized or missing ``isize`` never reaches the host: the
    answer's size and tail are the index's own (a forged size that claims growth only
    ends the wait early).  A leading zero is refused too: the shell's arithmetic takes
    ``09`` for bad octal and ends the script (found in review), ``0777`` for 511."""
    snap, _ = producer
    path, _ = counted
    (snap / "index").write_bytes(LINE * 2)
    (snap / "data").write_bytes(b"")
    if isize is not None:
        (snap / "isize").write_text(isize)
    report = _status(snap, path, len(LINE), looks=3)
    assert report.index_size == 2 * len(LINE) and report.index_tail == LINE
    report = _status(snap, path, 2 * len(LINE), looks=3)
    assert report.index_size == 2 * len(LINE) and report.index_tail == b""


@pytest.mark.parametrize("with_isize", [True, False], ids=["isize", "no-isize"])
def test_a_long_poll_answers_when_the_index_grows(
    producer: tuple[Path, int], counted: tuple[str, Path], with_isize: bool
) -> None:
    """The index grows 0.3 s into a 10 s long poll: the answer comes with the new line,
    whether the producer keeps ``isize`` (this wsync's) or not (an older producer's
    snapshot, resumed: ``wc`` looks then)."""
    snap, _ = producer
    path, _ = counted
    (snap / "index").write_bytes(LINE)
    (snap / "data").write_bytes(b"")
    if with_isize:
        (snap / "isize").write_text(f"{len(LINE)}\n")

    def grow() -> None:
        time.sleep(0.3)
        with (snap / "index").open("ab") as f:
            f.write(LINE)
        if with_isize:
            (snap / "isize").write_text(f"{2 * len(LINE)}\n")

    grower = threading.Thread(target=grow)
    grower.start()
    started = time.monotonic()
    report = _status(snap, path, len(LINE), looks=scripts.status_looks(10.0))
    waited = time.monotonic() - started
    grower.join()
    assert report.index_size == 2 * len(LINE) and report.index_tail == LINE
    assert waited < 9, "the long poll waited out its looks although the index grew"


def test_a_pid_that_is_not_the_producers_is_not_busy(
    producer: tuple[Path, int], counted: tuple[str, Path]
) -> None:
    """A pid whose process is not the producer (here: a ``sleep`` of ours) is not
    busy: the fast path misses and ``tr`` has the last word, as before."""
    snap, _ = producer
    path, log = counted
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        for name in ("pid", "pid.launch"):
            (snap / name).write_text(f"{stranger.pid}\n")
        (snap / "index").write_bytes(b"")
        report = _status(snap, path, 0, looks=100)
        assert not report.alive
        assert _runs(log)["tr"] >= 1  # the fallback decided
    finally:
        stranger.kill()
        stranger.wait()


def test_the_producer_keeps_isize_equal_to_its_index(tmp_path: Path, guest_path: str) -> None:
    """A whole producer run: ``isize`` ends as the index's size, chunk by chunk."""
    ws = make_tree(tmp_path / "ws", big=3 << 20, small=20)
    env = {"PATH": guest_path, "HOME": str(tmp_path)}

    async def run() -> Path:
        session = GuestSession(LocalTransport(env=env), options(tmp_path), CallStats())
        plan = await session.probe(str(ws))
        assert not await session.admit("s-isize", str(ws), plan.compressor, level=1)
        for _ in range(1200):
            status = await session.status()
            if status.done is not None:
                break
            await asyncio.sleep(0.05)
        assert status.done is not None and status.done.chunks >= 3
        return Path(session.staging_root, "s-isize")

    snap = asyncio.run(run())
    index = (snap / "index").read_bytes()
    assert index.count(b"\n") >= 3
    assert (snap / "isize").read_text() == f"{len(index)}\n"


#: (not wc: the producer's loop measures the data once a look, and how many looks a run
#: takes depends on the machine's load)
PRODUCED = ("cat", "tar", "sed", "sha256sum", "rm")


@pytest.mark.parametrize("mode", ["tar", "manifest"])
@pytest.mark.parametrize("shell", ["dash", "bash"])  # busybox's sh runs its applets unshimmed
def test_a_one_file_run_of_the_producer_runs_only_what_it_needs(
    tmp_path: Path, shell: str, mode: str
) -> None:
    """The producer's programs are on the path of every pull, the smallest included: a
    one-file run reads its small files with the shell's ``read`` (no ``cat``), asks
    which tar there is never (the host's probe did: ``g`` in its tools argument), parses
    an empty ``tar.err`` never, and takes a one-chunk stream's hash from its chunk
    (before: 3 ``cat``, 2 hashes, a ``tar --version`` and a ``sed`` in either mode)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("one small file\n")
    root = tmp_path / "staging"
    root.mkdir(mode=0o700)
    prod = root / scripts.PRODUCER_NAME
    prod.write_text(scripts.PRODUCER)
    snap = root / "s-one"
    snap.mkdir()
    guest = guest_shell_path(shell, tmp_path / "guest")
    path, log = shim_tools(tmp_path, guest, dict.fromkeys(PRODUCED))
    # gzip: a busybox-only guest has no zstd; a session of its own, as the admission
    # gives it (a failing producer signals its whole group)
    argv = ["sh", str(prod), str(snap), str(ws), str(4 << 20), "sha256", "gzip:1", mode, "gcp"]
    env = {"PATH": path, "HOME": str(tmp_path)}
    subprocess.run(
        argv, env=env, stdin=subprocess.DEVNULL, timeout=60, check=True, start_new_session=True
    )
    assert not (snap / "failed").exists(), (snap / "failed").read_text()
    done = dict(line.split(" ", 1) for line in (snap / "done").read_text().splitlines())
    assert done["chunks"] == "1" and done["tar_rc"] == "0"
    data = (snap / "data").read_bytes()
    assert done["hash"] == ALGORITHMS["sha256"].digest(data)
    runs = {tool: tool_runs(log, tool) for tool in PRODUCED}
    archives = 1 if mode == "tar" else 0  # the archive alone
    assert runs == {
        "cat": 0,
        "tar": archives,
        "sed": 0,
        "sha256sum": 1,  # the one chunk
        "rm": 0,
    }, runs


def _finished(snap: Path, data: bytes) -> None:
    """``snap`` as the producer leaves a finished one-chunk stream of ``data``."""
    line = b"C 0 0 %d %s\n" % (len(data), ALGORITHMS["sha256"].digest(data).encode())
    (snap / "data").write_bytes(data)
    (snap / "index").write_bytes(line)
    (snap / "isize").write_text(f"{len(line)}\n")
    (snap / "comp.rc").write_text("0\n")
    (snap / "done").write_text(
        f"chunks 1\nlength {len(data)}\nhash {ALGORITHMS['sha256'].digest(data)}\n"
        "tar_rc 0\ncomp_rc 0\nunstable_bytes 0\ngone_bytes 0\n"
    )


def test_a_small_finished_stream_comes_with_the_status(
    producer: tuple[Path, int], guest_path: str
) -> None:
    """Asked with ``inline``, a status on a finished stream no longer than that carries
    it whole (any bytes: NULs, newlines, all 256); a longer one, one not finished, or
    ``inline`` 0 carry none (the host reads the chunks then)."""
    snap, _ = producer
    data = bytes(range(256)) * 40 + b"\0\n"
    _finished(snap, data)
    report = run_status(snap, guest_path, 0, looks=0, inline=len(data))
    assert report.done is not None and report.inline == data
    assert report.index_tail.startswith(b"C 0 0 ")
    assert run_status(snap, guest_path, 0, looks=0, inline=len(data) - 1).inline is None
    assert run_status(snap, guest_path, 0, looks=0).inline is None
    (snap / "done").unlink()
    assert run_status(snap, guest_path, 0, looks=0, inline=len(data)).inline is None


def test_a_stream_comes_whole_only_with_the_done_record_the_answer_carries(
    producer: tuple[Path, int], guest_path: str, tmp_path: Path
) -> None:
    """The status read the done record, then measured the index and the data, then looked
    for the record again to decide whether to carry the stream: a record written between
    the two looks (the producer's last step, under load) made an answer with the stream
    and no record.  An admission that asked for it removed the staging too, and the host,
    still waiting for the record, found the staging gone and started the pull afresh (a CI
    flake).  Here a ``wc`` shim writes the record at the status's first measure."""
    if "/bb" in guest_path:
        pytest.skip("busybox's sh runs its wc applet unshimmed")
    snap, _ = producer
    data = b"a small stream"
    _finished(snap, data)
    (tmp_path / "record").write_text((snap / "done").read_text())
    (snap / "done").unlink()
    shim = f"""#!/bin/sh
[ -f {tmp_path}/record ] && mv {tmp_path}/record {snap}/done
exec {shutil.which("wc", path=guest_path)} "$@"
"""
    path, _ = shim_tools(tmp_path / "t", guest_path, {"wc": shim})
    report = run_status(snap, path, 0, looks=0, inline=1024)
    assert (snap / "done").exists()  # written during that status
    assert report.done is None and report.inline is None
    report = run_status(snap, path, 0, looks=0, inline=1024)
    assert report.done is not None and report.inline == data


def test_a_status_never_makes_a_snapshot_gone_under_it(
    producer: tuple[Path, int], guest_path: str, tmp_path: Path
) -> None:
    """A status looked for the snapshot, then ``touch``ed it (the gc's clock): a snapshot
    removed between the two (a carrying admission, a cleanup) came back as an empty
    file, which no cleanup or gc removes and which failed any later admission of that
    id.  Here a ``touch`` shim renames the snapshot away first."""
    if "/bb" in guest_path:
        pytest.skip("busybox's sh runs its touch applet unshimmed")
    snap, _ = producer
    shim = f"""#!/bin/sh
for a; do [ -d "$a" ] && mv "$a" "$a.gone"; done
exec {shutil.which("touch", path=guest_path)} "$@"
"""
    path, _ = shim_tools(tmp_path / "t", guest_path, {"touch": shim})
    report = run_status(snap, path, 0, looks=0)
    assert not report.exists
    assert Path(f"{snap}.gone").is_dir() and not snap.exists()


def test_a_status_waits_for_the_done_record_once_the_stream_is_complete(
    producer: tuple[Path, int], guest_path: str, tmp_path: Path
) -> None:
    """The index grew and the compressor is done (``comp.rc``): only the producer's last
    steps are left, so a status that may carry a small stream looks again, 2 ms apart,
    for the done record, and answers with it (here a ``sleep`` shim writes the record
    when the status first waits: no race).  Without ``comp.rc``, or not asked for a
    stream, growth answers at once, no look taken; and the looks are bounded: a record
    that never comes leaves the answer without it."""
    if "/bb" in guest_path:
        pytest.skip("busybox's sh runs its sleep applet unshimmed")
    snap, _ = producer
    data = b"a small stream"
    _finished(snap, data)
    record = (snap / "done").read_text()
    (snap / "done").unlink()
    (snap / "comp.rc").unlink()
    (tmp_path / "record").write_text(record)
    shim = f"""#!/bin/sh
echo {{tool}} "$*" >> {{log}}
[ -f {snap}/comp.rc ] && [ -f {tmp_path}/write-it ] && cp {tmp_path}/record {snap}/done
exec {shutil.which("sleep", path=guest_path)} "$@"
"""
    path, log = shim_tools(tmp_path / "t", guest_path, {"sleep": shim})
    looks = scripts.status_looks(10.0)
    report = run_status(snap, path, 0, looks=looks, inline=1024)
    assert report.done is None and report.inline is None  # the compressor still runs
    assert tool_runs(log, "sleep") == 0
    (snap / "comp.rc").write_text("0\n")
    report = run_status(snap, path, 0, looks=looks, inline=0)
    assert report.done is None and tool_runs(log, "sleep") == 0  # no stream asked for
    report = run_status(snap, path, 0, looks=looks, inline=1024)
    assert report.done is None and tool_runs(log, "sleep", "0.002") == 5  # bounded
    (tmp_path / "write-it").write_text("")
    report = run_status(snap, path, 0, looks=looks, inline=1024)
    assert report.done is not None and report.inline == data
    assert tool_runs(log, "sleep", "0.002") == 6  # found at the next look


def test_a_probe_of_a_made_staging_root_runs_only_what_it_needs(tmp_path: Path) -> None:
    """Every pull begins with the probe: where the staging root is there it makes none
    (no ``mkdir``), lists the root once and each ancestor once (the root passed a
    stricter check than the ancestors' chain), and asks ``find`` once per option the
    producer uses.  Before: a ``mkdir`` and the root listed twice."""
    ws = make_tree(tmp_path / "ws", big=1024, small=1)
    guest = guest_shell_path("dash", tmp_path / "guest")
    path, log = shim_tools(tmp_path, guest, dict.fromkeys(("mkdir", "ls", "find", "tar")))
    opts = options(tmp_path)

    async def probe() -> str:
        session = GuestSession(LocalTransport(env={"PATH": path}), opts, CallStats())
        plan = await session.probe(str(ws))
        assert plan.probe.has("find_printf") and plan.probe.has("find_cnewer")
        return session.staging_root

    root = asyncio.run(probe())  # makes the root
    assert tool_runs(log, "mkdir") == 1
    log.unlink()
    assert asyncio.run(probe()) == root
    runs = {tool: tool_runs(log, tool) for tool in ("mkdir", "ls", "find", "tar")}
    assert runs == {"mkdir": 0, "ls": 1 + len(Path(root).parents), "find": 2, "tar": 1}, runs
