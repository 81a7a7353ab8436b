"""The previous tree: what an incremental pull keeps beside DEST to start the next one from.

Why: a fresh hardlink farm (:func:`~wsync.engine.farm.build_farm`) costs one ``linkat`` per
entry to build and, after the swap, one ``unlink`` per entry to remove the old tree.  On a
59k-entry workspace with 1% of its files changed that was 3.3 s of a 6.4 s pull, beside 1.3 s
for all of ``rsync -a``: the pull cost what the tree holds, not what changed.

After the swap the old tree (the DEST readers saw until then) already *is* most of the next
farm: its unchanged entries are the very inodes the new DEST holds.  So with ``--keep-prev``
an incremental pull keeps it as ``.NAME.wsync-prev``, minus what the new DEST does not share
(old versions of changed files, deleted entries: :func:`prune`, a cost of what changed), and
the next incremental pull starts its tmp tree from it (:func:`reuse`): a walk lists it
(``getdents`` only: kind and inode come with the names; taken while the manifest loads and
the diff runs, :func:`walk_ahead`), what the new farm must not hold is
removed, what it lacks is linked, and the archive is then applied to it as to a fresh farm.

It is an option, off by default, because it shows: every file of DEST has a second link
(``st_nlink`` 2), removing DEST frees no space while the kept tree holds the same inodes, and
a process sitting in a directory of a replaced tree sees it pruned and, a pull later,
rebuilt in place (without the option it sees it removed).  A daemon that owns its DESTs and
pulls them every few minutes is where it pays.

What stays is decided by identity, never by trust: a non-directory stays only where the farm
would link DEST's entry at the same path and it *is* that inode (one inode is one file: same
bytes, mode and times); a directory stays where the new tree has a directory (its mode and
mtime are set from the manifest at the end, as in a fresh farm).  Anything else goes: an
entry of a failed run, an old version, whatever someone else put there.  Inode numbers are
unique within one filesystem and the tree sits beside DEST; where a filesystem reports
directory-entry inodes that differ from ``lstat``'s (some overlayfs set-ups), entries only
fail to match and are linked again: slower, never wrong.

Confinement is the farm's: the tree is reached through directory fds opened without
following a link, its root is 0700 while the pull builds it, and each directory that others
could write to is made 0700 before it is listed, so nobody else can add to it once it was
looked at (not even one who still holds a directory fd from when it was DEST: permission is
checked at each creation); a directory that is not ours, is on another filesystem or
cannot be opened is never walked for reuse: it is removed whole.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NamedTuple

from wsync.engine import incsql
from wsync.engine.destdir import fs_stamp
from wsync.engine.farm import CANCEL_EVERY, _Parents, _split, build_farm
from wsync.engine.fsutil import make_private, remove_tree_at
from wsync.engine.hostscan import HostRow, row, walk_dirs
from wsync.engine.itemize import escape
from wsync.errors import HostIOError

#: rows per INSERT batch of the walk
_BATCH = 5000
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_INSERT = "INSERT OR REPLACE INTO s.prev VALUES (?, ?, ?, ?, 0)"
_TABLE = (
    "CREATE TABLE IF NOT EXISTS s.prev (path BLOB PRIMARY KEY, kind TEXT, ino INT, "
    "mode INT, ok INT) WITHOUT ROWID"
)
#: entries of the reused tree that the new farm holds as they are
_VERDICT = """
UPDATE s.prev SET ok = 1 WHERE EXISTS (
  SELECT 1 FROM s.plan p LEFT JOIN s.host h ON h.path = p.path
  WHERE p.path = s.prev.path AND (
    (s.prev.kind = 'd' AND p.kind = 'd')
    OR (s.prev.kind = 'n' AND p.kind != 'd' AND p.act = 'keep'
        AND h.kind != 'd' AND h.ino = s.prev.ino)))
"""
_STALE = "SELECT path FROM s.prev WHERE ok = 0 ORDER BY path DESC"
#: kept directories that let group or others do more than the guest's mode now does
_NARROWED = (
    "SELECT t.path FROM s.prev t JOIN s.man m ON m.path = t.path "
    "WHERE t.kind = 'd' AND t.ok = 1 AND (t.mode & 63 & ~m.mode) != 0"
)
#: what the farm needs and the reused tree lacks (parents first, as build_farm wants)
_MISSING = """
SELECT p.path, p.kind FROM s.plan p
WHERE ((p.kind = 'd' AND p.path != x'2e') OR (p.kind != 'd' AND p.act = 'keep'))
  AND NOT EXISTS (SELECT 1 FROM s.prev t WHERE t.path = p.path AND t.ok = 1)
