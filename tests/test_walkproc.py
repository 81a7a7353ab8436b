"""DEST's scan and the kept tree's walk in a worker process (:mod:`wsync.engine.walkproc`):
the same rows as in a thread, every kind of change exact through it, and a worker that
cannot start, dies, lies or is stopped costs time, never a result."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import assert_exact, make_tree, options, run_pull
from prevtree_helpers import prev_of
from test_incremental_pull import change_everything, prepare
from wsync.engine import prevtree, walkproc
from wsync.engine.destdir import fs_stamp
from wsync.engine.fsutil import remove_tree_at
from wsync.engine.hostscan import HostRow
from wsync.errors import HostIOError
from wsync.transports.local import LocalTransport

_DIR = os.O_RDONLY | os.O_DIRECTORY


def odd_tree(root: Path) -> Path:
    make_tree(root, big=64 * 1024, small=20)
    os.mkfifo(root / "fifo")
    (root / "dangling-too").symlink_to("nowhere/at/all")
    Path(os.fsdecode(bytes(root) + b"/caf\xe9-\xff")).mkdir()
    Path(os.fsdecode(bytes(root) + b"/caf\xe9-\xff/new\nline")).write_bytes(b"x")
    return root


def scan_of(root: Path, *, worker: bool) -> tuple[list[HostRow], str]:
    fd = os.open(root, _DIR)
    try:
        with walkproc.Scan(fd, worker=worker) as scan:
            rows = [row for batch in scan.batches(lambda: None) for row in batch]
        return rows, scan.digest
    finally:
        os.close(fd)


def test_a_scan_in_a_worker_is_the_scan_in_a_thread(tmp_path: Path) -> None:
    root = odd_tree(tmp_path / "ws")
    for i in range(walkproc.BATCH + 10):  # more than one message
        (root / "empty" / f"n{i}").write_bytes(b"")
    here, here_digest = scan_of(root, worker=False)
    there, there_digest = scan_of(root, worker=True)
    assert len(there) > walkproc.BATCH + 30
    assert there == here  # every field, in walk order, the root first
    assert there[0][0] == b"."
    assert there_digest == here_digest and len(here_digest) == 32
    assert {type(v) for row in there for v in row} == {bytes, str, int}


def test_a_walk_in_a_worker_is_the_walk_in_a_thread(tmp_path: Path) -> None:
    odd_tree(tmp_path / "kept")
    parent = os.open(tmp_path, _DIR)
    try:
        since = fs_stamp(parent, "dest")
        assert since is not None
        stop = lambda: None  # noqa: E731
        there = walkproc.walk_ahead(parent, ["missing", "kept"], stop, 100_000, since, "dest")
        here = prevtree.walk_ahead(parent, ["missing", "kept"], stop, 100_000, since, "dest")
        assert there is not None and here is not None
        assert isinstance(there, prevtree.Walked)
        assert (there.root, there.rows, there.listed, there.since) == (
            here.root,
            here.rows,
            here.listed,
            here.since,
        )
        assert len(there.rows) > 30 and there.until >= there.since
        # over the limit, or nothing to walk: no walk, as in a thread
        assert walkproc.walk_ahead(parent, ["kept"], stop, 5, since, "dest") is None
        assert walkproc.walk_ahead(parent, ["missing"], stop, 100, since, "dest") is None
    finally:
        os.close(parent)


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every tree walked in a worker, however small; the workers started, by argv."""
    started: list[list[str]] = []
    real = walkproc._Child.__init__

    def counted(self: Any, args: list[str], fds: tuple[int, ...]) -> None:
        started.append(args)
        real(self, args, fds)

    monkeypatch.setattr(walkproc, "MIN_ENTRIES", 0)
    monkeypatch.setattr(walkproc._Child, "__init__", counted)
    return started


@pytest.mark.parametrize("keep_prev", [False, True], ids=["default", "keep-prev"])
def test_every_kind_of_change_is_exact_with_the_walks_in_workers(
    tmp_path: Path, workers: list[list[str]], keep_prev: bool
) -> None:
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    opts = options(tmp_path, chunk_size=256 * 1024, keep_prev=keep_prev)
    assert run_pull(LocalTransport(), ws, dest, opts).mode == "full"
    assert workers == []  # nothing recorded yet: nothing to scan ahead
    for round_no in range(2):
        if round_no == 0:
            change_everything(ws)
        else:
            (ws / "src" / "f5.txt").write_text("again\n")
        result = run_pull(LocalTransport(), ws, dest, opts)
        assert result.ok, result.error
        assert result.mode == "incremental" and result.changed_files > 0
        assert_exact(ws, dest)
    kinds = [args[0] for args in workers]
    assert kinds.count("scan") >= 2
    if keep_prev:
        assert prev_of(dest).is_dir() and "walk" in kinds


def _pull_twice(tmp_path: Path) -> None:
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    opts = options(tmp_path, chunk_size=256 * 1024, keep_prev=True)
    for round_no in range(3):
        if round_no:
            (ws / "src" / f"f{round_no}.txt").write_text(f"round {round_no}\n")
        result = run_pull(LocalTransport(), ws, dest, opts)
        assert result.ok, result.error
        assert_exact(ws, dest)


@pytest.mark.parametrize("interpreter", ["/nonexistent/python3", "/bin/false"])
def test_a_worker_that_cannot_start_or_says_nothing_costs_only_time(
    tmp_path: Path, workers: list[list[str]], monkeypatch: pytest.MonkeyPatch, interpreter: str
) -> None:
    monkeypatch.setattr(sys, "executable", interpreter)
    _pull_twice(tmp_path)
    assert workers  # they were asked for, and each pull went on without them


