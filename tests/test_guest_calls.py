"""What a guest call runs besides its work (issue 13): the programs every call forks.

A small first pull makes eight guest calls, and each used to fork a ``wc`` for its
answer's length; the probe ran ``b2sum`` and ``sha256sum`` although ``xxhsum`` worked, a
second ``id`` and a ``head``; every admission forked a ``find`` for each leftover
snapshot in the staging root.  Now an answer of printable ASCII takes its length from
the shell's ``${#var}`` (every shell counts those in bytes), and only other answers go
through ``wc`` (yash counts characters whatever the script does; bash and busybox would
under a UTF-8 locale, which every script sets aside with ``LC_ALL=C``, also for the
status's index tail); the other hash tools run only where ``xxhsum`` does not give the
digest the host expects; one ``find`` says which leftovers are old.

Each test runs the real scripts under dash, bash and a busybox-only guest (and yash for
the answers' lengths), with the tools in question shimmed to log their runs.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from helpers import (
    GUEST_SHELLS,
    assert_exact,
    guest_shell_path,
    make_tree,
    options,
    run_pull,
    run_status,
    shim_tools,
    tool_runs,
)
from wsync.engine.guest import GuestPlan, GuestSession, plain_root
from wsync.engine.guestcall import CallStats
from wsync.errors import StagingFailed
from wsync.protocol import records, scripts
from wsync.protocol.envelope import parse_envelope
from wsync.protocol.hashing import ALGORITHMS, PROBE_ALGORITHM
from wsync.transports.local import LocalTransport

NONCE = "0123456789abcdef"
UTF8 = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


@pytest.fixture(params=GUEST_SHELLS)
def guest_path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return guest_shell_path(request.param, tmp_path / "tools")


@pytest.fixture(params=[*GUEST_SHELLS, "yash"])
def any_shell_path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """:func:`guest_path`, and yash as ``sh``: the answers' lengths under every shell."""
    return guest_shell_path(request.param, tmp_path / "tools")


def probe(tmp_path: Path, path: str, env: dict[str, str] | None = None) -> GuestPlan:
    ws = make_tree(tmp_path / "ws", big=1000, small=2)
    full = {"PATH": path, "HOME": str(tmp_path)} | (env or {})

    async def go() -> GuestPlan:
        session = GuestSession(LocalTransport(env=full), options(tmp_path), CallStats())
        return await session.probe(str(ws))

    return asyncio.run(go())


@pytest.mark.parametrize("name", ["stagé-ü", "stag\udcff-lone"], ids=["utf8", "lone-byte"])
def test_an_answer_with_other_bytes_is_measured_in_bytes(
    tmp_path: Path, any_shell_path: str, name: str
) -> None:
    """Under a UTF-8 locale, a probe whose answer holds a non-ASCII staging root (two
    bytes per ``é``, or a lone ``\\xff``) comes back whole: the envelope's length counts
    bytes.  A shell's ``${#var}`` would count characters there (bash and busybox without
    ``LC_ALL=C``, yash whatever the script sets), and the answer would be refused as
    damaged every time; such answers are measured by ``wc``."""
    guest_path = any_shell_path
    if "yash-sh" in guest_path and name.endswith("lone"):
        pytest.skip("yash drops bytes that are not UTF-8 from its arguments")
    root, ws = tmp_path / name, tmp_path / "ws"
    ws.mkdir()
    argv = scripts.probe(
        gate=False, nonce=NONCE, b64=False, workspace=str(ws), staging_root=str(root)
    )
    env = {"PATH": guest_path, "HOME": str(tmp_path)} | UTF8
    out = subprocess.run(argv, env=env, capture_output=True, timeout=60, check=True).stdout
    envelope = parse_envelope(out, NONCE, algorithm=PROBE_ALGORITHM, max_length=1 << 20)
    assert envelope.ok, envelope.text
    line = b"stage_root " + os.fsencode(os.path.realpath(root))
    assert line in envelope.payload.split(b"\n")


def test_a_non_ascii_index_tail_is_counted_in_bytes(tmp_path: Path, guest_path: str) -> None:
    """An index line with UTF-8 bytes (never the producer's: its index is ASCII; a
    same-user process wrote it) reaches the host as the bytes they are, where the index
    parser refuses them: before, a UTF-8 bash counted characters and the answer itself
    did not parse."""
    snap = tmp_path / "staging" / "s-utf8"
    snap.mkdir(parents=True)
    line = "C 0 0 262144 é\n".encode()
    (snap / "index").write_bytes(line)
    (snap / "data").write_bytes(b"")
    report = run_status(snap, guest_path, 0, looks=0, env=UTF8)
    assert report.index_size == len(line) and report.index_tail == line