ORDER BY p.path
"""
#: entries of the new DEST that this pull made: its directories and what it fetched
_TOUCHED = """
SELECT path FROM s.man WHERE kind = 'd'
UNION ALL
SELECT path FROM s.plan WHERE kind != 'd' AND act != 'keep'
ORDER BY 1
"""
#: entries of the old DEST that the new one does not share (children before parents)
_UNSHARED = """
SELECT h.path FROM s.host h LEFT JOIN s.plan p ON p.path = h.path
WHERE h.path != x'2e' AND NOT (p.path IS NOT NULL AND (
  (h.kind = 'd' AND p.kind = 'd') OR (h.kind != 'd' AND p.kind != 'd' AND p.act = 'keep')))
ORDER BY h.path DESC
"""


def _private_dir(parent_fd: int, name: str, dev: int) -> int | None:
    """The mode of directory ``name`` of ``parent_fd`` if it is ours and only we may add
    to it (None: remove it whole).  A directory others could write to is made 0700 (its
    mode comes back from the manifest at the end); one they cannot is left as it is, so an
    unchanged directory costs no write at all (one the guest has since closed further is
    made 0700 after the verdict: :data:`_NARROWED`)."""
    try:
        # one lstat for the common case, a directory left as it is: the parent is private
        # (ours, 0700 or narrower for others), so nobody else can put another entry there
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_dev != dev:
        return None  # not ours, or another filesystem: inode numbers mean nothing
    mode = stat.S_IMODE(st.st_mode)
    if not (mode & 0o022 or mode & 0o700 != 0o700):
        return mode
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_ino != st.st_ino:
            return None  # (one of this user's processes swapped it: not walked)
        os.fchmod(fd, 0o700)
        return 0o700
    except OSError:
        return None
    finally:
        os.close(fd)


def walk(
    root_fd: int,
    check_cancel: Callable[[], None],
    listed: dict[bytes, tuple[int, int]] | None = None,
) -> Iterator[tuple[bytes, str, int, int]]:
    """``(path, kind, inode, mode)`` of every entry below the tree at ``root_fd`` (made
    private by the caller): kind ``d`` for a directory nobody else may add to (its mode
    given), ``x`` for one that is not ours, is on another filesystem or cannot be opened
    (not walked: removed whole), ``n`` for anything else (mode 0).  ``listed`` gets the
    ctime and mtime of each directory below the root as it was listed, by its path plus
    ``/``."""
    dev = os.fstat(root_fd).st_dev
    seen = 0
    for prefix, fd, subdirs in walk_dirs(root_fd, _unreadable):
        if listed is not None and prefix:
            st = os.fstat(fd)
            listed[prefix] = (st.st_ctime_ns, st.st_mtime_ns)
        with os.scandir(fd) as entries:
            for entry in entries:
                seen += 1
                if seen % CANCEL_EVERY == 0:
                    check_cancel()
                name = prefix + os.fsencode(entry.name)
                mode: int | None = 0
                if entry.is_dir(follow_symlinks=False):
                    mode = _private_dir(fd, entry.name, dev)
                    kind = "x" if mode is None else "d"
                else:
                    kind = "n"
                if kind == "d":
                    subdirs.append(name)
                yield name, kind, entry.inode(), mode or 0


#: an entry of the walk: path, kind, inode, mode (see :func:`walk`)
Row = tuple[bytes, str, int, int]


class Walked(NamedTuple):
    """A walk taken ahead of the reuse (:func:`walk_ahead`): the tree's root as
    ``(st_dev, st_ino)``, every row of the walk, and each directory's ctime and mtime when
    it was listed (by path plus ``/``; not the root's)."""

    root: tuple[int, int]
    rows: list[Row]
    listed: dict[bytes, tuple[int, int]]
    #: times the tree's filesystem stamped before the walk began and after it ended
    since: int
    until: int


def _still_listed(tmp_fd: int, walked: Walked) -> bool:
    """Whether every directory the walk listed is as it was then: an entry added, removed
    or renamed in one since (a process of this user whose working directory was in the
    replaced tree) moves its ctime, even where its mtime is put back (``tar x``), and a
    walk of today is due.  A directory the walk itself made private (a ``chmod``, before
    its listing) has a ctime of the walk's own time, which a change in the same clock
    tick would keep: its mtime must be as it was too, and not of that time.  The root is
    listed again (renaming the tree into place moves its ctime): one directory."""
    parents = _Parents(tmp_fd)
    try:
        with os.scandir(tmp_fd) as entries:
            top = {os.fsencode(e.name) for e in entries}
        if top != {path for path, *_ in walked.rows if b"/" not in path}:
            return False
        during = range(walked.since, walked.until + 1)
        for prefix, (ctime, mtime) in walked.listed.items():
            parent, leaf = _split(prefix[:-1])
            st = os.stat(leaf, dir_fd=parents.get(parent), follow_symlinks=False)
            if st.st_ctime_ns != ctime or not stat.S_ISDIR(st.st_mode):
                return False
            if ctime in during and (st.st_mtime_ns != mtime or mtime in during):
                return False
    except OSError:
        return False
    finally:
        parents.close()
    return True


def walk_ahead(
    parent_fd: int,
    names: Iterable[str],
    check_cancel: Callable[[], None],
    limit: int,
    since: int,
    dest_name: str,
) -> Walked | None:
    """The walk of the tree a reuse will start from, taken while the manifest loads and
    the diff runs (a worker thread; the DEST lock held): the first of ``names`` in
    ``parent_fd`` that opens as a directory, made private first as the reuse makes it.
    None when there is none, it is not ours, or it holds more than ``limit`` entries
    (they would all be in memory: the reuse walks it then, into the state's tables).

    The reuse takes the rows only for the very directory it renamed into place (same
    root inode), and only while no directory the walk listed has changed since: once
    private, nobody else can add to the tree or to any directory of it that was walked,
    and nothing else of this pull writes to it before the reuse, but a process of this
    user sitting in a directory of the replaced tree may (:func:`_still_listed`).
    ``since`` is a time the tree's filesystem stamped before the walk (and the walk
    stamps one after it, by a directory made beside DEST ``dest_name``): a directory
    changed between the two is never taken as listed (a change in the same clock tick as
    the listing would leave its time as it was)."""
    for name in names:
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError:
            continue
        try:
            if not make_private(fd):
                return None
            st = os.fstat(fd)
            rows: list[Row] = []
            listed: dict[bytes, tuple[int, int]] = {}
            for item in walk(fd, check_cancel, listed):
                if len(rows) >= limit:
                    return None
                rows.append(item)
            until = fs_stamp(parent_fd, dest_name)
            if until is None:
                return None
            return Walked((st.st_dev, st.st_ino), rows, listed, since, until)
        except (OSError, HostIOError):
            return None
        finally:
            os.close(fd)
    return None


def _unreadable(path: bytes, exc: OSError) -> None:
    raise HostIOError(f"reading the previous tree at {escape(path)}: {exc}") from exc


def _make_writable(fd: int) -> bool:
    """Give the owner rwx on the directory open at ``fd`` if it is ours and lacks it."""
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o700 == 0o700:
            return False
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)
    except OSError:
        return False
    return True


