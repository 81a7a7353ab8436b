"""The hardlink farm: the new tree starts as DEST's unchanged entries, linked, not copied.

An incremental pull must still give readers the old tree or the new one, never a mix, so it
cannot edit DEST in place.  It builds the new tree beside DEST (the same tmp directory a full
pull extracts into) and swaps it in: directories are created fresh, every unchanged file,
symlink or special is *hard-linked* from DEST (one ``linkat`` each: no bytes copied, so an
unchanged 1 GB tree costs a metadata walk), then the changed entries are extracted over it
in replace mode (write a temp file, rename it over the name: a linked inode is shared with
the live DEST and must never be opened for writing, chmod'ed or utime'd).  A reflink farm
would allow in-place writes but needs btrfs/XFS; hardlinks work on every Linux filesystem.

Confinement, as in the extractor: both trees are reached only through directory fds, each
parent opened from its root one component at a time without following a symlink
(:func:`~wsync.engine.beneath.open_beneath`), and ``linkat`` is called without
``AT_SYMLINK_FOLLOW``, so a symlink in DEST is linked as the link itself and no name can
lead out of either tree.  An entry that DEST no longer holds as the diff saw it (the host
changed DEST during the pull) fails the pull with a HostIOError; the next run rescans.

Parent fds are cached (a small LRU keyed by path), because the diff yields entries sorted
by path, where siblings come together but a subtree sits between a directory's own files.
"""

from __future__ import annotations

import collections
import errno
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from wsync.engine.beneath import open_beneath
from wsync.engine.extractfs import REFUSED, clamp_time, set_times
from wsync.engine.hostscan import parts_of
from wsync.engine.itemize import escape
from wsync.errors import HostileArchive, HostIOError

#: open parent fds kept per tree
_CACHE = 32
#: entries between two check_cancel calls
CANCEL_EVERY = 256


class DirLike(Protocol):
    """What :func:`set_dir_meta` reads of a manifest directory entry."""

    @property
    def path(self) -> bytes: ...
    @property
    def mode(self) -> int: ...
    @property
    def mtime_ns(self) -> int: ...


