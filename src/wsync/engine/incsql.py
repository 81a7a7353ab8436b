"""The SQL of the incremental state (:mod:`wsync.engine.incstate`): the state file's
schema, the per-run scratch tables, and the statements of the diff and the commit.

The state file holds one row per entry of the tree the last pull left in DEST; the scratch
tables (a private temporary database, ``ATTACH ''``) hold this run's manifest, DEST's scan,
the plan and the extractor's hashes, behind a bounded page cache.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path

from wsync.engine.fsutil import host_io

#: SQLite page cache per database, KiB (negative pragma value): bounds memory whatever the size
CACHE_KIB = 16 * 1024
#: bytes per page of the scratch tables.  Every pull makes a few passes over all their rows
#: (the listing's and DEST's inserts, the plan's join, the commit's read): with 16 KiB pages
#: instead of 4 KiB each costs 10-28% less CPU (59k rows of the stdlib tree).  The state
#: file keeps SQLite's default: with 16 KiB pages the first commit of a 1M-entry state
#: peaked at 113 MiB of RSS instead of 66 MiB, for little more gain
PAGE_SIZE = 16384

STATE_COLUMNS = """
    path BLOB PRIMARY KEY, kind TEXT NOT NULL, mode INT, size INT, mtime INT, ctime INT,
    ino INT, target BLOB, digest TEXT, hash TEXT,
    hkind TEXT, hmode INT, hsize INT, hmtime INT, hctime INT, hino INT
"""

#: the manifest record (and parent) of each entry of ``state`` (see ``PullState.known``), in
#: a table of its own: the state's own table keeps the columns every wsync writes, so an
#: older wsync (a rolled-back install) still reads and commits the same file; its commit
#: leaves this table stale, which the ``records`` meta key tells (it names the listing of
#: the commit that wrote both)
RECORDS_TABLE = """
CREATE TABLE IF NOT EXISTS records (
  path BLOB PRIMARY KEY, parent BLOB NOT NULL, record BLOB NOT NULL) WITHOUT ROWID
"""

INSERT_HOST = "INSERT OR REPLACE INTO s.host VALUES (?,?,?,?,?,?,?)"
#: a row of what the pull made, read off the new tree before the swap (``kind`` NULL: not
#: there; see ``PullState.note_tree``)
INSERT_MADE = "INSERT OR REPLACE INTO s.made VALUES (?,?,?,?,?,?,?)"
#: the plan's acts of an entry the content run fetches (an SQL list)
FETCHED = "('new', 'changed', 'missing', 'tampered', 'linked')"

#: SQLite's integers are signed 64-bit; a file's times in ns pass 2**63 in the year 2262
#: (ext4 keeps times up to 2446, a ``touch -d 3000-01-01`` lands there), some filesystems'
#: inode numbers pass it too, and a guest's manifest may claim anything it parses
_INT64 = range(-(2**63), 2**63)


def sql_int(value: int) -> int | bytes:
    """``value`` as SQLite can hold it: itself, or past 64 bits a BLOB of its two's
    complement bytes, always the same for one value (never equal to an integer, always
    equal to itself: the diff's comparisons hold; :func:`py_int` reads it back)."""
    if value in _INT64:
        return value
    return value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)


def py_int(value: int | bytes) -> int:
    """An integer column's value as :func:`sql_int` stored it."""
    if isinstance(value, bytes):
        return int.from_bytes(value, "little", signed=True)
    return int(value)


def insert_rows(db: sqlite3.Connection, sql: str, rows: Sequence[tuple[object, ...]]) -> None:
    """``executemany`` of an ``INSERT OR REPLACE``, storing integers past 64 bits as
    :func:`sql_int` says.  Such rows are rare, so a batch pays for them only when it has
    one: the rows before it were stored and are simply replaced."""
    if "OR REPLACE" not in sql:
        raise ValueError("insert_rows retries a batch: only for INSERT OR REPLACE")
    try:
        db.executemany(sql, rows)
    except OverflowError:
        wide = [tuple(sql_int(v) if type(v) is int else v for v in row) for row in rows]
        db.executemany(sql, wide)


