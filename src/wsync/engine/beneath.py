"""Opening a directory below a root without following any symlink.

DEST and the tmp tree hold the guest's data, symlinks included, and live on the host where
others may change them: every directory in them is reached from an open root fd, either
with one ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` where the kernel has it or a
walk of ``O_NOFOLLOW | O_DIRECTORY`` opens, one component at a time.

Its own module, with nothing but the standard library and :mod:`wsync.engine.fsutil` under
it: the DEST scan, the farm and the settle step use it without the DEST lock's machinery.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat

from wsync.engine import fsutil

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
#: openat2 has one number on every architecture but alpha (and ia64, gone)
_SYS_OPENAT2 = None if platform.machine().startswith("alpha") else 437


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


def _openat2_beneath(root_fd: int, rel: str) -> int | None:
    """``openat2(root_fd, rel, O_DIRECTORY, RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS)``.

    None when the kernel, libc or a seccomp filter does not offer it (the
    caller then walks), else the fd; OSError for a real refusal.
    """
    libc = fsutil._libc
    if libc is None or _SYS_OPENAT2 is None or not hasattr(libc, "syscall"):
        return None
    how = _OpenHow(_DIR_FLAGS, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    fd = int(
        syscall(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_int(root_fd),
            ctypes.c_char_p(os.fsencode(rel)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
    )
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    # ENAMETOOLONG: a path past PATH_MAX (4096 bytes), which a workspace may hold and the
    # extractor writes (by directory fds); the walk below opens it a component at a time
    if err in (errno.ENOSYS, errno.EPERM, errno.E2BIG, errno.ENAMETOOLONG):
        return None
    raise OSError(err, os.strerror(err), rel)


def open_beneath(root_fd: int, parts: tuple[str, ...], *, use_openat2: bool = True) -> int:
    """Open directory ``root/parts…`` without following any symlink; OSError if impossible.

    ``parts`` are plain names (no ``..``); ``()`` opens the root itself again.
    ``ELOOP`` means a component is a symlink, ``ENOTDIR`` that one is not a
    directory, ``ENOENT`` that one is missing.
    """
    if not parts:
        return os.open(".", _DIR_FLAGS, dir_fd=root_fd)
    if any(p in ("", ".", "..") or "/" in p for p in parts):
        raise OSError(errno.EINVAL, "not a plain path below the root", "/".join(parts))
    if use_openat2:
        fd = _openat2_beneath(root_fd, "/".join(parts))
        if fd is not None:
            return fd
    fd = os.open(".", _DIR_FLAGS, dir_fd=root_fd)
    try:
        for part in parts:
            try:
                nxt = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except NotADirectoryError:
                # O_NOFOLLOW|O_DIRECTORY on a symlink says ENOTDIR; say ELOOP as openat2 does
                if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), part) from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd
