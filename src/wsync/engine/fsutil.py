"""Durable and atomic host file operations.

Every durable file is written the way borg's ``SaveFile`` does it: write a
temporary file beside the target, fsync it, rename it over the target, fsync
the directory.  A crash at any point leaves the old file or the new one.  Any
OSError becomes :class:`~wsync.errors.HostIOError`: a failed write is a
failure, never a silent success.

DEST is replaced with ``renameat2(RENAME_EXCHANGE)`` where the kernel and libc
offer it (one atomic step: DEST is the old tree or the new one, never absent);
elsewhere with two renames, leaving a short window where DEST is absent but
never a mix of trees.  Both work on names relative to an open directory fd
(:mod:`wsync.engine.destdir` holds DEST's parent that way), so a symlink
swapped into the path after the checks cannot redirect them.

Trees are removed by :func:`remove_tree_at`, iteratively: ``shutil.rmtree``
recurses once per level and a guest's archive may be arbitrarily deep (a tree
of ~1,000 directories raised ``RecursionError`` and blocked DEST for good).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from wsync.errors import DestReplaced, HostIOError

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_libc: ctypes.CDLL | None
try:
    # the symbols already loaded into this process, libc's among them: no
    # find_library("c"), which runs ``ldconfig -p`` at every start
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - exotic libc
    _libc = None

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: directory fds a removal keeps open along its path; deeper ones are reopened
#: through ``..`` (and checked) on the way back up, so any depth fits in few fds
_WINDOW = 32


def overlaps(a: Path, b: Path) -> bool:
    """One of two paths is the other or lies inside it: a pull into one would replace or
    move the other (paths as given: resolve them first where symlinks may be on the way)."""
    return a.is_relative_to(b) or b.is_relative_to(a)


@contextlib.contextmanager
def host_io(what: str) -> Iterator[None]:
    """Translate OSError into HostIOError naming what was being done."""
    try:
        yield
    except OSError as exc:
        raise HostIOError(f"{what}: {exc.strerror or exc}") from exc


def free_bytes(where: str | Path | int, what: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``where`` (a path,
    or an open fd), for the free-space reserves (``--min-free``); HostIOError naming
    ``what`` when it cannot be read."""
    with host_io(what):
        st = os.fstatvfs(where) if isinstance(where, int) else os.statvfs(where)
    return st.f_bavail * st.f_frsize


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
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            # a full disk must not keep the part written (up to a whole chunk) either
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(path.parent)


def syncfs(path: Path | int) -> None:
    """Flush the whole filesystem holding ``path`` or the open fd ``path``
    (one call instead of an fsync per file)."""
    fd = path if isinstance(path, int) else os.open(path, _DIR_FLAGS)
    try:
        if _libc is not None and hasattr(_libc, "syncfs"):
            if _libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        else:  # pragma: no cover
            os.sync()
    finally:
        if fd is not path:
            os.close(fd)


class EarlyFlush:
    """Flush the filesystem of a tree being written, in the background, every
    ``interval`` seconds, so that the ``syncfs`` before the swap finds little left.

    Durability still comes from that last ``syncfs``: this only moves the disk's work
    earlier, beside the transfer (on a first pull of 250 MB the last flush took 0.6 s).
    The thread flushes through its own open of the directory, never a ``dup`` of the
    caller's fd: Linux reports a writeback error to each open file description once, so
    a flush here must not take the error that the last ``syncfs`` has to see.  Errors
    here are ignored for the same reason; ``stop`` does not wait for a flush in flight.
    """

    def __init__(self, dir_fd: int, interval: float = 0.5) -> None:
        self._fd = os.open(".", _DIR_FLAGS, dir_fd=dir_fd)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wsync-flush", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                with contextlib.suppress(OSError):
                    syncfs(self._fd)
        finally:
            os.close(self._fd)

    def stop(self) -> None:
        self._stop.set()