#: the plan of the diff; ``:lo`` and ``:hi`` (exclusive) bound the last commit's ctime
#: window (see ``PullState.window``): a ctime that moved into it moved by that pull's own
#: links and unlinks (or by an edit while it ran, which a rescan would not have told apart).
#: Only an entry recorded from a scan taken before the window opened (``o.hctime < :lo``:
#: what that pull kept) can have been moved by them: one it made was recorded as read off
#: its new tree just before the swap, and nothing of the pull moves its ctime after that,
#: so a ctime of it that moved since is an edit (say between the swap and the end of the
#: old tree's removal, with the size and mtime put back), re-hashed like any other
PLAN = """
INSERT INTO s.plan (path, kind, ino, act, hash)
SELECT m.path, m.kind, m.ino,
  CASE
    WHEN m.kind = 'd' THEN CASE
      WHEN h.path IS NULL OR h.kind IS NOT 'd' THEN 'new'
      WHEN o.path IS NULL THEN 'new'
      WHEN o.kind IS NOT 'd' OR o.mode IS NOT m.mode OR o.mtime IS NOT m.mtime THEN 'changed'
      WHEN h.mode IS NOT o.hmode OR h.mtime IS NOT o.hmtime THEN 'tampered'
      ELSE 'keep' END
    WHEN o.path IS NULL THEN 'new'
    WHEN o.kind IS NOT m.kind OR o.mode IS NOT m.mode OR o.size IS NOT m.size
      OR o.mtime IS NOT m.mtime OR o.ctime IS NOT m.ctime OR o.ino IS NOT m.ino
      OR o.target IS NOT m.target OR o.digest IS NOT m.digest THEN 'changed'
    WHEN h.path IS NULL THEN 'missing'
    WHEN h.kind IS NOT o.hkind OR h.kind IS NOT m.kind OR h.mode IS NOT o.hmode
      OR h.size IS NOT o.hsize OR h.mtime IS NOT o.hmtime THEN 'tampered'
    WHEN h.ino IS NOT o.hino AND m.kind = 'f' AND m.ino != 0 AND EXISTS (SELECT 1 FROM s.man g
      WHERE g.ino = m.ino AND g.kind = 'f' AND g.path != m.path) THEN 'tampered'
    WHEN h.ino IS NOT o.hino THEN 'check'
    WHEN h.ctime IS NOT o.hctime AND (h.ctime IS NULL OR h.ctime < :lo OR h.ctime >= :hi
      OR NOT coalesce(o.hctime < :lo, 0))
      THEN 'check'
    ELSE 'keep'
  END,
  CASE WHEN m.kind = 'f' THEN o.hash END
FROM s.man m
LEFT JOIN base o ON o.path = m.path
LEFT JOIN s.host h ON h.path = m.path
"""

#: the manifest's records the parser found among the state's (see ``PullState.known``): each
#: is the recorded row, byte for byte the same record; ``s.unlisted`` holds the recorded
#: records it did not meet.  OR IGNORE: a path the guest also listed otherwise is a
#: duplicate, which the load refuses (its count of rows falls short)
COPY_KNOWN = """
INSERT OR IGNORE INTO s.man
  (path, parent, kind, mode, size, mtime, ctime, ino, target, digest, record)
SELECT o.path, r.parent, o.kind, o.mode, o.size, o.mtime, o.ctime, o.ino, o.target, o.digest,
  r.record
FROM main.records r JOIN main.state o USING (path)
WHERE r.record NOT IN (SELECT record FROM s.unlisted)
"""

#: the records of the entries a commit recorded (after COMMIT, in its transaction)
COMMIT_RECORDS = """
INSERT INTO main.records
SELECT m.path, m.parent, m.record FROM s.man m JOIN main.state o USING (path)
WHERE m.record IS NOT NULL
"""

