"""Loading the guest's manifest into the incremental state's scratch table (``s.man``).

The manifest is the guest's word: every path is checked to name an entry inside the
workspace (:func:`check_path`), excluded entries and sockets are dropped (tar never archives
them), the entry count is bounded (the farm makes every directory listed, without an archive
to count), and entries whose parent is not a directory of the manifest go (a directory
renamed while ``find`` walked it).  A path listed twice is refused: either record may be
the wrong one.

**Known records** (:mod:`wsync.protocol.manifest`): the records the parser met byte for
byte among those the state recorded were not parsed; their rows are copied from the state
(``incsql.COPY_KNOWN``), the very rows their parse would give, since they passed every
check here when first read.  The table is the one a parse of every record gives.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator
from typing import Protocol, TypeVar

from wsync.engine import incsql
from wsync.engine.api import MiB, human_bytes
from wsync.engine.excludes import Excludes
from wsync.engine.fsutil import free_bytes
from wsync.errors import (
    FILES_KNOB,
    DiskLow,
    HostileArchive,
    LimitExceeded,
    StagingFailed,
    UnstableFiles,
)
from wsync.protocol.manifest import Known

#: rows per executemany (the state's too)
BATCH = 4096
#: bytes of rows put into the scratch table between two checks of its filesystem's room
ROOM_EVERY = 64 * MiB
#: what a row of ``s.man`` costs beside its path, parent and target (an estimate)
_ROW = 128

_T = TypeVar("_T")


class ManifestEntry(Protocol):
    """What the diff reads of :class:`wsync.protocol.manifest.Entry` (structural)."""

    @property
    def path(self) -> bytes: ...
    @property
    def kind(self) -> str: ...
    @property
    def mode(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def mtime_ns(self) -> int: ...
    @property
    def ctime_ns(self) -> int: ...
    @property
    def ino(self) -> int: ...
    @property
    def target(self) -> bytes: ...
    @property
    def digest(self) -> str: ...
    @property
    def record(self) -> bytes: ...


def check_path(path: bytes) -> None:
    """A manifest path must name an entry inside the workspace; HostileArchive if not."""
    if path == b".":
        return
    bad = not path or b"\0" in path or path.startswith(b"/") or path.endswith(b"/")
    bad = bad or b"//" in path
    if not bad and (path.startswith(b".") or b"/." in path):  # only then can "." or ".." be a part
        bad = any(part in (b".", b"..") for part in path.split(b"/"))
    if bad:
        raise HostileArchive(f"the manifest names {path!r}, not a path inside the workspace")


def load(
    db: sqlite3.Connection,
    entries: Iterable[ManifestEntry],
    excludes: Excludes,
    *,
    max_entries: int | None = None,
    known: Known | None = None,
    min_free: int | None = None,
) -> int:
    """Fill ``s.man`` from ``entries`` (see the module docstring); return the listed
    regular files' bytes in KiB, rounded up (what a whole-tree run needs in the guest's
    staging before compression).

    ``max_entries`` is the extractor's ``max_files``.  ``known`` is what
    :meth:`~wsync.engine.incstate.PullState.known` gave the parser of ``entries``, after
    it parsed them: the records it met count against the limit as they are met.

    ``min_free`` is the free-space reserve (``--min-free``), kept on the filesystem of
    SQLite's temporary directory, where the scratch table lives: checked after every
    :data:`ROOM_EVERY` bytes of rows, as the extractor checks DEST's.  A listing's entries
    are bounded in number, not in size (a path or a symlink target of up to 64 KiB each):
    the guest's few KiB of compressed listing would otherwise fill that disk.
    """
    db.execute("DELETE FROM s.man")
    db.execute("DELETE FROM s.unlisted")
    batch: list[tuple[object, ...]] = []
    insert = "INSERT OR REPLACE INTO s.man VALUES (?,?,?,?,?,?,?,?,?,?,?)"
    count = 0
    unchecked = 0

    def matched() -> int:
        return 0 if known is None else known.matched

    for e in entries:
        path = e.path
        check_path(path)
        if e.kind == "s" or excludes.excluded(path, e.kind == "d"):
            continue
        count += 1
        if max_entries is not None and count + matched() > max_entries:
            raise LimitExceeded(
                f"the guest's manifest has more than {max_entries} entries ({FILES_KNOB})"
            )
        parent = (path.rpartition(b"/")[0] or b".") if path != b"." else b""
        if min_free is not None:
            unchecked += 2 * len(path) + len(e.target) + _ROW
            if unchecked >= ROOM_EVERY:
                check_room(min_free)
                unchecked = 0
        batch.append(
            (path, parent, e.kind, e.mode & 0o7777, e.size, e.mtime_ns,
             e.ctime_ns, e.ino, e.target, e.digest, e.record or None)
        )  # fmt: skip
        if len(batch) >= BATCH:
            incsql.insert_rows(db, insert, batch)
            batch.clear()
    incsql.insert_rows(db, insert, batch)
    count += matched()  # (those met after the last parsed entry too)
    if max_entries is not None and count > max_entries:
        raise LimitExceeded(
            f"the guest's manifest has more than {max_entries} entries ({FILES_KNOB})"
        )
    if known is not None and known.matched:
        for rows in batches(iter(known.left)):
            db.executemany("INSERT INTO s.unlisted VALUES (?)", [(r,) for r in rows])
        db.execute(incsql.COPY_KNOWN)
    _refuse_duplicates(db, count)
    root = db.execute("SELECT kind FROM s.man WHERE path = ?", (b".",)).fetchone()
    if root is None or root[0] != "d":
        raise StagingFailed("the guest's manifest has no root directory entry")
    _drop_orphans(db)
    return -(-_listed_bytes(db) // 1024)


def check_room(min_free: int) -> None:
    """Raise :class:`DiskLow` where SQLite's temporary directory (the scratch tables) has
    less than ``min_free`` bytes free."""
    where = incsql.temp_dir()
    free = free_bytes(where, f"statvfs of SQLite's temporary directory {where}")
    if free < min_free:
        raise DiskLow(
            f"the guest's listing would take {where}'s filesystem (SQLite's temporary "
            f"directory) below its {human_bytes(min_free)} free-space reserve "
            f"({human_bytes(free)} free)"
        )


def _drop_orphans(db: sqlite3.Connection) -> None:
    """Delete the entries not reachable from the root through listed directories.

    The entries whose parent is not a listed directory go first (one pass), then every
    descendant of each of them: a range of the primary key (``P/`` up to ``P0``, ``0``
    being the byte after ``/``), so the cost is one pass and a lookup per entry gone,
    whatever the depth.  (Deleting one level per pass until none is left, as before, made a
    hostile manifest of a few thousand nested orphans, a few KiB compressed, cost minutes
    of CPU in one uninterruptible SQL loop: passes times rows times path length.)"""
    db.execute("DELETE FROM s.gone")
    cur = db.execute(
        "INSERT INTO s.gone SELECT path FROM s.man WHERE path != x'2e' AND NOT EXISTS "
        "(SELECT 1 FROM s.man p WHERE p.path = s.man.parent AND p.kind = 'd')"
    )
    if cur.rowcount <= 0:
        return
    db.execute("DELETE FROM s.man WHERE path IN (SELECT path FROM s.gone)")
    delete = "DELETE FROM s.man WHERE path > ? AND path < ?"
    for rows in batches(iter(db.execute("SELECT path FROM s.gone"))):
        db.executemany(delete, [(p + b"/", p + b"0") for (p,) in rows])
    db.execute("DELETE FROM s.gone")


def _listed_bytes(db: sqlite3.Connection) -> int:
    """The regular files' bytes in ``s.man``.  A guest may claim sizes past 2**63 (stored
    as BLOBs, which SQL's sum() would read as text) and sums past it (sum() raises): such
    sizes, and then every size, are summed in Python (SQL's own sum is a fifth of the
    time of reading every size into Python)."""
    try:
        (ints,) = db.execute(
            "SELECT coalesce(sum(size), 0) FROM s.man WHERE kind = 'f' AND typeof(size) = 'integer'"
        ).fetchone()
        wide = "SELECT size FROM s.man WHERE kind = 'f' AND typeof(size) != 'integer'"
    except sqlite3.OperationalError:  # integer overflow
        ints, wide = 0, "SELECT size FROM s.man WHERE kind = 'f'"
    return int(ints) + sum(incsql.py_int(size) for (size,) in db.execute(wide))


def _refuse_duplicates(db: sqlite3.Connection, count: int) -> None:
    """``count`` entries went into ``s.man``: fewer rows mean a path listed twice."""
    rows = db.execute("SELECT count(*) FROM s.man").fetchone()[0]
    if rows == count:
        return
    raise UnstableFiles(
        f"the guest's manifest lists {count - rows} path(s) more than once: the "
        "workspace changed while it was listed; run again"
    )


def batches(rows: Iterator[_T]) -> Iterator[list[_T]]:
    """``rows`` in lists of at most BATCH (``itertools.batched`` is Python 3.12)."""
    batch: list[_T] = []
    for item in rows:
        batch.append(item)
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch
