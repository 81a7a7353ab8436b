"""Numbers past SQLite's 64 signed bits in the incremental state.

A file's time in ns passes 2**63 in the year 2262: ext4 keeps times up to 2446, so
``touch -d 3000-01-01`` lands there, and every pull of such a workspace stopped with
"internal error: OverflowError: Python int too large to convert to SQLite INTEGER" (the
manifest's load), or a ``struct.error`` in DEST's scan.  Some filesystems' inode numbers
pass 2**63 too, and a guest's manifest may claim sizes up to 20 digits.  Such values are
stored as BLOBs (:func:`wsync.engine.incsql.sql_int`): never equal to an integer, always
equal to themselves, read back exactly.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest

from helpers import assert_exact, local, options, run_pull
from test_incremental_noop import Loads
from wsync.engine import incload, incsql

#: 2500-06-01, in ns: past 2**63 (2262-04-11); ext4 keeps it as 2446-05-10, still past it
FAR = 16_725_225_600 * 10**9


@pytest.mark.parametrize(
    "value",
    [0, 1, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64 - 1, 2**64, 10**29, -(10**29)],
)
def test_sql_int_round_trips_and_keeps_64_bit_values_as_integers(value: int) -> None:
    stored = incsql.sql_int(value)
    assert incsql.py_int(stored) == value
    assert isinstance(stored, int) == (-(2**63) <= value < 2**63)


def test_wide_values_compare_in_sql_as_the_diff_needs() -> None:
    """Equal to themselves, different from every other value and from every integer."""
    db = sqlite3.connect(":memory:")
    values = [5, 2**63, 2**63 + 1, 2**64 - 1, -(2**63) - 1, 10**29]
    for a in values:
        for b in values:
            same = db.execute("SELECT ? IS ?", (incsql.sql_int(a), incsql.sql_int(b))).fetchone()[0]
            assert bool(same) == (a == b), (a, b)
    # the two's complement bytes of 2**64 - 1 are not the integer -1
    assert not db.execute("SELECT ? IS -1", (incsql.sql_int(2**64 - 1),)).fetchone()[0]


def test_insert_rows_is_only_for_statements_a_retry_cannot_double() -> None:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (k INT PRIMARY KEY, v INT)")
    with pytest.raises(ValueError):
        incsql.insert_rows(db, "INSERT INTO t VALUES (?, ?)", [(1, 2**63)])


def test_insert_rows_stores_a_batch_with_one_wide_value_whole() -> None:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (k INT PRIMARY KEY, v INT)")
    rows = [(1, 10), (2, 2**63 + 5), (3, 30)]
    incsql.insert_rows(db, "INSERT OR REPLACE INTO t VALUES (?, ?)", rows)
    got = {k: incsql.py_int(v) for k, v in db.execute("SELECT k, v FROM t")}
    assert got == dict(rows)


def _far_future(path: Path) -> None:
    os.utime(path, ns=(FAR, FAR), follow_symlinks=False)
    if os.lstat(path).st_mtime_ns < 2**63:
        pytest.skip("this filesystem does not keep times past 2262")


def test_a_workspace_with_times_past_2262_is_pulled_again_and_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file and a directory dated 2500: the first pull, a no-op pull, an edit, a new
    entry in the far-future directory, the same with ``--keep-prev``: each exact."""
    ws = tmp_path / "ws"
    (ws / "later").mkdir(parents=True)
    (ws / "later" / "f.txt").write_text("one\n")
    (ws / "now.txt").write_text("now\n")
    _far_future(ws / "later" / "f.txt")
    _far_future(ws / "later")
    dest = tmp_path / "out"

    first = run_pull(local(), ws, dest, options(tmp_path))
    assert first.mode == "full"
    assert_exact(ws, dest)
    assert os.lstat(dest / "later").st_mtime_ns == os.lstat(ws / "later").st_mtime_ns

    again = run_pull(local(), ws, dest, options(tmp_path))
    assert (again.mode, again.changed_files) == ("incremental", 0)
    # the no-op shortcut: this scan's digest (a row past 64 bits in it) is the recorded
    # one, so the manifest is not even parsed
    loads = Loads(monkeypatch)
    third = run_pull(local(), ws, dest, options(tmp_path))
    assert (third.mode, third.changed_files) == ("incremental", 0)
    assert loads.count == 0

    (ws / "later" / "f.txt").write_text("two\n")
    _far_future(ws / "later" / "f.txt")
    (ws / "later" / "g.txt").write_text("new\n")
    _far_future(ws / "later")
    edited = run_pull(local(), ws, dest, options(tmp_path, keep_prev=True))
    assert edited.mode == "incremental" and edited.changed_files >= 2
    assert_exact(ws, dest)

    (ws / "now.txt").write_text("later still\n")
    kept = run_pull(local(), ws, dest, options(tmp_path, keep_prev=True))
    assert kept.mode == "incremental"
    assert_exact(ws, dest)
    assert os.lstat(dest / "later").st_mtime_ns == os.lstat(ws / "later").st_mtime_ns


def test_the_tree_bytes_of_a_dest_past_2_63_bytes_are_counted(tmp_path: Path) -> None:
    """Two sparse files of 2**62 bytes (tmpfs takes them, holes only): the recorded tree
    holds 2**63 bytes, which SQLite's ``sum()`` cannot add up ("integer overflow": the
    pull then said its state was not recorded); ``total()`` can."""
    from incr_helpers import Entry
    from wsync.engine.excludes import Excludes
    from wsync.engine.incstate import PullState

    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no tmpfs at /dev/shm")
    dest = Path(tempfile.mkdtemp(dir=shm))
    try:
        try:
            for name in ("a", "b"):
                with (dest / name).open("wb") as f:
                    f.truncate(2**62)
        except OSError as exc:
            pytest.skip(f"this tmpfs takes no 4 EiB file: {exc}")
        st = os.lstat(dest)
        listing = [Entry(b".", "d", 0o755, 0, st.st_mtime_ns, st.st_ctime_ns, 0, b"")]
        for name in ("a", "b"):
            s = os.lstat(dest / name)
            listing.append(
                Entry(name.encode(), "f", 0o644, s.st_size, s.st_mtime_ns, s.st_ctime_ns, 0, b"")
            )
        with PullState.open(tmp_path / "state", dest, "local:guest") as state:
            state.load_manifest(iter(listing), Excludes.none())
            fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
            try:
                state.commit(fd, {})
            finally:
                os.close(fd)
            assert state.tree_bytes() == 2**63
    finally:
        shutil.rmtree(dest)


@pytest.mark.parametrize(
    "sizes",
    [[5, 7, 0], [5, 2**63 + 5, 30], [2**62, 2**62, 1], [2**63 - 1, 2**64 + 3, 2**62, 2**62]],
)
def test_the_listed_bytes_are_summed_exactly_past_64_bits(sizes: list[int]) -> None:
    """A whole-tree run's staging need sums the listed file sizes: in SQL while they fit
    in 64 bits, in Python where one is stored as a BLOB or their sum passes 2**63 (SQL's
    sum() raises "integer overflow" there)."""
    db = sqlite3.connect(":memory:")
    incsql.scratch(db)
    rows = [
        (f"f{i}".encode(), b".", "f", 0o644, size, 0, 0, i, b"", "", None)
        for i, size in enumerate(sizes)
    ]
    rows.append((b"d", b".", "d", 0o755, 2**62, 0, 0, 99, b"", "", None))  # (not a file)
    incsql.insert_rows(db, "INSERT OR REPLACE INTO s.man VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
    assert incload._listed_bytes(db) == sum(sizes)