#: the diff's scan of the entries the farm links as they are (kept, not directories: the
#: farm makes those afresh), before the commit scans DEST again (see KEPT_MOVED)
KEPT = """
INSERT INTO s.kept
SELECT h.path, h.kind, h.mode, h.size, h.mtime, h.ino FROM s.host h JOIN s.plan p USING (path)
WHERE p.act = 'keep' AND p.kind != 'd'
"""

#: a kept entry that DEST no longer holds as the diff saw it, at the commit's scan: changed
#: on the host during the pull (the farm links the inode, so kind, mode, size, mtime and
#: inode stay; only the ctime moves with the farm's link and the old tree's unlink).  Its
#: recorded hash no longer describes it: it is left out of the state, fetched next time.
KEPT_MOVED = """
DELETE FROM s.host WHERE path IN (
  SELECT n.path FROM s.host n JOIN s.kept d USING (path)
  WHERE n.kind IS NOT d.kind OR n.mode IS NOT d.mode OR n.size IS NOT d.size
    OR n.mtime IS NOT d.mtime OR n.ino IS NOT d.ino)
"""

#: a recorded entry DEST holds as recorded but for its ctime (see PullState.refresh_ctimes)
REFRESH_CTIMES = """
UPDATE main.state SET hctime = (SELECT h.ctime FROM s.host h WHERE h.path = main.state.path)
WHERE EXISTS (
  SELECT 1 FROM s.host h WHERE h.path = main.state.path AND h.kind IS main.state.hkind
    AND h.mode IS main.state.hmode AND h.size IS main.state.hsize
    AND h.mtime IS main.state.hmtime AND h.ino IS main.state.hino)
"""

#: the new state: each entry of the manifest that DEST holds with the manifest's kind, with
#: the hash the extractor wrote, or the one the diff verified for a kept file; a file the
#: extractor wrote that DEST holds with another inode, mode, size or mtime now (changed on the
#: host between the swap and this commit) is left out, fetched next time.  So is a file
#: whose size in DEST is not the listed one: what the guest's archive put there is not
#: what its listing described (a file changed between the two reads, or a hostile guest),
#: and recorded with that listing it would match every later honest listing, the wrong
#: entry kept for good (a symlink is held to its listed target where the new tree is
#: read, ``PullState.note_tree``)
COMMIT = """
INSERT INTO main.state
SELECT m.path, m.kind, m.mode, m.size, m.mtime, m.ctime, m.ino, m.target, m.digest,
  CASE WHEN m.kind = 'f' THEN coalesce(fh.hash, CASE WHEN p.act = 'keep' THEN p.hash END) END,
  h.kind, h.mode, h.size, h.mtime, h.ctime, h.ino
FROM s.man m
JOIN s.host h ON h.path = m.path AND h.kind = m.kind
LEFT JOIN s.hashes fh ON fh.path = m.path
LEFT JOIN s.plan p ON p.path = m.path
WHERE (fh.ino IS NULL
  OR (h.ino IS fh.ino AND h.mode IS fh.mode AND h.size IS fh.size AND h.mtime IS fh.mtime))
  AND (m.kind != 'f' OR h.size IS m.size)
"""


def connect(path: Path) -> sqlite3.Connection:
    """Open the state file; sqlite3.DatabaseError (not OperationalError) when it is damaged."""
    db = sqlite3.connect(path, timeout=60.0, isolation_level=None, check_same_thread=False)
    try:
        db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
        db.execute("PRAGMA synchronous = FULL")
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
        if not {"meta", "state", "records"} <= tables:  # a write lock only the first time
            with immediate(db):
                db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
                db.execute(f"CREATE TABLE IF NOT EXISTS state ({STATE_COLUMNS}) WITHOUT ROWID")
                db.execute(RECORDS_TABLE)
        # a torn file (a crash mid-write, a damaged disk) must cost a full pull, never a
        # wrong diff.  Values rewritten by hand in a sound file are believed: the file is
        # the user's own (0600 in a 0700 directory), trusted as DEST itself is; checking
        # every row's types would cost a scan of the state on every pull
        verdict = db.execute("PRAGMA quick_check(1)").fetchone()
        if verdict is None or verdict[0] != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {verdict[0] if verdict else 'no answer'}")
        scratch(db)
    except BaseException:
        db.close()
        raise
    # the scratch tables take many statements: one implicit transaction each is slow
    db.isolation_level = "DEFERRED"
    return db


@contextlib.contextmanager
def immediate(db: sqlite3.Connection) -> Iterator[None]:
    """A write transaction on the state file, taken at once, committed at the end."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        # after SQLITE_FULL or an I/O error SQLite has rolled back already: a second
        # ROLLBACK would raise "no transaction is active" in place of the real error
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
        raise


def temp_dir() -> str:
    """The directory SQLite puts its temporary files in (the scratch tables): the first of
    ``$SQLITE_TMPDIR``, ``$TMPDIR``, ``/var/tmp``, ``/usr/tmp``, ``/tmp`` that is a
    directory this process may write, else ``.`` (``unixTempFileDir`` in SQLite's os_unix.c)."""
    for where in (os.environ.get("SQLITE_TMPDIR"), os.environ.get("TMPDIR")):
        if where and os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK):
            return where
    for where in ("/var/tmp", "/usr/tmp", "/tmp"):
        if os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK):
            return where
    return "."


def scratch(db: sqlite3.Connection) -> None:
    """The per-run tables, in a private temporary database (gone when the connection is)."""
    db.execute("ATTACH DATABASE '' AS s")
    db.execute(f"PRAGMA s.page_size = {PAGE_SIZE}")
    db.execute(f"PRAGMA s.cache_size = -{CACHE_KIB}")
    db.execute("PRAGMA s.journal_mode = OFF")
    db.execute("PRAGMA s.synchronous = OFF")
    db.execute(
        "CREATE TABLE s.man (path BLOB PRIMARY KEY, parent BLOB, kind TEXT, mode INT, size INT, "
        "mtime INT, ctime INT, ino INT, target BLOB, digest TEXT, record BLOB) WITHOUT ROWID"
    )
    db.execute("CREATE TABLE s.unlisted (record BLOB PRIMARY KEY) WITHOUT ROWID")
    #: the manifest's entries whose parent is not a listed directory (incload)
    db.execute("CREATE TABLE s.gone (path BLOB PRIMARY KEY) WITHOUT ROWID")
    db.execute(
        "CREATE TABLE s.host (path BLOB PRIMARY KEY, kind TEXT, mode INT, size INT, mtime INT, "
        "ctime INT, ino INT) WITHOUT ROWID"
    )
    db.execute(
        "CREATE TABLE s.plan (path BLOB PRIMARY KEY, kind TEXT, ino INT, act TEXT, hash TEXT) "
        "WITHOUT ROWID"
    )
    db.execute(
        "CREATE TABLE s.made (path BLOB PRIMARY KEY, kind TEXT, mode INT, size INT, mtime INT, "
        "ctime INT, ino INT) WITHOUT ROWID"
    )
    db.execute("CREATE TABLE s.verdict (path BLOB PRIMARY KEY, ok INT) WITHOUT ROWID")
    db.execute(
        "CREATE TABLE s.kept (path BLOB PRIMARY KEY, kind TEXT, mode INT, size INT, mtime INT, "
        "ino INT) WITHOUT ROWID"
    )
    db.execute(
        "CREATE TABLE s.hashes (path BLOB PRIMARY KEY, hash TEXT, ino INT, mode INT, size INT, "
        "mtime INT) WITHOUT ROWID"
    )
    db.execute(f"CREATE TABLE s.nostate ({STATE_COLUMNS}) WITHOUT ROWID")


def remove_db(path: Path) -> None:
    with host_io(f"removing {path}"):
        for suffix in ("", "-journal", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{path}{suffix}")
