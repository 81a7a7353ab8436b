"""The diff's outcome (:meth:`wsync.engine.incstate.PullState.diff`), read back from the
scratch tables through cursors: what to fetch, what to link into the farm, the directories'
final metadata, and the ``rsync -i`` preview.  Nothing here holds the tree in memory."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterator

from wsync.engine import incsql
from wsync.engine.extractfs import REFUSED
from wsync.engine.itemize import changed_flags, itemize_line

#: the longest path, NUL included, that Linux takes in one system call
PATH_MAX = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class DirMeta:
    """A directory's final mode and mtime, from the manifest."""

    path: bytes
    mode: int
    mtime_ns: int


@dataclasses.dataclass
class Diff:
    """The outcome of :meth:`~wsync.engine.incstate.PullState.diff`; its iterators stream
    from the scratch tables of the state's connection ``db``."""

    db: sqlite3.Connection
    #: entries of the new tree that are not kept as they are (directories included)
    changed: int
    #: entries of DEST that the new tree does not have
    deleted: int
    #: entries :meth:`fetch_paths` yields (0 with changes: only a farm and a swap, no archive)
    fetch: int = 0
    #: bytes of the longest path among them
    longest: int = 0

    @property
    def nothing_to_do(self) -> bool:
        return self.changed == 0 and self.deleted == 0

    def fetch_paths(self) -> Iterator[bytes]:
        """Non-directory entries to fetch, sorted by path bytes (parents before children)."""
        rows = self.db.execute(
            f"SELECT path FROM s.plan WHERE kind != 'd' AND act IN {incsql.FETCHED} ORDER BY path"  # noqa: S608
        )
        for (path,) in rows:
            yield bytes(path)

    def fetched_groups(self) -> Iterator[list[bytes]]:
        """The names of each guest hardlink group this pull fetches (a fetched inode is
        fetched under every name: the diff's ``linked``), sorted, groups by guest inode."""
        rows = self.db.execute(
            "SELECT m.ino, p.path FROM s.plan p JOIN s.man m USING (path) WHERE p.kind = 'f' "  # noqa: S608
            f"AND m.ino != 0 AND p.act IN {incsql.FETCHED} "
            "AND m.ino IN (SELECT ino FROM s.man WHERE kind = 'f' AND ino != 0 "
            "GROUP BY ino HAVING count(*) > 1) ORDER BY m.ino, p.path"
        )
        group: list[bytes] = []
        last: object = None
        for ino, path in rows:
            if group and ino != last:
                yield group
                group = []
            group.append(bytes(path))
            last = ino
        if len(group) > 1:
            yield group

    def longest_fetch(self) -> bytes | None:
        """A path to fetch that the guest's tools cannot name in one call (``./`` and the
        path past PATH_MAX, 4096 bytes with its NUL), or None.  A ``select`` run hands the
        guest's ``tar -T`` and ``[ -e ]`` such names: tar cannot open them, and the test
        takes them for vanished, so the entry would be taken as deleted."""
        if self.longest + 2 < PATH_MAX:
            return None  # the usual case: the diff's own scan measured them all
        return next(path for path in self.fetch_paths() if len(path) + 2 >= PATH_MAX)

    def keep(self) -> Iterator[tuple[bytes, str]]:
        """(path, kind) for the farm: every directory but the root, and the unchanged
        entries to link, sorted by path bytes, so a directory comes before its entries."""
        rows = self.db.execute(
            "SELECT path, kind FROM s.plan WHERE (kind = 'd' AND path != x'2e') "
            "OR (kind != 'd' AND act = 'keep') ORDER BY path"
        )
        for path, kind in rows:
            yield bytes(path), str(kind)

    def dirs(self) -> Iterator[DirMeta]:
        """Every directory of the manifest, descendants before ancestors, the root last."""
        rows = self.db.execute(
            "SELECT path, mode, mtime FROM s.man WHERE kind = 'd' AND path != x'2e' "
            "ORDER BY path DESC"
        )
        for path, mode, mtime in rows:
            yield DirMeta(bytes(path), int(mode), incsql.py_int(mtime))
        root = self.db.execute("SELECT mode, mtime FROM s.man WHERE path = x'2e'").fetchone()
        if root is not None:
            yield DirMeta(b".", int(root[0]), incsql.py_int(root[1]))

    def refused(self) -> tuple[bytes, str] | None:
        """The first entry (by path) that the pull would refuse, and why, in the words of
        the extractor and the directory pass: a FIFO or a device it fetches, a file it
        fetches with a setuid, setgid or sticky bit, any directory with a setuid bit.
        For a dry run, which fetches nothing and would otherwise report success where
        the pull fails (exit 7)."""
        row = self.db.execute(
            "SELECT p.path, m.kind FROM s.plan p JOIN s.man m USING (path) WHERE "  # noqa: S608
            f"(m.kind IN ('p', 'c', 'b', 'f') AND p.act IN {incsql.FETCHED} "
            "AND (m.kind != 'f' OR m.mode & 3584 != 0)) "  # 0o7000
            "OR (m.kind = 'd' AND m.mode & 2048 != 0) "  # 0o4000
            "ORDER BY p.path LIMIT 1"
        ).fetchone()
        if row is None:
            return None
        return bytes(row[0]), REFUSED[str(row[1])]

    def itemize(self) -> Iterator[str]:
        """``rsync -i`` style lines: deletions first, then changes, paths escaped."""
        db = self.db
        gone = db.execute(
            "SELECT path, kind FROM s.host h "
            "WHERE NOT EXISTS (SELECT 1 FROM s.man m WHERE m.path = h.path) ORDER BY path DESC"
        )
        for path, kind in gone:
            yield itemize_line("*deleting", bytes(path), str(kind) == "d", b"")
        rows = db.execute(
            "SELECT p.path, p.act, m.kind, m.mode, m.size, m.mtime, m.ctime, m.ino, m.target, "
            "m.digest, o.kind, o.mode, o.size, o.mtime, o.ctime, o.ino, o.target, o.digest "
            "FROM s.plan p JOIN s.man m USING (path) LEFT JOIN base o USING (path) "
            "WHERE p.act != 'keep' ORDER BY p.path"
        )
        for path, act, *record in rows:
            new, old = tuple(record[:8]), tuple(record[8:])
            code = changed_flags(str(act), new, old)
            target = bytes(new[6] or b"") if new[0] == "l" else b""
            yield itemize_line(code, bytes(path), new[0] == "d", target)