def _liar(tmp_path: Path, payload: bytes) -> str:
    """An "interpreter" that answers every worker's argv with ``payload``."""
    script = tmp_path / "liar"
    blob = tmp_path / "liar.bin"
    blob.write_bytes(payload)
    script.write_text(f"#!/bin/sh\ncat {blob}\n")
    script.chmod(0o755)
    return str(script)


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/wsync-walkproc-pwned",))


def _framed(*msg: object) -> bytes:
    data = pickle.dumps(msg)
    return len(data).to_bytes(8, "little") + data


@pytest.mark.parametrize(
    "payload",
    [
        _framed("rows", [_Boom()]),
        _framed("rows", "not a list"),
        _framed("what", 1),
        (2**40).to_bytes(8, "little"),
        b"\x05\x00\x00\x00\x00\x00\x00\x00garb",
        _framed("rows", [(b".", "d", 0, 0, 0, 0, 0)]),  # then nothing: no end
    ],
    ids=["code", "kind", "message", "huge", "garbage", "cut"],
)
def test_a_worker_answer_that_is_not_a_scan_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload: bytes
) -> None:
    pwned = Path("/tmp/wsync-walkproc-pwned")
    pwned.unlink(missing_ok=True)
    monkeypatch.setattr(sys, "executable", _liar(tmp_path, payload))
    (tmp_path / "d").mkdir()
    with pytest.raises(walkproc.WorkerLost):
        scan_of(tmp_path / "d", worker=True)
    assert not pwned.exists()


def test_a_pull_whose_workers_lie_is_exact(
    tmp_path: Path, workers: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "executable", _liar(tmp_path, _framed("rows", [_Boom()])))
    _pull_twice(tmp_path)
    assert workers


def test_a_worker_error_is_the_scans_own(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"not a directory")
    for worker in (False, True):
        with pytest.raises(NotADirectoryError):
            scan_of(tmp_path / "file", worker=worker)


def test_a_stopped_scan_kills_its_worker(tmp_path: Path) -> None:
    root = odd_tree(tmp_path / "ws")
    fd = os.open(root, _DIR)

    class Stop(Exception):
        pass

    def stop() -> None:
        raise Stop

    try:
        with walkproc.Scan(fd, worker=True) as scan:
            with pytest.raises(Stop):
                next(scan.batches(stop))
            child = scan._child
            assert child is not None
        assert scan._child is None
        assert child.proc.returncode is not None  # killed (or ended) and reaped
    finally:
        os.close(fd)


def test_a_scan_worker_whose_reader_is_gone_ends(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    for i in range(3 * walkproc.BATCH):
        (root / f"f{i}").write_bytes(b"")
    fd = os.open(root, _DIR)
    read, write = os.pipe()
    os.close(read)  # nobody will ever read what it says
    try:
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "wsync.engine.walkproc", "scan", str(fd)],
            stdout=write,
            pass_fds=(fd,),
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)
        os.close(fd)
    assert proc.returncode == 1


def test_a_worker_given_a_wrong_argv_says_so(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "wsync.engine.walkproc", "delete", "everything"],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    size = int.from_bytes(proc.stdout[:8], "little")
    kind, text = walkproc._PlainData(io.BytesIO(proc.stdout[8 : 8 + size])).load()
    assert kind == "crash" and "usage" in text


def _set_aside_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A tree to remove, with a symlink out of it to a file that must stay."""
    outside = tmp_path / "outside.txt"
    outside.write_text("stays\n")
    tree = odd_tree(tmp_path / "old")
    (tree / "src" / "out").symlink_to(outside)
    (tree / "src" / "deep" / "er").chmod(0o500)
    return tree, outside


@pytest.mark.parametrize("worker", [True, False], ids=["worker", "thread"])
def test_a_removal_in_a_worker_removes_the_tree_and_nothing_else(
    tmp_path: Path, worker: bool
) -> None:
    tree, outside = _set_aside_tree(tmp_path)
    parent = os.open(tmp_path, _DIR)
    try:
        walkproc.remove(parent, "old", "shown") if worker else remove_tree_at(parent, "old")
    finally:
        os.close(parent)
    assert not os.path.lexists(tree)
    assert outside.read_text() == "stays\n"


def test_a_removal_that_fails_says_what_it_could_not_remove(tmp_path: Path) -> None:
    tree, _ = _set_aside_tree(tmp_path)
    stuck = tree / "src" / "f1.txt"
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    parent = os.open(tmp_path, _DIR)
    try:
        with pytest.raises(HostIOError, match=r"cannot remove shown/src/f1.txt"):
            walkproc.remove(parent, "old", "shown")
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], capture_output=True)
        os.close(parent)
    assert sorted(p.name for p in tree.rglob("*")) == ["f1.txt", "src"]  # all else went


def test_an_old_tree_is_removed_when_its_worker_gives_no_answer(
    tmp_path: Path, workers: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")
    ws, dest = tmp_path / "ws", tmp_path / "out"
    prepare(ws)
    opts = options(tmp_path, chunk_size=256 * 1024)
    for round_no in range(2):
        (ws / "src" / "f1.txt").write_text(f"round {round_no}\n")
        result = run_pull(LocalTransport(), ws, dest, opts)
        assert result.ok and not result.warnings, (result.error, result.warnings)
    assert "remove" in [args[0] for args in workers]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "staging", "state", "ws"]
    assert_exact(ws, dest)