def _close_narrowed(root_fd: int, paths: list[bytes]) -> None:
    """Make 0700 the kept directories whose guest mode is now narrower for group or others,
    before anything new is linked or extracted into them (their modes are set from the
    manifest at the end)."""
    parents = _Parents(root_fd)
    try:
        for path in paths:
            try:
                os.fchmod(parents.get(path), 0o700)
            except OSError as exc:
                raise HostIOError(f"{escape(path)}: {exc.strerror or exc}") from exc
    finally:
        parents.close()


def remove_all(root_fd: int, paths: Iterable[bytes], check_cancel: Callable[[], None]) -> int:
    """Remove each path (a whole tree if a directory) below ``root_fd``, children given
    before their parents; returns how many were removed."""
    parents = _Parents(root_fd)
    removed = 0
    try:
        for path in paths:
            if removed % CANCEL_EVERY == 0:
                check_cancel()
            parent, leaf = _split(path)
            try:
                parent_fd = parents.get(parent)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue  # its parent went first (not ours, or not a directory)
                raise HostIOError(f"{escape(path)}: {exc.strerror or exc}") from exc
            try:
                remove_tree_at(parent_fd, os.fsdecode(leaf), shown=escape(path))
            except HostIOError:
                # a kept directory has the guest's mode (read-only, say) until a reuse
                # walks it: make ours writable (a kept tree's directories are its own)
                if not _make_writable(parent_fd):
                    raise
                remove_tree_at(parent_fd, os.fsdecode(leaf), shown=escape(path))
            removed += 1
    finally:
        parents.close()
    return removed


def reuse(
    db: sqlite3.Connection,
    dest_fd: int,
    tmp_fd: int,
    check_cancel: Callable[[], None],
    walked: Walked | None = None,
) -> tuple[int, int]:
    """Turn the reused tree at ``tmp_fd`` into the farm of the diff in ``db``'s scratch
    tables (``s.plan``, ``s.host``); return (entries removed, entries made).  ``walked``:
    the walk :func:`walk_ahead` took, used when it is of this very tree."""
    st = os.fstat(tmp_fd)
    if (
        walked is not None
        and walked.root == (st.st_dev, st.st_ino)
        and _still_listed(tmp_fd, walked)
    ):
        rows: Iterable[Row] = walked.rows
    else:
        rows = walk(tmp_fd, check_cancel)
    try:
        db.execute(_TABLE)
        db.execute("DELETE FROM s.prev")
        batch: list[Row] = []
        for item in rows:
            batch.append(item)
            if len(batch) >= _BATCH:
                incsql.insert_rows(db, _INSERT, batch)
                batch.clear()
        incsql.insert_rows(db, _INSERT, batch)
        db.execute(_VERDICT)
        _close_narrowed(tmp_fd, [bytes(p) for (p,) in db.execute(_NARROWED)])
        stale = (bytes(p) for (p,) in db.execute(_STALE))
        removed = remove_all(tmp_fd, stale, check_cancel)
        missing = ((bytes(p), str(k)) for p, k in db.execute(_MISSING))
        made = build_farm(dest_fd, tmp_fd, missing, check_cancel)
    except sqlite3.Error as exc:
        raise HostIOError(f"incremental state: {exc}") from exc
    return removed, made


def prune(db: sqlite3.Connection, prev_fd: int, check_cancel: Callable[[], None]) -> int:
    """Remove from the old DEST, now at ``prev_fd``, what the new DEST does not share
    (call it before the commit rescans DEST into ``s.host``); returns the count."""
    try:
        paths = (bytes(p) for (p,) in db.execute(_UNSHARED))
        return remove_all(prev_fd, paths, check_cancel)
    except sqlite3.Error as exc:
        raise HostIOError(f"incremental state: {exc}") from exc


def restat(
    db: sqlite3.Connection, tree_fd: int, dir_rows: Mapping[bytes, HostRow]
) -> Iterator[tuple[bytes, HostRow | None]]:
    """After a pull that diffed DEST (the tree reused by :func:`reuse`, or a farm), the
    lstat rows of what it made in its new tree (at ``tree_fd``, finished, before the swap:
    ``PullState.note_tree``): every directory and every fetched entry; None for one that
    is gone.  Streamed: the caller writes them to a table as they come (a million-entry
    change must not be a million rows in memory).  A directory in ``dir_rows`` (as the
    pull left it) is not looked at again; the root always is.

    Every other row stays the diff's scan, also for an entry the farm or the reuse linked
    anew (a link moves the inode's ctime: within the commit's ctime window, or, after a
    reuse that opens none, re-hashed once by the next pull): recording its lstat now would
    record whatever was done to it since the scan, which no later pull would see."""
    parents = _Parents(tree_fd)
    try:
        for (raw,) in db.execute(_TOUCHED):
            path = bytes(raw)
            if path == b".":
                yield path, row(path, os.fstat(tree_fd))
                continue
            known = dir_rows.get(path)
            if known is not None:
                yield path, known
                continue
            parent, leaf = _split(path)
            try:
                st = os.stat(leaf, dir_fd=parents.get(parent), follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    raise HostIOError(f"reading DEST, {escape(path)}: {exc.strerror}") from exc
                yield path, None
                continue
            yield path, row(path, st)
    except sqlite3.Error as exc:
        raise HostIOError(f"incremental state: {exc}") from exc
    finally:
        parents.close()
