"""The confined, streaming tar extractor: the guest's archive can only write inside ``root``.

The guest is hostile (docs/design.md, guarantee 5), so nothing in the archive is trusted.  The
stream is parsed into members by our own reader (:mod:`wsync.engine.tarstream`, which says why
``tarfile``'s is not used); every member is judged and every file created here, not by
``tarfile``, whose extraction filters in this Python (3.11.7) predate their 2025 fixes.

Confinement
-----------
Links are data (docs/design.md, guarantee 10): a symlink's target is stored verbatim, wherever it
points (a Python venv's ``.venv/bin/python3 -> /usr/bin/python3``, ``../shared``), and nothing
here ever resolves one.  Confinement therefore rests on *how* every name is created, not on what
a link says.  Why that is sound:

1. ``root`` starts empty and is written only by this extractor, which never removes or renames
   anything; so every entry under it came from this archive and, once created, keeps its type.
2. A member's parent is reached from ``root``'s fd one component at a time with
   ``openat(O_NOFOLLOW | O_DIRECTORY)``, after empty and ``.`` components are dropped and names
   with a ``..`` component or a leading ``/`` are refused.  A component that is a symlink
   fails with ``ELOOP`` and one that is a file with ``ENOTDIR``, so the fd reached is a real
   directory inside ``root`` (by induction on the components).  A member under a symlinked
   directory is refused, whatever the link's target.  Cached fds (:class:`DirStack`) stay
   right by 1: a name that was a directory when opened still is.
3. The leaf is created in that directory with ``O_CREAT | O_EXCL | O_NOFOLLOW``, ``mkdirat``,
   ``symlinkat`` or ``linkat``, each of which fails with ``EEXIST`` on an existing name and
   never follows a symlink at the last component; so no byte is ever written through a link
   and a name reused as the same or another type is refused.
4. A hardlink's target is looked up the same confined way (2) and must be a regular file by
   ``lstat`` (``fstatat(AT_SYMLINK_NOFOLLOW)``), and ``linkat`` is called without
   ``AT_SYMLINK_FOLLOW``: a hardlink can only add a name for a file this archive already
   created inside ``root``, never for a symlink, a directory or anything outside.
5. Metadata never follows a link either: a file's mode and mtime are set on its open fd, a
   symlink's mtime with ``utimensat(AT_SYMLINK_NOFOLLOW)``, and the final directory pass
   reopens each directory by (2) with ``O_NOFOLLOW``.

A symlink is only refused when it cannot be stored at all: an empty target (Linux has no
such link), a NUL byte, or a target longer than the host takes.  What a symlink points to
matters only to whoever later *follows* it out of DEST, as it would in the guest.

Refused: absolute names, ``..`` components, empty names, NUL bytes, devices, FIFOs and every
other type (sparse, volume, multi-volume, dump-dir...), setuid anywhere, setgid and sticky on
non-directories (refused, never silently stripped; setgid and sticky on directories are kept),
and payloads on non-file members.  Malformed, truncated or trailing stream data is refused by
the reader.

Mtimes are kept for every date a member can carry: pre-1970 (negative, from GNU tar's base-256
or pax records) and after 2262, where nanoseconds no longer fit the 64-bit value that
``os.utime(ns=...)`` takes.  Such a time is set in whole seconds (the sub-second part is
dropped; it is kept exactly wherever nanoseconds fit).  No date is refused: a value beyond the
host's ``time_t`` is clamped to it, and the kernel clamps further to what the filesystem stores
(ext4: 1901-12-13 to 2446-05-10), silently, exactly as it does for GNU tar's extraction.

Limits stop bombs before the bytes land: the member count and the sum of declared file sizes
are checked from the header before anything is written, and free space on ``root``'s
filesystem (``fstatvfs``) is checked at start, before any file of 64 MiB or more, and after
every 64 MiB or 8192 members, so the filesystem cannot drop more than 64 MiB below
``min_free_bytes``.

Speed (one ``openat`` + ``write`` + ``futimens`` + ``close`` per small file, ``fchmod`` only when
the umask changed the mode): a large file's data is written straight from the reader's buffer;
a file of up to 1 MiB is read into memory and created by one of a few writer threads
(:mod:`wsync.engine.writers`: the kernel's create is most of a small file's cost), after the
same checks, in a directory fd reached the same way.
Directories are created 0o700 so read-only ones do not block their children; their final mode
and mtime are applied at the end in reverse creation order, which puts every directory after
all its descendants.  Nothing is fsynced: the caller syncs the filesystem before swapping
``root`` into place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import xxhash

from wsync.engine import tarstream
from wsync.engine.api import ExtractLimits, MiB, human_bytes
from wsync.engine.extractfs import (
    DIR_FLAGS,
    FILE_FLAGS,
    REFUSED,
    DirStack,
    abandon,
    check_link_target,
    clamp_time,
    create_file,
    finish_file,
    hash_at,
    refuse_os,
    replacement_name,
    set_times,
    split_name,
    umask,
)
from wsync.engine.fsutil import free_bytes
from wsync.engine.tarstream import TarReader, show_name
from wsync.engine.writers import Writers
from wsync.errors import (
    BYTES_KNOB,
    FILES_KNOB,
    DiskLow,
    HostileArchive,
    HostIOError,
    HostOutOfFiles,
    Interrupted,
    LimitExceeded,
    UnstableFiles,
    WsyncError,
)

__all__ = ["ExtractStats", "FileHook", "Written", "extract_tar_stream", "written"]

#: bytes of directory paths kept for the final metadata pass
_MAX_DIR_META = 512 * MiB
_SPACE_CHECK_BYTES = 64 * MiB
_SPACE_CHECK_MEMBERS = 8192
_CHUNK = 64 * MiB
#: files up to this size are read into memory and created by :mod:`wsync.engine.writers`
_SMALL = 1 * MiB

_REGULAR = frozenset((tarstream.REGTYPE, tarstream.AREGTYPE, tarstream.CONTTYPE))
#: the other types created: directories, symlinks, hardlinks (refused with a payload)
_CREATED = frozenset((tarstream.DIRTYPE, tarstream.SYMTYPE, tarstream.LNKTYPE))
_KNOWN_BAD = {
    tarstream.CHRTYPE: REFUSED["c"],
    tarstream.BLKTYPE: REFUSED["b"],
    tarstream.FIFOTYPE: REFUSED["p"],
    tarstream.GNUTYPE_SPARSE: "GNU sparse file",
}


@dataclasses.dataclass
class ExtractStats:
    """What one extraction created.  ``bytes`` counts regular-file payload bytes written."""

    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    bytes: int = 0


def extract_tar_stream(
    stream: BinaryIO,
    root: Path | int,
    limits: ExtractLimits,
    *,
    check_cancel: Callable[[], None] | None = None,
    stats: ExtractStats | None = None,
    replace: bool = False,
    on_file: FileHook | None = None,
) -> ExtractStats:
    """Extract the uncompressed tar ``stream`` into the empty directory ``root``, confined.

    ``replace`` (incremental pulls): ``root`` is not empty but holds a hardlink farm of
    DEST's unchanged entries, whose files share their inodes with the live DEST.  Every
    non-directory member is then written under a fresh name and renamed over the name
    (never opened for writing, chmod'ed or utime'd in place), like a member of a later
    archive; an existing directory takes the member's mode and mtime.  Confinement holds
    as before: the farm's directories are real directories created fresh, its links are
    never followed (``O_NOFOLLOW`` walk, ``rename`` replaces the link itself).

    ``on_file(path, xxh3_128_hex, written)`` hears every regular file (and hardlink)
    written, with the hash of the bytes as written and the (inode, mode, size, mtime) they
    have then: the incremental state records the hash, where DEST still holds that file.

    ``root`` is a path or an already-open directory fd (which stays open; the pull passes
    one so that nothing is resolved by path after its checks).  Raises
    :class:`HostileArchive` (or :class:`LimitExceeded`) on anything refused,
    :class:`HostIOError` when the host cannot write, and whatever ``check_cancel`` raises.  On
    error ``root`` holds a partial tree that the caller discards.

    ``stats``, when given, is counted into as members are created (and returned), so
    that another thread can show the counts while the extraction runs: this thread is
    the only writer, and a reader sees each int whole, at worst a moment stale.
    """
    try:
        if isinstance(root, int):
            root_fd = os.open(".", DIR_FLAGS, dir_fd=root)
        else:
            root_fd = os.open(root, DIR_FLAGS)
    except OSError as exc:
        raise HostIOError(f"cannot open extraction root {str(root)!r}: {exc.strerror}") from exc
    try:
        if not replace:
            with os.scandir(root_fd) as entries:
                if next(entries, None) is not None:
                    raise HostIOError(f"extraction root {str(root)!r} is not empty")
        extractor = _Extractor(stream, root_fd, limits, check_cancel, stats)
        extractor.replace = replace
        extractor.on_file = on_file
        return extractor.run()
    finally:
        os.close(root_fd)


#: what the filesystem holds of a file once written: (inode, permission bits, size, mtime_ns)
Written = tuple[int, int, int, int]
#: hears (path, xxh3_128 hex, what was written) of every regular file written
FileHook = Callable[[bytes, str, Written], None]


def written(st: os.stat_result) -> Written:
    """A file's :data:`Written` from its ``stat``."""
    return st.st_ino, stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns


class _Extractor:
    """One extraction: the member loop, the creators, the limits and the final pass."""

    def __init__(
        self,
        stream: BinaryIO,
        root_fd: int,
        limits: ExtractLimits,
        check_cancel: Callable[[], None] | None,
        stats: ExtractStats | None = None,
    ) -> None:
        self.reader = TarReader(stream, self._count)
        self.root_fd = root_fd
        self.dirs = DirStack(root_fd)
        self.limits = limits
        self.check_cancel = check_cancel
        self.stats = stats if stats is not None else ExtractStats()
        self.members = 0
        self.umask = umask()
        self.atime_ns = time.time_ns()
        #: (path, mode, mtime_ns) of every directory, in creation order
        self.dir_meta: list[tuple[bytes, int, int]] = []
        self.dir_meta_bytes = 0
        self.root_meta: tuple[int, int] | None = None
        #: (mode, mtime_ns) of directories that a later archive of the stream named again
        self.dir_updates: dict[bytes, tuple[int, int]] = {}
        self.unchecked_bytes = 0
        self.unchecked_members = 0
        #: write every entry under a fresh name and rename it over (see extract_tar_stream)
        self.replace = False
        self.on_file: FileHook | None = None
        #: small files' creators (see _small_file)
        self.writers = Writers()

    def _fresh(self) -> bool:
        """Whether a non-directory is written under a fresh name and renamed over."""
        return self.replace or self.reader.archive > 0

    def run(self) -> ExtractStats:
        try:
            self._check_space(0)
            while self._member():
                pass
            self.writers.drain()  # a create changes its directory's mtime
            self._finish_dirs()
            return self.stats
        except WsyncError as exc:
            if not isinstance(exc, Interrupted) and not self.writers.failed:
                # a pending job is an earlier member: its error is the first (a full disk
                # must not be reported as the hostile member that came after it); after a
                # job's own error, what is pending came later
                self.writers.drain()
            raise
        finally:
            self.writers.close()
            self.dirs.close()
            self.reader.close()

    # -- limits -------------------------------------------------------------------------------

    def _check_space(self, upcoming: int) -> None:
        free = free_bytes(self.root_fd, "statvfs of the extraction root")
        if free - upcoming < self.limits.min_free_bytes:
            raise DiskLow(
                f"DEST's filesystem would drop below its {human_bytes(self.limits.min_free_bytes)}"
                f" free-space reserve ({human_bytes(free)} free,"
                f" {human_bytes(upcoming)} about to be written)"
            )
        self.unchecked_bytes = 0
        self.unchecked_members = 0

    # -- the member loop ----------------------------------------------------------------------

    def _member(self) -> bool:
        """Read and create one member; False after the end-of-archive marker."""
        if self.check_cancel is not None:
            self.check_cancel()
        member = self.reader.next_member()
        if member is None:
            return False
        kind, name, link, mode, size, mtime_ns = member
        self._count(name)
        if kind == tarstream.LNKTYPE or self._fresh():
            # a hardlink's target, or a name a later archive replaces, may be pending
            self.writers.drain()
        mtime_ns = clamp_time(mtime_ns)
        mode &= 0o7777
        if kind in _REGULAR:
            self._file(name, mode, size, mtime_ns)
            return True
        if kind not in _CREATED:
            what = _KNOWN_BAD.get(kind, f"unsupported member type {kind!r}")
            raise HostileArchive(f"{show_name(name)}: {what}")
        if size:
            raise HostileArchive(f"{show_name(name)}: unexpected payload on a non-file member")
        if kind == tarstream.DIRTYPE:
            self._dir(name, mode, mtime_ns)
        elif kind == tarstream.SYMTYPE:
            self._symlink(name, link, mtime_ns)
        else:
            self._hardlink(name, link)
        return True

    def _count(self, name: bytes) -> None:
        self.members += 1
        if self.members > self.limits.max_files:
            raise LimitExceeded(
                f"{show_name(name)}: more than {self.limits.max_files} members ({FILES_KNOB})"
            )
        self.unchecked_members += 1
        if self.unchecked_members >= _SPACE_CHECK_MEMBERS:
            self._check_space(0)

    # -- creators -----------------------------------------------------------------------------

    def _parent(self, parts: list[bytes], name: bytes) -> int:
        if len(parts) == 1:
            return self.root_fd
        try:
            return self.dirs.fd_for(parts[:-1])
        except FileNotFoundError:
            # a component may be a file a writer has not created yet: once it has, the
            # walk fails as it always did (ENOTDIR: "crosses a non-directory")
            self.writers.drain()
            try:
                return self.dirs.fd_for(parts[:-1])
            except OSError as exc:
                raise refuse_os(exc, show_name(name)) from exc
        except OSError as exc:
            raise refuse_os(exc, show_name(name)) from exc

    def _file(self, name: bytes, mode: int, size: int, mtime_ns: int) -> None:
        parts = split_name(name, is_dir=False)
        if mode & 0o7000:
            raise HostileArchive(f"{show_name(name)}: {REFUSED['f']}")
        if size < 0:
            raise HostileArchive(f"{show_name(name)}: negative size")
        if self.stats.bytes + size > self.limits.max_bytes:
            limit = self.limits.max_bytes
            raise LimitExceeded(
                f"{show_name(name)}: more than {limit} bytes of files ({BYTES_KNOB})"
            )
        self.unchecked_bytes += size
        if self.unchecked_bytes >= _SPACE_CHECK_BYTES:
            self._check_space(size)
        parent = self._parent(parts, name)
        if size <= _SMALL and not self._fresh():
            self._small_file(parent, parts, name, mode, size, mtime_ns)
            return
        leaf = replacement_name() if self._fresh() else parts[-1]
        try:
            fd = os.open(leaf, FILE_FLAGS, mode, dir_fd=parent)
        except OSError as exc:
            raise refuse_os(exc, show_name(name)) from exc
        digest = xxhash.xxh3_128() if self.on_file is not None else None
        try:
            remaining = size
            while remaining:
                step = min(remaining, _CHUNK)
                self.reader.copy_to(fd, step, name, digest)
                remaining -= step
                if remaining:
                    if self.check_cancel is not None:
                        self.check_cancel()
                    self._check_space(remaining)
            self.reader.skip_padding(size)
        except BaseException as exc:
            abandon(fd, name, exc)
        chmod = self.umask is None or bool(mode & self.umask)
        st = finish_file(fd, name, mode, chmod, self.atime_ns, mtime_ns, digest is not None)
        self.stats.bytes += size
        if leaf is parts[-1] or not self._replace(parent, leaf, parts[-1], name):
            self.stats.files += 1
        if self.on_file is not None and digest is not None and st is not None:
            self.on_file(b"/".join(parts), digest.hexdigest(), written(st))

    def _small_file(
        self, parent: int, parts: list[bytes], name: bytes, mode: int, size: int, mtime_ns: int
    ) -> None:
        """Read a small file's bytes and have a writer thread create it (see
        :mod:`wsync.engine.writers`): in a dup of its directory's fd, which the window of
        fds may close meanwhile, with the same flags, mode and times as :meth:`_file`."""
        data = self.reader.read(size, "a file", short_ok=True)
        if len(data) != size:
            raise HostileArchive(f"truncated archive: stream ends inside {show_name(name)}")
        self.reader.skip_padding(size)
        hook = self.on_file
        path = b"/".join(parts)
        digest = xxhash.xxh3_128(data).hexdigest() if hook is not None else ""
        chmod = self.umask is None or bool(mode & self.umask)
        try:
            dir_fd = os.dup(parent)
        except OSError as exc:
            kind = HostOutOfFiles if exc.errno in (errno.EMFILE, errno.ENFILE) else HostIOError
            raise kind(f"{show_name(name)}: {exc.strerror or exc}") from exc
        leaf, atime_ns = parts[-1], self.atime_ns

        def create() -> os.stat_result | None:
            try:
                return create_file(
                    dir_fd, leaf, name, mode, data, chmod, atime_ns, mtime_ns, hook is not None
                )
            finally:
                os.close(dir_fd)

        def created(st: os.stat_result | None) -> None:
            if hook is not None and st is not None:
                hook(path, digest, written(st))

        self.writers.submit(create, size, created, functools.partial(os.close, dir_fd))
        self.stats.bytes += size
        self.stats.files += 1

    def _dir(self, name: bytes, mode: int, mtime_ns: int) -> None:
        parts = split_name(name, is_dir=True)
        if mode & 0o4000:
            raise HostileArchive(f"{show_name(name)}: {REFUSED['d']}")
        if not parts:
            if self.root_meta is not None and not self._fresh():
                raise HostileArchive(f"{show_name(name)}: the root directory appears twice")
            self.root_meta = (mode, mtime_ns)
            return
        parent = self._parent(parts, name)
        try:
            os.mkdir(parts[-1], 0o700, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.EEXIST and self._fresh():
                if self._is_dir(parent, parts):
                    # read again: the newer mode and mtime win in the final pass
                    self.dir_updates[b"/".join(parts)] = (mode, mtime_ns)
                    return
                # a non-directory read first (or kept by the farm), a directory when read
                # again: what ``rm f && mkdir f`` during the read gives (the reverse of
                # :meth:`_replace`'s case); the snapshot is discarded, the next run reads
                # it afresh
                raise UnstableFiles(
                    f"{show_name(name)} (a non-directory, then a directory); run the pull again"
                ) from exc
            raise refuse_os(exc, show_name(name)) from exc
        path = b"/".join(parts)
        self.dir_meta_bytes += len(path) + 64
        if self.dir_meta_bytes > _MAX_DIR_META:
            raise LimitExceeded(f"{show_name(name)}: directory names exceed {_MAX_DIR_META} bytes")
        self.dir_meta.append((path, mode, mtime_ns))
        self.stats.dirs += 1

    def _symlink(self, name: bytes, target: bytes, mtime_ns: int) -> None:
        parts = split_name(name, is_dir=False)
        check_link_target(name, target)
        parent = self._parent(parts, name)
        leaf = replacement_name() if self._fresh() else parts[-1]
        try:
            os.symlink(target, leaf, dir_fd=parent)
        except OSError as exc:
            raise refuse_os(exc, show_name(name)) from exc
        try:
            set_times(leaf, self.atime_ns, mtime_ns, dir_fd=parent, follow_symlinks=False)
        except OSError as exc:
            raise HostIOError(f"{show_name(name)}: {exc.strerror or exc}") from exc
        if leaf is parts[-1] or not self._replace(parent, leaf, parts[-1], name):
            self.stats.symlinks += 1

    def _hardlink(self, name: bytes, target: bytes) -> None:
        parts = split_name(name, is_dir=False)
        shown = f"{show_name(name)}: hardlink target {show_name(target)}"
        try:
            tparts = split_name(target, is_dir=False)
        except HostileArchive as exc:
            raise HostileArchive(f"{shown} is refused ({exc.args[0]})") from exc
        try:
            tparent = os.dup(self.dirs.fd_for(tparts[:-1]))
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.ENAMETOOLONG):
                raise HostileArchive(f"{shown} is not an earlier regular file") from exc
            raise HostIOError(f"{shown}: {exc.strerror or exc}") from exc
        try:
            try:
                st = os.stat(tparts[-1], dir_fd=tparent, follow_symlinks=False)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG):
                    raise HostileArchive(f"{shown} is not an earlier regular file") from exc
                raise HostIOError(f"{shown}: {exc.strerror or exc}") from exc
            if not stat.S_ISREG(st.st_mode):
                raise HostileArchive(f"{shown} is not an earlier regular file")
            parent = self._parent(parts, name)
            leaf = replacement_name() if self._fresh() else parts[-1]
            try:
                os.link(
                    tparts[-1],
                    leaf,
                    src_dir_fd=tparent,
                    dst_dir_fd=parent,
                    follow_symlinks=False,
                )
            except OSError as exc:
                raise refuse_os(exc, show_name(name)) from exc
            if leaf is parts[-1] or not self._replace(parent, leaf, parts[-1], name):
                self.stats.hardlinks += 1
            if self.on_file is not None:  # what was written is the linked inode's
                self.on_file(b"/".join(parts), hash_at(tparent, tparts[-1], shown), written(st))
        finally:
            os.close(tparent)

    # -- later archives: files read again -----------------------------------------------------

    def _replace(self, parent: int, new: bytes, leaf: bytes, name: bytes) -> bool:
        """Move ``new`` over ``leaf`` (a later archive read the file again); True if it
        replaced an entry.  ``rename`` never follows a symlink at the destination and never
        replaces a directory with a non-directory, so this stays inside the tree."""
        try:
            os.stat(leaf, dir_fd=parent, follow_symlinks=False)
            existed = True
        except FileNotFoundError:
            existed = False
        except OSError as exc:
            raise HostIOError(f"{show_name(name)}: {exc.strerror or exc}") from exc
        try:
            os.rename(new, leaf, src_dir_fd=parent, dst_dir_fd=parent)
            # where ``leaf`` already was this very inode (a hardlink of the file read
            # again), rename(2) does nothing and succeeds: the fresh name must still go
            with contextlib.suppress(FileNotFoundError):
                os.unlink(new, dir_fd=parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(new, dir_fd=parent)
            if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                # a directory read first, a non-directory when read again (or when the
                # changed entries were archived): what ``rm -rf d && touch d`` during the
                # read gives; the snapshot is discarded, and the next run reads it afresh
                raise UnstableFiles(
                    f"{show_name(name)} (a directory, then a non-directory); run the pull again"
                ) from exc
            raise HostIOError(f"{show_name(name)}: {exc.strerror or exc}") from exc
        return existed

    def _is_dir(self, parent: int, parts: list[bytes]) -> bool:
        try:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode)

    # -- the final pass -----------------------------------------------------------------------

    def _finish_dirs(self) -> None:
        """Apply directory modes and mtimes, descendants before ancestors, then the root's."""
        dirs = self.dirs
        updates = self.dir_updates
        for count, (path, mode, mtime_ns) in enumerate(reversed(self.dir_meta)):
            if self.check_cancel is not None and count % 1024 == 1023:
                self.check_cancel()
            if updates:
                mode, mtime_ns = updates.get(path, (mode, mtime_ns))
            parts = path.split(b"/")
            try:
                parent = dirs.fd_for(parts[:-1])
                fd = os.open(parts[-1], DIR_FLAGS, dir_fd=parent)
                try:
                    os.fchmod(fd, mode)
                    set_times(fd, self.atime_ns, mtime_ns)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise HostIOError(f"{show_name(path)}: {exc.strerror or exc}") from exc
        self.dir_meta.clear()
        dirs.close()
        if self.root_meta is not None:
            mode, mtime_ns = self.root_meta
            try:
                os.fchmod(self.root_fd, mode)
                set_times(self.root_fd, self.atime_ns, mtime_ns)
            except OSError as exc:
                raise HostIOError(f"extraction root: {exc.strerror or exc}") from exc