class _Parents:
    """Directory fds of one tree by workspace-relative path, opened without following links."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.fds: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def get(self, path: bytes) -> int:
        if path == b".":
            return self.root_fd
        fd = self.fds.get(path)
        if fd is not None:
            self.fds.move_to_end(path)
            return fd
        fd = open_beneath(self.root_fd, parts_of(path))
        self.fds[path] = fd
        if len(self.fds) > _CACHE:
            _, old = self.fds.popitem(last=False)
            os.close(old)
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _split(path: bytes) -> tuple[bytes, bytes]:
    parent, _, leaf = path.rpartition(b"/")
    return parent or b".", leaf


def build_farm(
    dest_fd: int,
    tmp_fd: int,
    keep: Iterable[tuple[bytes, str]],
    check_cancel: Callable[[], None],
) -> int:
    """Fill the empty tree at ``tmp_fd`` from DEST at ``dest_fd``; return the entries made.

    ``keep`` is ``(path, kind)`` with every directory before its entries (the diff's order):
    directories are created 0o700 (their modes come last, from :func:`set_dir_meta`), all
    else is hard-linked from the same path in DEST.
    """
    dest = _Parents(dest_fd)
    tmp = _Parents(tmp_fd)
    made = 0
    try:
        for path, kind in keep:
            if made % CANCEL_EVERY == 0:
                check_cancel()
            leaf = _split(path)[1]
            if not leaf or leaf in (b".", b".."):
                raise HostileArchive(f"{escape(path)}: not a path inside the workspace")
            make_entry(dest, tmp, path, is_dir=kind == "d")
            made += 1
    finally:
        dest.close()
        tmp.close()
    return made


def make_entry(dest: _Parents, tmp: _Parents, path: bytes, *, is_dir: bool) -> None:
    """One entry of the farm: a fresh 0700 directory, or DEST's entry at the same path
    linked as itself (a symlink is never followed); HostIOError saying why not."""
    parent, leaf = _split(path)
    source: int | None = None
    try:
        into = tmp.get(parent)
        if is_dir:
            os.mkdir(leaf, 0o700, dir_fd=into)
        else:
            source = dest.get(parent)
            os.link(leaf, leaf, src_dir_fd=source, dst_dir_fd=into, follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.EPERM and source is not None and _is_dir(source, leaf):
            # link(2) of a directory is EPERM too: the scan saw a non-directory there
            exc = OSError(errno.ENOTDIR, "it became a directory")
        raise _farm_error(path, exc) from exc


def _is_dir(dir_fd: int, leaf: bytes) -> bool:
    try:
        return stat.S_ISDIR(os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def join_groups(
    tmp_fd: int, groups: Iterable[list[bytes]]
) -> Iterator[tuple[bytes, bytes, os.stat_result]]:
    """Make each group's names in the tree at ``tmp_fd`` one inode again, the first name
    that is a regular file leading; yields ``(name, leader, leader's lstat)`` for each
    name linked anew.

    Why: a guest's ``tar`` writes a hardlink only within one archive, and a busybox guest
    archives a long list in batches (``xargs``, one ``tar`` each): two names of one guest
    inode in two batches arrive as two files.  The manifest says they are one inode (its
    hardlink groups are what DEST must mirror), so they are linked here, like the
    extractor's own hardlinks (``linkat`` to a fresh name, renamed over the name: the
    tree may share inodes with the live DEST only through the farm's links, never an
    inode written in place)."""
    tmp = _Parents(tmp_fd)
    try:
        for group in groups:
            #: the group's first regular file: (path, its parent's path, name, lstat)
            leader: tuple[bytes, bytes, bytes, os.stat_result] | None = None
            for path in group:
                parent, leaf = _split(path)
                try:
                    pfd = tmp.get(parent)
                    st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # gone in the guest while read: not in the tree
                except OSError as exc:
                    raise HostIOError(f"{escape(path)}: {exc.strerror or exc}") from exc
                if not stat.S_ISREG(st.st_mode):
                    continue
                if leader is None:
                    leader = (path, parent, leaf, st)
                    continue
                if st.st_ino == leader[3].st_ino:
                    continue
                fresh = b".wsync-link-" + os.urandom(8).hex().encode()
                try:
                    lfd = tmp.get(leader[1])  # its fd may have left the cache since
                    os.link(leader[2], fresh, src_dir_fd=lfd, dst_dir_fd=pfd, follow_symlinks=False)
                    os.rename(fresh, leaf, src_dir_fd=pfd, dst_dir_fd=pfd)
                except OSError as exc:
                    raise HostIOError(f"{escape(path)}: {exc.strerror or exc}") from exc
                yield path, leader[0], leader[3]
    finally:
        tmp.close()


def _farm_error(path: bytes, exc: OSError) -> HostIOError:
    shown = escape(path)
    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
        return HostIOError(
            f"{shown}: DEST changed during the pull ({exc.strerror}); run the pull again"
        )
    if exc.errno == errno.EPERM:
        return HostIOError(
            f"{shown}: DEST's file cannot be hard-linked into the new tree (immutable or "
            "append-only? lsattr shows it; chattr -i -a lifts it), or pull with --full"
        )
    if exc.errno == errno.EMLINK:
        return HostIOError(
            f"{shown}: too many hard links to link it into the new tree; pull with --full"
        )
    return HostIOError(f"building the new tree, {shown}: {exc.strerror or exc}")


def set_dir_meta(
    tmp_fd: int,
    dirs: Iterable[DirLike],
    seen: Callable[[bytes, os.stat_result], None] | None = None,
) -> None:
    """Give the new tree's directories their modes and mtimes, in the order given.

    The order must put descendants before ancestors (a read-only or unsearchable parent
    would block its children) and the root (``.``, the tree at ``tmp_fd`` itself) last, as
    :meth:`wsync.engine.incstate.Diff.dirs` yields them.  As in the extractor: setuid on a
    directory is refused; setgid and sticky are kept.  ``seen(path, st)`` hears each
    directory but the root as it is once done (the commit records it without an lstat).
    """
    atime_ns = time.time_ns()
    tmp = _Parents(tmp_fd)
    try:
        for entry in dirs:
            mode, path = entry.mode & 0o7777, entry.path
            if mode & 0o4000:
                raise HostileArchive(f"{escape(path)}: {REFUSED['d']}")
            mtime_ns = clamp_time(entry.mtime_ns)
            try:
                if path == b".":
                    tmp.close()
                    os.fchmod(tmp_fd, mode)
                    set_times(tmp_fd, atime_ns, mtime_ns)
                    continue
                parent, leaf = _split(path)
                parent_fd = tmp.get(parent)
                # a reused tree's unchanged directory already has both: one lstat, no
                # write (the tree is private: nobody else can put another entry there)
                st = os.stat(leaf, dir_fd=parent_fd, follow_symlinks=False)
                if (
                    not stat.S_ISDIR(st.st_mode)
                    or stat.S_IMODE(st.st_mode) != mode
                    or st.st_mtime_ns != mtime_ns
                ):
                    fd = os.open(
                        leaf,
                        os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                        dir_fd=parent_fd,
                    )
                    try:
                        os.fchmod(fd, mode)
                        set_times(fd, atime_ns, mtime_ns)
                        st = os.fstat(fd)
                    finally:
                        os.close(fd)
                if seen is not None:
                    seen(path, st)
            except OSError as exc:
                raise HostIOError(f"{escape(path)}: {exc.strerror or exc}") from exc
    finally:
        tmp.close()
