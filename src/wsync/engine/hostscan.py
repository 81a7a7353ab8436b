"""Reading DEST for the incremental state: an fd walk that never follows a link, and re-hashes.

DEST is written by wsync but lives on the host, where anyone with access may change it, and
it holds the guest's data, symlinks included.  So DEST is only ever read through directory
fds: each directory is opened from DEST's own fd one component at a time without following a
symlink (:func:`~wsync.engine.beneath.open_beneath`), entries are ``lstat``'ed through it,
and a file is opened ``O_NOFOLLOW`` in its directory and checked to be the inode the walk
saw before its bytes are hashed.  A symlink is an entry (kind ``l``), never a way in.

At most 65 directory fds are open at a time (plus one file while hashing), whatever the
depth, and the pending directories are a list of paths, so memory is bounded by the
widest level of names, not by the tree.
"""

from __future__ import annotations

import errno
import os
import resource
import stat
import struct
from collections.abc import Callable, Iterator

import xxhash

from wsync.engine.beneath import open_beneath

#: bytes read per call while hashing
_READ = 1024 * 1024
#: directory fds the walk keeps open for their subdirectories, at most (an eighth of
#: the open-file limit: at ``ulimit -n 48`` 64 of them failed every pull's commit)
_FD_CACHE = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

#: (path, kind, mode, size, mtime_ns, ctime_ns, ino): one lstat of an entry of DEST
HostRow = tuple[bytes, str, int, int, int, int, int]


_KINDS = {
    stat.S_IFREG: "f",
    stat.S_IFDIR: "d",
    stat.S_IFLNK: "l",
    stat.S_IFIFO: "p",
    stat.S_IFCHR: "c",
    stat.S_IFBLK: "b",
    stat.S_IFSOCK: "s",
}


def kind_of(mode: int) -> str:
    """The manifest's one-letter kind for an ``st_mode``."""
    return _KINDS.get(stat.S_IFMT(mode), "s")


def row(path: bytes, st: os.stat_result) -> HostRow:
    mode = st.st_mode
    return (
        path,
        _KINDS.get(stat.S_IFMT(mode), "s"),
        stat.S_IMODE(mode),
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
        st.st_ino,
    )


#: one DEST entry as the scan digest sees it (path length, kind, mode, size, times, inode)
_ROW = struct.Struct("<Ic4xQqqqQ")
#: a row with a time or an inode past 64 signed bits (``_ROW`` cannot pack it): each
#: number as its low 64 bits and the rest, the kind in upper case (such rows stopped the
#: scan before, so no recorded digest holds one)
_WIDE_ROW = struct.Struct("<Ic4xQQQQQqqqqq")
_MASK = 2**64 - 1


class ScanDigest:
    """The digest of a scan: every field of every row, in walk order (the same tree,
    untouched, gives the same digest: the no-op shortcut of
    :meth:`wsync.engine.incstate.PullState.noop_matches` compares two)."""

    def __init__(self) -> None:
        self._digest = xxhash.xxh3_128()
        self._pack = _ROW.pack

    def add(self, item: HostRow) -> None:
        path, kind, mode, size, mtime, ctime, ino = item
        try:
            self._digest.update(self._pack(len(path), kind.encode(), mode, size, mtime, ctime, ino))
        except struct.error:
            self._digest.update(_wide(item))
        self._digest.update(path)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def _wide(item: HostRow) -> bytes:
    """A row's digest bytes when a number passes 64 signed bits (see ``_WIDE_ROW``)."""
    path, kind, mode, size, mtime, ctime, ino = item
    numbers = (mode, size, mtime, ctime, ino)
    low, high = (n & _MASK for n in numbers), (n >> 64 for n in numbers)
    return _WIDE_ROW.pack(len(path), kind.upper().encode(), *low, *high)


def parts_of(path: bytes) -> tuple[str, ...]:
    """``a/b/c`` → ``("a", "b", "c")``; the root ``.`` → ``()``."""
    if path in (b".", b""):
        return ()
    return tuple(os.fsdecode(p) for p in path.split(b"/"))


def join(parent: bytes, name: bytes) -> bytes:
    return name if parent == b"." else parent + b"/" + name


class _DirFds:
    """Recently opened directories of the walk by path: a directory popped from the walk's
    stack is nearly always a child of one just listed, so it is opened from that fd with
    one ``openat(O_NOFOLLOW)``; anything else is reached from the root by ``open_beneath``.
    """

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.fds: dict[bytes, int] = {}
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        unlimited = soft == resource.RLIM_INFINITY
        self.most = _FD_CACHE if unlimited else max(4, min(_FD_CACHE, soft // 8))

    def open(self, path: bytes) -> int:
        """A new fd on directory ``path`` (the caller closes it); OSError if impossible."""
        parent, _, leaf = path.rpartition(b"/")
        held = self.root_fd if not parent else self.fds.get(parent)
        if path == b".":
            return os.dup(self.root_fd)
        if held is not None:
            return os.open(leaf, _DIR_FLAGS, dir_fd=held)
        return open_beneath(self.root_fd, parts_of(path))

    def keep(self, path: bytes, fd: int) -> None:
        if len(self.fds) >= self.most:
            oldest = next(iter(self.fds))
            os.close(self.fds.pop(oldest))
        self.fds[path] = fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def walk_dirs(
    root_fd: int, on_error: Callable[[bytes, OSError], None]
) -> Iterator[tuple[bytes, int, list[bytes]]]:
    """Each directory of the tree at ``root_fd`` as ``(prefix, fd, subdirs)``, the root
    first: ``prefix`` is its path plus ``/`` (empty for the root), ``fd`` is open on it
    until the caller asks for the next one, and the caller appends to ``subdirs`` the
    paths of the entries of it to walk next.  A directory that cannot be opened goes to
    ``on_error(path, exc)``, which raises or returns to skip it.  Bounded fds (see
    :class:`_DirFds`); the caller lists the directory itself (``os.scandir(fd)``)."""
    pending: list[bytes] = [b"."]
    fds = _DirFds(root_fd)
    try:
        while pending:
            path = pending.pop()
            try:
                fd = fds.open(path)
            except OSError as exc:
                on_error(path, exc)
                continue
            subdirs: list[bytes] = []
            try:
                yield (b"" if path == b"." else path + b"/"), fd, subdirs
            except BaseException:
                os.close(fd)
                raise
            pending.extend(subdirs)
            if subdirs:
                fds.keep(path, fd)
            else:
                os.close(fd)
    finally:
        fds.close()


def _skip_gone(path: bytes, exc: OSError) -> None:
    """Directories that vanish or turn into something else during a scan are skipped."""
    if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
        raise exc


def scan(root_fd: int) -> Iterator[HostRow]:
    """Every entry of the tree open at ``root_fd``, the root itself first as ``.``.

    Directories that vanish or turn into something else during the walk are skipped (the
    entry was already reported as what it was when listed); other errors propagate.
    """
    yield row(b".", os.fstat(root_fd))
    for prefix, fd, subdirs in walk_dirs(root_fd, _skip_gone):
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                item = row(prefix + entry.name.encode("utf-8", "surrogateescape"), st)
                if item[1] == "d":
                    subdirs.append(item[0])
                yield item


def file_hash(root_fd: int, path: bytes, ino: int, *, links: int | None = None) -> str | None:
    """xxh3_128 (hex) of the regular file ``path`` under ``root_fd``, if it is still inode
    ``ino`` (with ``links`` names, if given); None when it is gone, not a regular file,
    another inode now, or has another number of links."""
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
        if links is not None and st.st_nlink != links:
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
