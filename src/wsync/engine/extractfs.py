"""The extractor's filesystem primitives: confined names, creation and times.

What :mod:`wsync.engine.extract` does with every member, one syscall at a time, and what
its writer threads (:mod:`wsync.engine.writers`) run; also used by the farm of incremental
pulls (:mod:`wsync.engine.farm`) for times.  Why each is safe is the extractor's docstring
("Confinement"); nothing here follows a symlink or resolves a name from anywhere but a
directory fd reached by :class:`DirStack`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import xxhash

from wsync.engine.tarstream import show_name
from wsync.errors import HostileArchive, HostIOError, WsyncError

#: longest member name or link target, in bytes
MAX_NAME = 64 * 1024
#: why an entry is refused, by its kind as a listing gives it, in one place: the extractor
#: and the directory pass say it, and a dry run that finds one (incdiff.Diff.refused)
REFUSED = {
    "p": "FIFO",
    "c": "character device",
    "b": "block device",
    "f": "setuid, setgid or sticky bit on a file",
    "d": "setuid bit on a directory",
}
#: directory fds kept open along the current path
WINDOW = 48
FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NS = 1_000_000_000
#: what ``os.utime(ns=...)`` takes: beyond it (after 2262, before 1677) whole seconds are set
_MIN_NS = -(2**63)
_MAX_NS = 2**63 - 1
#: what ``os.utime(times=...)`` takes (a 64-bit ``time_t``)
_MIN_TIME_T = -(2**63)
_MAX_TIME_T = 2**63 - 1


def umask() -> int | None:
    """The process umask without changing it (racy ``os.umask`` is not thread-safe)."""
    try:
        with Path("/proc/self/status").open("rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def split_name(name: bytes, *, is_dir: bool) -> list[bytes]:
    """Validated components of a member name; ``[]`` is the root itself (``.`` or ``./``)."""
    if not name:
        raise HostileArchive("member with an empty name")
    if b"\0" in name:
        raise HostileArchive(f"{show_name(name)}: NUL byte in name")
    if len(name) > MAX_NAME:
        raise HostileArchive(f"{show_name(name)}: name longer than {MAX_NAME} bytes")
    if name[0] == 0x2F:  # "/"
        raise HostileArchive(f"{show_name(name)}: absolute name")
    parts = [p for p in name.split(b"/") if p and p != b"."]
    if b".." in parts:
        raise HostileArchive(f"{show_name(name)}: '..' component")
    if not is_dir and (not parts or name.endswith(b"/")):
        raise HostileArchive(f"{show_name(name)}: not a file name")
    return parts


def check_link_target(name: bytes, target: bytes) -> None:
    """Refuse only a symlink target that cannot be stored; where it points is data."""
    if not target:
        raise HostileArchive(f"{show_name(name)}: symlink with an empty target")
    if b"\0" in target or len(target) > MAX_NAME:
        raise HostileArchive(f"{show_name(name)}: malformed symlink target")


def clamp_time(mtime_ns: int) -> int:
    """``mtime_ns`` limited to what the host's 64-bit ``time_t`` holds (module docstring)."""
    return min(max(mtime_ns, _MIN_TIME_T * _NS), _MAX_TIME_T * _NS)


def set_times(
    path: int | bytes,
    atime_ns: int,
    mtime_ns: int,
    *,
    dir_fd: int | None = None,
    follow_symlinks: bool = True,
) -> None:
    """Set ``mtime_ns`` exactly, or in whole seconds where nanoseconds overflow 64 bits."""
    if _MIN_NS <= mtime_ns <= _MAX_NS:
        os.utime(path, ns=(atime_ns, mtime_ns), dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    else:
        os.utime(
            path,
            times=(atime_ns // _NS, mtime_ns // _NS),
            dir_fd=dir_fd,
            follow_symlinks=follow_symlinks,
        )


def hash_at(dir_fd: int, leaf: bytes, shown: str) -> str:
    """xxh3_128 of the regular file ``leaf`` in ``dir_fd`` (never through a symlink)."""
    digest = xxhash.xxh3_128()
    try:
        fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            while block := os.read(fd, 1 << 20):
                digest.update(block)
        finally:
            os.close(fd)
    except OSError as exc:
        raise HostIOError(f"{shown}: {exc.strerror or exc}") from exc
    return digest.hexdigest()


def create_file(
    dir_fd: int,
    leaf: bytes,
    name: bytes,
    mode: int,
    data: bytes,
    chmod: bool,
    atime_ns: int,
    mtime_ns: int,
    want_stat: bool,
) -> os.stat_result | None:
    """A small file, created by a writer thread (the extractor's small files: see
    :mod:`wsync.engine.writers`); its ``fstat`` when ``want_stat``."""
    try:
        fd = os.open(leaf, FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as exc:
        raise refuse_os(exc, show_name(name)) from exc
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException as exc:
        abandon(fd, name, exc)
    return finish_file(fd, name, mode, chmod, atime_ns, mtime_ns, want_stat)


def abandon(fd: int, name: bytes, exc: BaseException) -> NoReturn:
    """Close a file whose writing failed, and raise: an OSError as HostIOError."""
    with contextlib.suppress(OSError):
        os.close(fd)
    if isinstance(exc, OSError):
        raise HostIOError(f"{show_name(name)}: {exc.strerror or exc}") from exc
    raise exc


def finish_file(
    fd: int,
    name: bytes,
    mode: int,
    chmod: bool,
    atime_ns: int,
    mtime_ns: int,
    want_stat: bool,
) -> os.stat_result | None:
    """Set a written file's mode (``chmod``: the umask took bits) and times, close it;
    its ``fstat`` when ``want_stat``."""
    try:
        if chmod:
            os.fchmod(fd, mode)
        set_times(fd, atime_ns, mtime_ns)
        return os.fstat(fd) if want_stat else None
    except OSError as exc:
        raise HostIOError(f"{show_name(name)}: {exc.strerror or exc}") from exc
    finally:
        try:
            os.close(fd)
        except OSError as exc:
            raise HostIOError(f"{show_name(name)}: {exc.strerror or exc}") from exc


def replacement_name() -> bytes:
    """A fresh name for an entry read again, moved over the old one once complete."""
    return b".wsync-again-" + secrets.token_hex(8).encode()


def refuse_os(exc: OSError, what: str) -> WsyncError:
    """Map an ``OSError`` from path resolution to a refusal or a host error."""
    if exc.errno == errno.ENOENT:
        return HostileArchive(f"{what}: parent directory is not an earlier member")
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return HostileArchive(f"{what}: path crosses a symlink or a non-directory")
    if exc.errno == errno.EEXIST:
        return HostileArchive(f"{what}: name already exists in the archive")
    if exc.errno == errno.ENAMETOOLONG:
        return HostileArchive(f"{what}: name too long for the host")
    return HostIOError(f"{what}: {exc.strerror or exc}")


class DirStack:
    """Open directory fds along the most recently used path, at most ``WINDOW`` of them.

    Tar emits members depth-first, so the parent of the next member is almost always on the
    stack already and costs no syscall.  Open fds are always a suffix of the stack; a path
    whose ancestors fell out of the window is walked again from the root.
    """

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self._names: list[bytes] = []
        self._fds: list[int] = []

    def fd_for(self, parts: Sequence[bytes]) -> int:
        """An fd for directory ``parts`` (never through a symlink); valid until the next call."""
        names = self._names
        fds = self._fds
        limit = min(len(names), len(parts))
        n = 0
        while n < limit and names[n] == parts[n]:
            n += 1
        if n and fds[n - 1] < 0:
            n = 0
        self._truncate(n)
        fd = fds[n - 1] if n else self.root_fd
        for comp in parts[n:]:
            fd = os.open(comp, DIR_FLAGS, dir_fd=fd)
            names.append(comp)
            fds.append(fd)
            old = len(fds) - WINDOW - 1
            if old >= 0 and fds[old] >= 0:
                os.close(fds[old])
                fds[old] = -1
        return fd

    def _truncate(self, n: int) -> None:
        fds = self._fds
        while len(fds) > n:
            fd = fds.pop()
            self._names.pop()
            if fd >= 0:
                os.close(fd)

    def close(self) -> None:
        self._truncate(0)
