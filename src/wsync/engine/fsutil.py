"""Durable and atomic host file operations.

Every durable file is written the way borg's ``SaveFile`` does it: write a
temporary file beside the target, fsync it, rename it over the target, fsync
the directory.  A crash at any point leaves the old file or the new one.  Any
OSError becomes :class:`~wsync.errors.HostIOError`: a failed write is a
failure, never a silent success.

DEST is replaced with ``renameat2(RENAME_EXCHANGE)`` where the kernel and libc
offer it (one atomic step: DEST is the old tree or the new one, never absent);
elsewhere with two renames, leaving a short window where DEST is absent but
never a mix of trees.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from wsync.errors import HostIOError

_RENAME_EXCHANGE = 2
_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
except OSError:  # pragma: no cover - exotic libc
    _libc = None


@contextlib.contextmanager
def host_io(what: str) -> Iterator[None]:
    """Translate OSError into HostIOError naming what was being done."""
    try:
        yield
    except OSError as exc:
        raise HostIOError(f"{what}: {exc.strerror or exc}") from exc


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` durably: temp, fsync, rename, fsync dir."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with host_io(f"writing {path}"):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)


def syncfs(path: Path) -> None:
    """Flush the whole filesystem holding ``path`` (one call instead of an fsync per file)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc is not None and hasattr(_libc, "syncfs"):
            if _libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        else:  # pragma: no cover
            os.sync()
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False when the platform cannot."""
    if _libc is None or not hasattr(_libc, "renameat2"):
        return False
    at_fdcwd = -100
    rc = _libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_into_place(new: Path, dest: Path) -> Path | None:
    """Make ``new`` appear at ``dest`` atomically.

    Returns the path now holding the *old* tree (to be removed by the caller),
    or None when ``dest`` did not exist.
    """
    with host_io(f"replacing {dest}"):
        if not os.path.lexists(dest):
            os.rename(new, dest)
            fsync_dir(dest.parent)
            return None
        if _exchange(new, dest):
            fsync_dir(dest.parent)
            return new
        old = dest.with_name(f".{dest.name}.wsync-old")
        rmtree(old)
        os.rename(dest, old)
        os.rename(new, dest)
        fsync_dir(dest.parent)
        return old


def rmtree(path: Path) -> None:
    """Remove a tree we wrote, even where it holds read-only directories."""

    def onerror(func: object, failed: str, exc_info: object) -> None:
        parent = os.path.dirname(failed)
        with contextlib.suppress(OSError):
            os.chmod(parent, stat.S_IRWXU)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            shutil.rmtree(failed, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(failed)

    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, onerror=onerror)
        else:
            os.unlink(path)