def test_answers_fork_no_wc_for_their_length(tmp_path: Path, guest_path: str) -> None:
    """A cleanup (nothing to measure but its answer) runs no ``wc`` at all."""
    path, log = shim_tools(tmp_path, guest_path, {"wc": None})
    argv = scripts.cleanup(
        gate=False,
        nonce=NONCE,
        algorithm="sha256",
        b64=False,
        staging_root=str(tmp_path / "staging"),
        snapshots=["s-none"],
    )
    out = subprocess.run(argv, env={"PATH": path}, capture_output=True, timeout=60).stdout
    envelope = parse_envelope(out, NONCE, algorithm=ALGORITHMS["sha256"], max_length=4096)
    assert envelope.ok and envelope.text == "removed"
    assert tool_runs(log, "wc") == 0


def test_the_probe_tries_the_other_hash_tools_only_without_a_working_xxhsum(
    tmp_path: Path,
) -> None:
    """With a working ``xxhsum`` the probe runs neither ``b2sum`` nor ``sha256sum``;
    with one that answers a wrong digest (or none), both are tried and the pull hashes
    with BLAKE2."""
    counted = {"xxhsum": None, "b2sum": None, "sha256sum": None}
    path, log = shim_tools(tmp_path / "good", os.environ["PATH"], counted)
    assert probe(tmp_path / "good", path).algorithm.name == "xxh128"
    assert (
        tool_runs(log, "xxhsum") == 1
        and tool_runs(log, "b2sum") == tool_runs(log, "sha256sum") == 0
    )

    liar = "#!/bin/sh\necho {tool} >> {log}\ncat >/dev/null\necho 0123456789abcdef0123 -\n"
    counted["xxhsum"] = liar
    path, log = shim_tools(tmp_path / "bad", os.environ["PATH"], counted)
    assert probe(tmp_path / "bad", path).algorithm.name == "b2"
    assert tool_runs(log, "b2sum") == tool_runs(log, "sha256sum") == 1


@pytest.mark.parametrize("kind", ["dash", "busybox"])
def test_one_find_sorts_out_every_leftover_snapshot(tmp_path: Path, kind: str) -> None:
    """Twelve leftovers, odd names among them: one ``find`` in the admission says which
    are old.  The old ones of wsync's (a ``launch/`` token) go, whatever their names;
    fresh ones, old ones without the token and the admitted snapshot stay."""
    path, log = shim_tools(tmp_path, guest_shell_path(kind, tmp_path / "tools"), {"find": None})
    opts = options(tmp_path, staging_ttl=120)
    root = Path(opts.staging_root)
    root.mkdir(mode=0o700)
    old = time.time() - 3600

    def leftover(name: str, *, ours: bool = True, age: float = old) -> Path:
        d = root / name
        (d / "launch").mkdir(parents=True) if ours else d.mkdir()
        os.utime(d, (age, age))
        return d

    stale = [leftover(n) for n in ("s10", "s 2", "s[3]", "s*", "s-x-4", "s'5", "s$6", "s7 x")]
    # each fresh name is the start of a stale one's: a match on less than a whole line
    # of find's answer would take it
    fresh = [leftover(n, age=time.time()) for n in ("s1", "s7", "s?", "s 8")]
    kept = [leftover("s9-no-token", ours=False), leftover("sadmit", age=old)]
    ws = make_tree(tmp_path / "ws", big=1000, small=2)

    async def go() -> None:
        env = {"PATH": path, "HOME": str(tmp_path)}
        session = GuestSession(LocalTransport(env=env), opts, CallStats())
        plan = await session.probe(str(ws))
        await session.admit("sadmit", str(ws), plan.compressor, level=1)

    asyncio.run(go())
    assert [d.name for d in stale if d.exists()] == []
    assert all(d.exists() for d in fresh + kept)
    assert tool_runs(log, "find", "-mmin") == 1


def test_an_admission_that_cannot_write_says_what_and_where(tmp_path: Path) -> None:
    """The admission's script names a failed write in a word (its size is bounded: it
    travels in a URL on some backends); the host says it in full, with the root."""
    from wsync.errors import StagingFailed

    opts = options(tmp_path)
    ws = make_tree(tmp_path / "ws", big=1000, small=2)

    async def go() -> None:
        session = GuestSession(LocalTransport(), opts, CallStats())
        plan = await session.probe(str(ws))
        (Path(session.staging_root) / "s-blocked").write_text("a file where the directory goes")
        await session.admit("s-blocked", str(ws), plan.compressor, level=1, need_kb=1)

    with pytest.raises(StagingFailed) as caught:
        asyncio.run(go())
    assert "cannot create the snapshot's staging directory in the guest's staging root" in str(
        caught.value
    )
    assert str(Path(opts.staging_root).resolve()) in str(caught.value)


