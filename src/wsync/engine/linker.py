"""The early farm's worker process: DEST's scanned entries linked into the tmp tree.

Why a process, not a thread: the farm is one ``mkdir`` or ``linkat`` per entry, and
CPython releases the GIL around each.  While another thread of the pull runs Python (the
manifest's parser, the diff), a thread that gives the GIL up tens of thousands of times
waits for it again each time (up to the 5 ms switch interval: the "convoy effect").  On the
2-core bench VM a 59k-entry farm took 1.3 s alone, 1.3 s beside a process that burnt a core,
and 200 s beside a thread that ran a Python loop.  Here it has a core and an interpreter of
its own, and the pull's threads never wait for it.

Why it imports nothing of wsync: it must start in milliseconds, and it needs only ``os``.
Confinement is the farm's (:mod:`wsync.engine.farm`): both trees are reached from the fds
it inherits, one component at a time with ``O_NOFOLLOW | O_DIRECTORY`` (a symlink swapped in
for a directory of DEST is never followed), and ``linkat`` links a symlink as itself.

Protocol: argv holds DEST's fd and the tmp tree's fd (inherited).  stdin holds one record
per entry, ``KIND PATH NUL`` (kind ``d`` for a directory, ``n`` for anything else; ``PATH``
relative, parents before children, as the scan listed them).  stdout gets ``S PATH NUL`` for
each entry skipped (gone from DEST since the scan, or below a directory that was), then
``K NUL`` when every record was handled, or ``E MESSAGE NUL`` when an error stopped it: the
parent then knows nothing of what the tree holds and farms afresh.  It stops by itself when
its parent is gone (a kill -9 of the pull): the next run removes the tree it was making.
"""

from __future__ import annotations

import errno
import os
import sys

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: errors of one entry that mean "DEST changed since the scan" (or a parent was skipped)
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
#: directory fds kept open per tree
_CACHE = 64


class _Dirs:
    """Directory fds of one tree by relative path, each opened from its parent's fd."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.fds: dict[bytes, int] = {}

    def get(self, path: bytes) -> int:
        if not path:
            return self.root_fd
        fd = self.fds.get(path)
        if fd is not None:
            return fd
        parent, _, leaf = path.rpartition(b"/")
        fd = os.open(leaf, _DIR, dir_fd=self.get(parent))
        if len(self.fds) >= _CACHE:
            for old in self.fds.values():
                os.close(old)
            self.fds.clear()
        self.fds[path] = fd
        return fd


def link_all(records: list[bytes], dest_fd: int, tmp_fd: int) -> list[bytes]:
    """Make each record's entry in the tmp tree; return the paths skipped.  OSError (other
    than an entry gone) stops it."""
    dest, tmp = _Dirs(dest_fd), _Dirs(tmp_fd)
    skipped: list[bytes] = []
    parent_pid = os.getppid()
    for n, record in enumerate(records):
        # every 64 entries (a system call of well under a microsecond): a pull killed
        # meanwhile leaves at most that many links for a rerun to find in its tree
        if n % 64 == 0 and os.getppid() != parent_pid:
            raise OSError(errno.ECHILD, "the pull that started it is gone", b"")
        kind, path = record[:1], record[1:]
        parent, _, leaf = path.rpartition(b"/")
        if not leaf or leaf in (b".", b".."):
            raise OSError(errno.EINVAL, "not a plain path", path)
        try:
            into = tmp.get(parent)
            if kind == b"d":
                os.mkdir(leaf, 0o700, dir_fd=into)
            else:
                os.link(
                    leaf, leaf, src_dir_fd=dest.get(parent), dst_dir_fd=into, follow_symlinks=False
                )
        except OSError as exc:
            if exc.errno not in _GONE:
                exc.filename = path
                raise
            skipped.append(path)
    return skipped


def main() -> int:
    dest_fd, tmp_fd = int(sys.argv[1]), int(sys.argv[2])
    records = sys.stdin.buffer.read().split(b"\0")[:-1]
    out = sys.stdout.buffer
    try:
        skipped = link_all(records, dest_fd, tmp_fd)
    except OSError as exc:
        shown = exc.filename if isinstance(exc.filename, bytes) else b""
        out.write(b"E" + shown + b": " + (exc.strerror or str(exc)).encode() + b"\0")
        return 0
    out.write(b"".join(b"S" + path + b"\0" for path in skipped) + b"K\0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