def _renameat2(dir_fd: int, a: str, b: str, flags: int) -> bool:
    """``renameat2`` within ``dir_fd``; False when the platform cannot (OSError otherwise)."""
    if _libc is None or not hasattr(_libc, "renameat2"):
        return False
    rc = _libc.renameat2(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def exchange_at(dir_fd: int, a: str, b: str) -> bool:
    """Atomically swap names ``a`` and ``b`` in ``dir_fd``; False when the platform cannot."""
    return _renameat2(dir_fd, a, b, _RENAME_EXCHANGE)


def swap_at(
    dir_fd: int,
    new: str,
    dest: str,
    shown: str,
    expect: tuple[int, int] | None,
    *,
    empty: bool = False,
) -> str | None:
    """Make directory ``new`` appear as ``dest`` (both names in ``dir_fd``) atomically.

    ``expect`` is DEST's ``(st_dev, st_ino)`` when the pull started, None when there was
    no DEST: the pull built its tree from that one (or from nothing), so another directory
    put at DEST meanwhile (another program, a pull into a directory beneath DEST through a
    parent it created) is never thrown away with the old tree: :class:`DestReplaced`,
    DEST left as it is.  Returns the name now holding the *old* tree (to be removed by
    the caller), or None when ``dest`` did not exist.  ``shown`` names DEST in errors.

    ``empty``: DEST was accepted only because it was empty (not a tree wsync wrote, and no
    ``--force``).  Another program that wrote into it meanwhile (a ``git clone`` into the
    directory just made) did so into the very inode ``expect`` names; the swap must not
    throw that away either: :class:`DestReplaced`, DEST left as it is.
    """
    changed = DestReplaced(
        f"DEST {shown} was replaced or created by another program during the pull; "
        "it was left as it is (move it away, or pass --force to replace it)"
    )
    with host_io(f"replacing {shown}"):
        try:
            st = os.stat(dest, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:  # none then, or removed since: nothing is lost
            try:
                if not _renameat2(dir_fd, new, dest, _RENAME_NOREPLACE):
                    os.rename(new, dest, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except FileExistsError:
                raise changed from None
            os.fsync(dir_fd)
            return None
        if (st.st_dev, st.st_ino) != expect or (empty and not _is_empty_at(dir_fd, dest)):
            raise changed
        if exchange_at(dir_fd, new, dest):
            st = os.stat(new, dir_fd=dir_fd, follow_symlinks=False)
            # replaced, or written into, between the check and the swap
            if (st.st_dev, st.st_ino) != expect or (empty and not _is_empty_at(dir_fd, new)):
                exchange_at(dir_fd, new, dest)
                raise changed
            os.fsync(dir_fd)
            return new
        old = f".{dest}.wsync-old"
        remove_tree_at(dir_fd, old, shown=f"{shown} (old tree {old})")
        os.rename(dest, old, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.rename(new, dest, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
        return old


def _is_empty_at(dir_fd: int, name: str) -> bool:
    """Whether directory ``name`` of ``dir_fd`` (never through a symlink) has no entry."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        with os.scandir(fd) as entries:
            return next(entries, None) is None
    finally:
        os.close(fd)


def make_private(fd: int) -> bool:
    """Make the directory open at ``fd`` 0700 if it is ours; False if it is not ours."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        return False
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return True


def rmtree(path: Path) -> None:
    """Remove ``path`` (a tree or a single entry) if it exists; see :func:`remove_tree_at`."""
    path = Path(os.path.abspath(path))
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise HostIOError(f"removing {path}: {exc.strerror or exc}") from exc
    try:
        remove_tree_at(parent, path.name, shown=str(path))
    finally:
        os.close(parent)


def mount_points() -> set[str]:
    """Mount points of this process's mount namespace (empty if /proc cannot say)."""
    points: set[str] = set()
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split(b" ")
            if len(fields) > 4:
                raw = fields[4]
                # mountinfo escapes space, tab, newline and backslash as \ooo
                text = raw.decode("unicode_escape").encode("latin-1")
                points.add(os.fsdecode(text))
    return points


def mount_id(fd: int) -> int | None:
    """The id of the mount that the open ``fd`` is on (``/proc/self/fdinfo``, Linux 3.15+),
    None where it cannot be read.  Why: a bind mount of a directory from the same
    filesystem keeps its ``st_dev``; its mount id differs.  One small read, where the mount
    table of a busy host (a Kubernetes node's thousand mounts) costs a millisecond."""
    try:
        info = os.open(f"/proc/self/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for line in os.read(info, 4096).splitlines():
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    finally:
        os.close(info)
    return None


def mount_below(dir_fd: int) -> bool:
    """Whether a mount point lies strictly below the directory open at ``dir_fd``.

    Why the mount table: a bind mount (of a file, or of a directory of the same
    filesystem) shows nothing in a walk's ``st_dev`` or directory entries.  A tree of ours
    that holds a mount was made so by someone else (wsync never mounts): what is below it
    is not ours to reuse or keep.  False where ``/proc`` cannot say."""
    try:
        top = os.readlink(f"/proc/self/fd/{dir_fd}").rstrip("/") + "/"
    except OSError:
        return False
    return any(point.startswith(top) for point in mount_points())


class _Frame:
    """One directory on the removal path: its fd (or -1), identity and subdirectories left."""

    __slots__ = ("dev", "fd", "ino", "name", "todo")

    def __init__(self, fd: int, name: str, st: os.stat_result) -> None:
        self.fd = fd
        self.name = name
        self.dev = st.st_dev
        self.ino = st.st_ino
        self.todo: list[str] = []


class _Remover:
    """The state of one :func:`remove_tree_at`: the path stack and the first failure."""

    def __init__(self, shown: str, parent_fd: int) -> None:
        self.shown = shown
        #: the filesystem and the mount of the directory holding the tree: a directory on
        #: another (a mount point, the top included) is never entered
        self.dev = os.fstat(parent_fd).st_dev
        self.mount = mount_id(parent_fd)
        self.stack: list[_Frame] = []
        self.failure: tuple[str, OSError] | None = None
        self.failures = 0

    def path(self, name: str = "") -> str:
        parts = [self.shown, *(f.name for f in self.stack[1:])]
        if name:
            parts.append(name)
        return "/".join(parts)

    def fail(self, name: str, exc: OSError) -> None:
        self.failures += 1
        if self.failure is None:
            self.failure = (self.path(name), exc)

    def enter(self, parent_fd: int, name: str) -> None:
        """Open directory ``name`` (never via a symlink), push it, unlink its non-directories."""
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                # not a directory (any more): a symlink or a file took its place
                self.unlink(parent_fd, name)
            elif exc.errno == errno.EACCES and _make_searchable(parent_fd, name):
                self.enter(parent_fd, name)
            elif exc.errno != errno.ENOENT:
                self.fail(name, exc)
            return
        try:
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            self.fail(name, exc)
            return
        if st.st_dev != self.dev or (self.mount is not None and mount_id(fd) != self.mount):
            # another filesystem, or a bind mount: what it holds is not this tree's (as
            # ``rm --one-file-system``); its rmdir fails and says so
            os.close(fd)
            self.fail(name, OSError(errno.EBUSY, "a mount point, not entered"))
            return
        frame = _Frame(fd, name, st)
        self.stack.append(frame)
        # bound the open fds: close the one that just fell out of the window
        out = len(self.stack) - _WINDOW - 1
        if out >= 0 and self.stack[out].fd >= 0:
            os.close(self.stack[out].fd)
            self.stack[out].fd = -1
        try:
            if st.st_mode & 0o700 != 0o700 and st.st_uid == os.geteuid():
                os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)  # read-only: make it removable
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    if is_dir:
                        frame.todo.append(entry.name)
                    else:
                        self.unlink(fd, entry.name)
        except OSError as exc:
            self.fail("", exc)  # the rmdir of this directory will fail and be counted too

    def unlink(self, dir_fd: int, name: str) -> None:
        """Unlink a non-directory in the top frame's directory (or the caller's)."""
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError as exc:
            # a directory appeared under this name since the listing
            if self.stack and self.stack[-1].fd == dir_fd:
                self.stack[-1].todo.append(name)
            else:
                self.fail(name, exc)
        except OSError as exc:
            self.fail(name, exc)

    def parent_fd(self, top_parent: int) -> int:
        """The fd of the directory holding the top frame, reopened through ``..`` if closed."""
        if len(self.stack) == 1:
            return top_parent
        parent = self.stack[-2]
        if parent.fd < 0:
            child = self.stack[-1]
            fd = os.open("..", _DIR_FLAGS, dir_fd=child.fd)
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (parent.dev, parent.ino):
                os.close(fd)
                raise OSError(errno.ESTALE, "the tree was moved while it was being removed")
            parent.fd = fd
        return parent.fd

    def close(self) -> None:
        for frame in self.stack:
            if frame.fd >= 0:
                os.close(frame.fd)
        self.stack.clear()


def _make_searchable(parent_fd: int, name: str) -> bool:
    """Give the owner rwx on directory ``name`` without following a symlink; True if done."""
    try:
        fd = os.open(
            name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent_fd
        )
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o700 == 0o700:
            return False
        # fchmod refuses O_PATH fds; the /proc link names exactly this inode
        os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(st.st_mode) | 0o700)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_tree_at(parent_fd: int, name: str, *, shown: str | None = None) -> None:
    """Remove entry ``name`` of the open directory ``parent_fd``, a whole tree if it is one.

    Iterative (any depth, a bounded number of open fds), never follows a
    symlink (links are unlinked, every directory is opened ``O_NOFOLLOW``
    relative to its parent), never enters a mount point (another filesystem, or a
    bind mount: :func:`mount_id`), the top included, makes read-only directories we
    own writable first.  Removes everything it can; then raises :class:`HostIOError`
    naming the first path it could not remove.  A missing ``name`` is fine.
    """
    shown = shown or name
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise HostIOError(f"removing {shown}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        with host_io(f"removing {shown}"), contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent_fd)
        return
    run = _Remover(shown, parent_fd)
    try:
        run.enter(parent_fd, name)
        _walk(run, parent_fd)
    except OSError as exc:
        run.fail("", exc)
    finally:
        run.close()
    if run.failure is not None:
        where, error = run.failure
        more = f" (and {run.failures - 1} more)" if run.failures > 1 else ""
        raise HostIOError(f"cannot remove {where}: {error.strerror or error}{more}")


def _walk(run: _Remover, top_parent: int) -> None:
    """Depth first over ``run.stack``: descend into the next subdirectory, or rmdir and go up."""
    stack = run.stack
    while stack:
        frame = stack[-1]
        if frame.fd < 0:  # pragma: no cover - the top frame is always open
            raise OSError(errno.EBADF, "lost a directory fd")
        if frame.todo:
            run.enter(frame.fd, frame.todo.pop())
            continue
        parent = run.parent_fd(top_parent)
        stack.pop()
        os.close(frame.fd)
        try:
            os.rmdir(frame.name, dir_fd=parent)
        except FileNotFoundError:
            pass
        except OSError as exc:
            run.fail(frame.name, exc)
