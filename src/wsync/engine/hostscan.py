"""Reading DEST for the incremental state: an fd walk that never follows a link, and re-hashes.

DEST is written by wsync but lives on the host, where anyone with access may change it, and
it holds the guest's data, symlinks included.  So DEST is only ever read through directory
fds: each directory is opened from DEST's own fd one component at a time without following a
symlink (:func:`~wsync.engine.destdir.open_beneath`), entries are ``lstat``'ed through it,
and a file is opened ``O_NOFOLLOW`` in its directory and checked to be the inode the walk
saw before its bytes are hashed.  A symlink is an entry (kind ``l``), never a way in.

Only one directory fd is open at a time (plus one file while hashing), whatever the depth,
and the pending directories are a list of paths, so memory is bounded by the widest level
of names, not by the tree.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator

import xxhash

from wsync.engine.destdir import open_beneath

#: bytes read per call while hashing
_READ = 1024 * 1024
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

#: (path, kind, mode, size, mtime_ns, ctime_ns, ino): one lstat of an entry of DEST
HostRow = tuple[bytes, str, int, int, int, int, int]


def kind_of(mode: int) -> str:
    """The manifest's one-letter kind for an ``st_mode``."""
    if stat.S_ISREG(mode):
        return "f"
    if stat.S_ISDIR(mode):
        return "d"
    if stat.S_ISLNK(mode):
        return "l"
    if stat.S_ISFIFO(mode):
        return "p"
    if stat.S_ISCHR(mode):
        return "c"
    if stat.S_ISBLK(mode):
        return "b"
    return "s"


def row(path: bytes, st: os.stat_result) -> HostRow:
    return (
        path,
        kind_of(st.st_mode),
        stat.S_IMODE(st.st_mode),
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
        st.st_ino,
    )


def parts_of(path: bytes) -> tuple[str, ...]:
    """``a/b/c`` → ``("a", "b", "c")``; the root ``.`` → ``()``."""
    if path in (b".", b""):
        return ()
    return tuple(os.fsdecode(p) for p in path.split(b"/"))


def join(parent: bytes, name: bytes) -> bytes:
    return name if parent == b"." else parent + b"/" + name


def scan(root_fd: int) -> Iterator[HostRow]:
    """Every entry of the tree open at ``root_fd``, the root itself first as ``.``.

    Directories that vanish or turn into something else during the walk are skipped (the
    entry was already reported as what it was when listed); other errors propagate.
    """
    yield row(b".", os.fstat(root_fd))
    pending: list[bytes] = [b"."]
    while pending:
        path = pending.pop()
        try:
            fd = open_beneath(root_fd, parts_of(path))
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                continue
            raise
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    child = join(path, os.fsencode(entry.name))
                    item = row(child, st)
                    if item[1] == "d":
                        pending.append(child)
                    yield item
        finally:
            os.close(fd)


def file_hash(root_fd: int, path: bytes, ino: int) -> str | None:
    """xxh3_128 (hex) of the regular file ``path`` under ``root_fd``, if it is still inode
    ``ino``; None when it is gone, not a regular file, or another inode now."""
    parts = parts_of(path)
    if not parts:
        return None
    try:
        parent = open_beneath(root_fd, parts[:-1])
    except OSError:
        return None
    try:
        fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=parent)
    except OSError:
        return None
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != ino:
            return None
        digest = xxhash.xxh3_128()
        while chunk := os.read(fd, _READ):
            digest.update(chunk)
        return digest.hexdigest()
    except OSError:
        return None
    finally:
        os.close(fd)


def link_target(root_fd: int, path: bytes) -> bytes | None:
    """The target of symlink ``path`` under ``root_fd`` (never followed), or None."""
    parts = parts_of(path)
    if not parts:
        return None
    try:
        parent = open_beneath(root_fd, parts[:-1])
    except OSError:
        return None
    try:
        return os.readlink(os.fsencode(parts[-1]), dir_fd=parent)
    except OSError:
        return None
    finally:
        os.close(parent)