@pytest.mark.parametrize("free", [False, True])
def test_the_probe_measures_free_space_only_when_asked(tmp_path: Path, free: bool) -> None:
    """A pull's probe runs no ``df`` (the admission measures the room it checks);
    ``wsync doctor``'s asks for it and shows the figure."""
    ws = tmp_path / "ws"
    ws.mkdir()
    path, log = shim_tools(tmp_path, os.environ["PATH"], {"df": None})
    argv = scripts.probe(
        gate=False,
        nonce=NONCE,
        b64=False,
        workspace=str(ws),
        staging_root=str(tmp_path / "staging"),
        free=free,
    )
    env = {"PATH": path, "HOME": str(tmp_path)}
    out = subprocess.run(argv, env=env, capture_output=True, timeout=60, check=True).stdout
    envelope = parse_envelope(out, NONCE, algorithm=PROBE_ALGORITHM, max_length=1 << 20)
    assert envelope.ok, envelope.text
    report = records.parse_probe(envelope.payload)
    assert report.stage_root == os.path.realpath(tmp_path / "staging")
    assert tool_runs(log, "df") == int(free)
    assert (report.stage_free_kb is not None) == free


@pytest.mark.parametrize("helpers", [True, False], ids=["helper", "exec-per-call"])
def test_a_first_and_an_incremental_pull_are_exact_under_every_shell(
    tmp_path: Path, any_shell_path: str, helpers: bool
) -> None:
    """Every script of a pull, the admission that carries a status and the status that
    carries a small stream included, under dash, bash, busybox and yash as ``sh``: a first
    pull, then one after a file changed and one was added, both exact."""
    ws = make_tree(tmp_path / "ws", big=200_000, small=8)
    env = {"PATH": any_shell_path, "HOME": str(tmp_path)}
    dest = tmp_path / "out"
    opts = options(tmp_path, helpers=helpers)
    first = run_pull(LocalTransport(env=env), ws, dest, opts)
    assert first.ok, first.error
    assert_exact(ws, dest)
    (ws / "src" / "f0.txt").write_text("changed\n")
    (ws / "added.txt").write_text("new\n")
    again = run_pull(LocalTransport(env=env), ws, dest, opts)
    # (this busybox guest has no stat or readlink to list with: a full pull again)
    assert again.ok and again.mode == ("full" if "/bb" in any_shell_path else "incremental")
    assert_exact(ws, dest)


def test_a_cleanup_tries_every_snapshot_it_names(tmp_path: Path, guest_path: str) -> None:
    """A pull's last cleanup names its listing's snapshot and its archive's: one that
    ``rm`` cannot remove does not keep the other (a full disk's archive) there, and the
    answer says the removal failed."""
    root = tmp_path / "staging"
    for name in ("s-manifest", "s-content"):
        (root / name / "launch").mkdir(parents=True)
    refuse = '#!/bin/sh\ncase "$*" in *s-manifest*) exit 1 ;; esac\nexec {real} "$@"\n'
    real = shutil.which("rm", path=guest_path)
    assert real
    path, _ = shim_tools(tmp_path, guest_path, {"rm": refuse.replace("{real}", real)})
    argv = scripts.cleanup(
        gate=False,
        nonce=NONCE,
        algorithm="sha256",
        b64=False,
        staging_root=str(root),
        snapshots=["s-manifest", "s-content"],
    )
    out = subprocess.run(argv, env={"PATH": path}, capture_output=True, timeout=60).stdout
    envelope = parse_envelope(out, NONCE, algorithm=ALGORITHMS["sha256"], max_length=4096)
    assert not envelope.ok and "cannot remove" in envelope.text
    assert sorted(p.name for p in root.iterdir()) == ["s-manifest"]


@pytest.mark.parametrize(
    ("root", "ok"),
    [
        ("/tmp/wsync-0", True),
        ("/", True),
        ("/workspace/../../v1/sandbox/victim/file/x", False),
        ("/tmp/./wsync-0", False),
        ("/tmp//wsync-0", False),
        ("//tmp/wsync-0", False),
        ("/tmp/wsync-0/", False),
        ("tmp/wsync-0", False),
        ("", False),
    ],
)
def test_only_a_plain_absolute_staging_root_is_taken(root: str, ok: bool) -> None:
    """The probe's staging root comes from the guest, and chunk paths built from it go
    into an HTTP backend's URL: ``..`` there aimed the token at other routes (review)."""
    if ok:
        assert plain_root(root) == root
    else:
        with pytest.raises(StagingFailed):
            plain_root(root)
