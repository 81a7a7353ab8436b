"""DEST's scan in a child process (wsync.engine.scanproc): the same digest and rows as the
in-process scan, the same diff, nothing written for a no-op, stopped at once, and the
in-process scan wherever no child can run.  Real trees, real child processes; a shell
script stands in for the interpreter only to fake a child that hangs, fails or lies."""

from __future__ import annotations

import os
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from incr_helpers import manifest, pull
from test_incstate import guest_tree
from wsync.engine import incsql, scanproc
from wsync.engine.excludes import Excludes
from wsync.engine.incstate import PullState, state_path
from wsync.errors import HostIOError, Interrupted

#: a time past 64 signed bits of nanoseconds (ext4 and tmpfs keep it): stored as a BLOB
FAR = 13_569_465_600 * 10**9  # 2400-01-01


def _dir_fd(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = guest_tree(tmp_path / "dest")
    os.mkfifo(root / "fifo")
    (root / "deep" / "er").mkdir(parents=True)
    for i in range(40):
        (root / "deep" / "er" / f"f{i}").write_bytes(b"x" * i)
    os.utime(root / "docs" / "readme.md", ns=(FAR, FAR))
    return root


def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scanproc.ScanProcess, "start", classmethod(lambda *a: None))


def _scan_rows(state_dir: Path, dest: Path) -> tuple[str, list[tuple[object, ...]]]:
    """scan() then the rows the diff would use (what diff() copies in, or inserts)."""
    with PullState.open(state_dir, dest, "k") as st:
        fd = _dir_fd(dest)
        try:
            digest = st.scan(fd)
            child = st._child
            if child is not None:
                st.db.commit()
                child.copy_into(st.db, "s.host")
                st._child = None
            else:
                incsql.insert_rows(st.db, incsql.INSERT_HOST, st._held)
            rows = st.db.execute("SELECT * FROM s.host ORDER BY path").fetchall()
        finally:
            os.close(fd)
    return digest, rows


@pytest.mark.parametrize("hold", [100_000, 3])
def test_child_gives_the_digest_and_rows_of_the_in_process_scan(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hold: int
) -> None:
    monkeypatch.setattr(scanproc, "HOLD", hold)  # 3: most rows written while walking
    child = _scan_rows(tmp_path / "s1", tree)
    _in_process(monkeypatch)
    own = _scan_rows(tmp_path / "s2", tree)
    assert child == own
    assert len(own[1]) > 50
    far = [r for r in own[1] if r[0] == b"docs/readme.md"]
    assert far and isinstance(far[0][4], bytes)  # the mtime past 2**63 crossed as a BLOB


def test_a_diff_after_a_child_scan_is_the_diff_of_an_in_process_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guest = guest_tree(tmp_path / "guest")
    state, dest = tmp_path / "state", tmp_path / "dest"
    pull(state, guest, dest)
    # the host tampers with DEST, the guest changes
    os.chmod(dest / "tool.sh", 0o700)
    (dest / "docs" / "readme.md").unlink()
    (dest / "stray").write_text("not the guest's\n")
    (guest / "a.txt").write_text("changed\n")

    def diff_lines(scan_first: bool) -> list[str]:
        with PullState.open(state, dest, "local:guest") as st:
            st.load_manifest(manifest(guest), Excludes.none())
            fd = _dir_fd(dest)
            try:
                if scan_first:
                    st.scan(fd)
                    assert st._child is not None  # the child holds the rows
                return sorted(st.diff(fd).itemize())
            finally:
                os.close(fd)

    child = diff_lines(True)
    assert child == diff_lines(False)
    assert any("stray" in line for line in child) and any("a.txt" in line for line in child)
    assert not list(state_path(state, dest).parent.glob("*.scan"))


def test_a_no_op_writes_no_rows_and_leaves_no_file(tree: Path, tmp_path: Path) -> None:
    st = PullState.open(tmp_path / "state", tree, "k")
    fd = _dir_fd(tree)
    try:
        st.scan(fd)
        child = st._child
        assert child is not None and child.path.exists()
        with sqlite3.connect(child.path) as peek:  # the table is there, empty: rows stay held
            assert peek.execute("SELECT count(*) FROM host").fetchone() == (0,)
    finally:
        os.close(fd)
        st.close()
    assert child.proc.returncode == 0
    assert not child.path.exists()


def test_the_child_is_in_its_own_session(tree: Path, tmp_path: Path) -> None:
    """The terminal's Ctrl-C reaches the pull, which stops the child itself."""
    fd = _dir_fd(tree)
    child = scanproc.ScanProcess.start(fd, tmp_path, "x.")
    os.close(fd)
    assert child is not None
    try:
        assert os.getsid(child.proc.pid) == child.proc.pid != os.getsid(0)
        assert child.digest()
    finally:
        child.close()


def _fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))


def test_stop_kills_a_child_that_is_still_walking(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_python(tmp_path, monkeypatch, "exec sleep 600")
    stop = threading.Event()

    def check() -> None:
        if stop.is_set():
            raise Interrupted("pull stopped")

    st = PullState.open(tmp_path / "state", tree, "k")
    fd = _dir_fd(tree)
    outcome: list[BaseException | str] = []

    def scan() -> None:
        try:
            outcome.append(st.scan(fd, check))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=scan)
    worker.start()
    deadline = time.monotonic() + 60
    while st._child is None and time.monotonic() < deadline:
        time.sleep(0.01)
    child = st._child
    assert child is not None
    stop.set()
    st.stop_scan()
    worker.join(60)
    os.close(fd)
    st.close()
    assert not worker.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], Interrupted)
    assert child.proc.returncode is not None and not child.path.exists()


@pytest.mark.parametrize(
    "body",
    ["exit 1", "exec /nonexistent/python", "echo 'scanned'; exit 0", "echo garbage"],
    ids=["exits", "cannot-exec", "empty-digest", "garbage"],
)
def test_no_child_answer_means_the_scan_runs_in_process(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str
) -> None:
    own = _scan_rows(tmp_path / "s1", tree)
    _fake_python(tmp_path, monkeypatch, body)
    assert _scan_rows(tmp_path / "s2", tree) == own


def test_no_interpreter_at_all_means_the_scan_runs_in_process(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = _scan_rows(tmp_path / "s1", tree)
    for missing in ("", str(tmp_path / "no-such-python")):
        monkeypatch.setattr(sys, "executable", missing)
        assert _scan_rows(tmp_path / "s2", tree) == own


def test_the_walks_own_error_fails_the_scan(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_python(tmp_path, monkeypatch, "echo 'error Permission denied'; exit 1")
    with PullState.open(tmp_path / "state", tree, "k") as st:
        fd = _dir_fd(tree)
        try:
            with pytest.raises(HostIOError, match=r"reading DEST: Permission denied$"):
                st.scan(fd)
        finally:
            os.close(fd)
    assert not list((tmp_path / "state" / "incremental").glob("*.scan"))


def test_a_child_that_dies_before_writing_fails_the_diff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guest = guest_tree(tmp_path / "guest")
    state, dest = tmp_path / "state", tmp_path / "dest"
    pull(state, guest, dest)
    _fake_python(tmp_path, monkeypatch, "echo 'scanned 0123'; read cmd; exit 3")
    with PullState.open(state, dest, "local:guest") as st:
        st.load_manifest(manifest(guest), Excludes.none())
        fd = _dir_fd(dest)
        try:
            assert st.scan(fd) == "0123"
            with pytest.raises(HostIOError, match="the scan ended early"):
                st.diff(fd)
        finally:
            os.close(fd)


def _stale(state_dir: Path, dest: Path) -> Iterator[Path]:
    path = state_path(state_dir, dest)
    path.parent.mkdir(parents=True, exist_ok=True)
    for name in (f"{path.stem}.abc{scanproc.SUFFIX}", f"{path.stem}.def{scanproc.SUFFIX}"):
        (path.parent / name).write_bytes(b"left by a killed pull")
        yield path.parent / name


def test_files_a_killed_pull_left_are_removed_when_the_state_opens(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    stale = list(_stale(tmp_path / "state", dest))
    other = stale[0].parent / f"{'0' * 64}.abc{scanproc.SUFFIX}"  # another DEST's
    other.write_bytes(b"")
    PullState.open(tmp_path / "state", dest, "k").close()
    assert not any(p.exists() for p in stale) and other.exists()
