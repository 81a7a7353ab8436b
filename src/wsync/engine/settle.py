"""Files that changed while the guest read them (docs/design.md, guarantee 8).

A file written while ``tar`` reads it arrives torn: GNU tar pads a shrunk file with zeros and
reads a rewritten one half old, half new, and only warns (exit 1).  So the producer marks the
time before each read and asks ``find`` afterwards which entries changed since the mark; GNU
tar reads those again (up to three more rounds) and appends the archives to the same stream,
which the extractor applies over the earlier ones.  What still changed in the last round is
listed in the snapshot's ``unstable`` file, what vanished after a first read in ``gone``.

This module reads both lists back (with the same verified reads as the stream) and applies
them: unstable files fail the pull with exit 24 unless ``--best-effort``; vanished files are
removed from the new tree, because the version of them that it holds may be torn and the
guest no longer has any.
"""

from __future__ import annotations

import errno
import os
import stat

from wsync.engine.api import MiB
from wsync.engine.beneath import open_beneath
from wsync.engine.fsutil import remove_tree_at
from wsync.engine.guest import GuestSession
from wsync.engine.itemize import escape
from wsync.engine.tarstream import show_name
from wsync.engine.winddown import in_thread
from wsync.errors import HostIOError, StagingFailed, UnstableFiles
from wsync.protocol.policy import ReadSizer
from wsync.protocol.records import DoneRecord, parse_name_list

#: largest list read back (a list this long means the workspace is being rewritten wholesale)
MAX_LIST = 64 * MiB


async def read_list(session: GuestSession, file: str, size: int, sizer: ReadSizer) -> list[bytes]:
    """One of the producer's name lists, every byte verified."""
    if size > MAX_LIST:
        raise StagingFailed(f"the guest's {file} list is {size} bytes (more than {MAX_LIST})")
    data = bytearray()
    while len(data) < size:
        data += await session.read(file, len(data), size - len(data), sizer)
    # once each, whatever the guest wrote (a list is names, not a count)
    return list(dict.fromkeys(parse_name_list(bytes(data))))


async def apply_lists(
    session: GuestSession,
    done: DoneRecord | None,
    sizer: ReadSizer,
    root_fd: int,
    best_effort: bool,
    warnings: list[str],
) -> list[str]:
    """Apply the producer's lists to the new tree open at ``root_fd``; return the
    unstable files taken anyway (``best_effort``), shown for ``--json``."""
    assert done is not None
    taken: list[str] = []
    if done.unstable_bytes:
        names = await read_list(session, "unstable", done.unstable_bytes, sizer)
        if not best_effort:
            raise UnstableFiles(describe(names) or "(names not given)")
        # whole paths for scripts, as a dry run's lines print them (not quoted or cut)
        taken = [escape(name.removeprefix(b"./")) for name in names]
        warnings.append(f"taken as last read although they kept changing: {describe(names)}")
    if done.gone_bytes:
        names = await read_list(session, "gone", done.gone_bytes, sizer)
        own = os.dup(root_fd)  # the thread's: a cancelled wait must not close it under it

        def remove() -> int:
            try:
                return remove_gone(own, names)
            finally:
                os.close(own)

        removed = await in_thread(remove)
        if removed:
            warnings.append(f"vanished while read, so not in DEST: {describe(names)}")
    return taken


def describe(names: list[bytes], limit: int = 5) -> str:
    """``'a', 'b' and 3 more`` for a one-line message."""
    shown = ", ".join(show_name(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def remove_gone(root_fd: int, names: list[bytes]) -> int:
    """Remove ``names`` from the tree open at ``root_fd``; return how many were there.

    Parents are opened one component at a time without following symlinks, so a name can
    only ever reach an entry inside the tree; names that are not there are skipped.
    Directories go with :func:`~wsync.engine.fsutil.remove_tree_at` (iterative, no-follow).
    """
    removed = 0
    for name in names:
        parts = [p for p in name.split(b"/") if p and p != b"."]
        if not parts or b".." in parts:
            continue
        try:
            parent = open_beneath(root_fd, tuple(os.fsdecode(p) for p in parts[:-1]))
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                continue
            raise HostIOError(f"{show_name(name)}: {exc.strerror or exc}") from exc
        leaf = os.fsdecode(parts[-1])
        try:
            os.stat(leaf, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise HostIOError(f"{show_name(name)}: {exc.strerror or exc}") from exc
        else:
            _remove_keeping_parent(parent, leaf, name)
            removed += 1
        finally:
            os.close(parent)
    return removed


def _remove_keeping_parent(parent: int, leaf: str, name: bytes) -> None:
    """Remove ``leaf``; the parent keeps the mode and mtime the archive gave it.

    The extractor has already applied the final directory modes, so a read-only parent
    is made writable for the removal, and the removal's new mtime is put back.
    """
    try:
        st = os.fstat(parent)
        if st.st_mode & 0o300 != 0o300:
            os.fchmod(parent, st.st_mode | 0o300)
        try:
            remove_tree_at(parent, leaf, shown=show_name(name))
        finally:
            os.fchmod(parent, stat.S_IMODE(st.st_mode))
            os.utime(parent, ns=(st.st_atime_ns, st.st_mtime_ns))
    except OSError as exc:
        raise HostIOError(f"{show_name(name)}: {exc.strerror or exc}") from exc
