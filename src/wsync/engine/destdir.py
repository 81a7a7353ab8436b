"""DEST's parent directory, held open: every write of a pull goes through one fd.

Checking a path and then writing to it by name is a race: a symlink swapped
into DEST's parent path between the check and the write sends the tree
wherever it points (issue 7, item 2: a daemon job wrote outside its
``dest_roots``).  So a pull opens DEST's parent once, at its start, and from
then on names only entries *of that directory*: the temporary tree is created
with ``mkdirat``, extracted into by fd, flushed with ``syncfs`` on its fd,
swapped with ``renameat2`` relative to the parent fd, and the old tree is
removed through it.

With a *dest root* (the daemon's confinement) the parent is reached from the
root without following any symlink: one ``openat2(RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS)`` where the kernel has it, else a walk of
``O_NOFOLLOW | O_DIRECTORY`` opens, one component at a time.  Just before the
tmp tree is created and again before the swap, the walk is repeated and must
reach the same directory, so a parent renamed away during the pull is refused
too.  Without a root (the CLI, where the user names DEST) the resolved parent
is opened once.

The same object holds the DEST lock: ``flock`` on ``.NAME.wsync-lock`` beside
DEST, for the whole pull, so two pulls of different sandboxes into one DEST
cannot both succeed (item 13); holding it also makes every left-over
``.NAME.wsync-tmp-*`` stale, so those are removed.  A pull replaces DEST's whole tree,
so it also excludes pulls *beneath* DEST and above it: it holds an exclusive ``flock``
on DEST's directory and a shared one on each directory above it that is a DEST wsync
wrote (the inodes, not names), and stops where a directory above it has its DEST lock
held (a pull into it, which may not be a DEST yet).  A pull into ``D/sub`` while
another replaces ``D`` would otherwise swap its tree into the ``D`` that is about to be
thrown away, and say it succeeded.  DEST on a mount point is refused at the start: the
swap renames, and a mount point cannot be renamed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog

from wsync.engine import fsutil
from wsync.engine.beneath import open_beneath
from wsync.engine.fsutil import host_io, remove_tree_at, swap_at
from wsync.errors import Busy, HostIOError, UsageError, WsyncError

log = structlog.get_logger("wsync.destdir")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_LOCK_TRIES = 16
#: a file name's longest (Linux filesystems' NAME_MAX), and what a tree beside DEST NAME
#: adds to it: ``.NAME.wsync-tmp-`` and 12 hex digits (the longest of wsync's names there)
NAME_MAX = 255
TMP_INFIX = ".wsync-tmp-"
TMP_HEX = 12
#: the names wsync gives entries beside a DEST NAME (lock, kept tree, tmp and old trees)
_RESERVED = re.compile(r"\..+\.wsync-(lock|prev|old|tmp-.*)", re.DOTALL)


def refuse_reserved(dest: Path) -> None:
    """UsageError when a component of ``dest`` is a name wsync gives an entry beside a
    DEST: a pull into ".X.wsync-lock" would leave a directory where the pulls of X take
    their lock (they would fail for good); a tree in ".X.wsync-prev" (or below it: a
    daemon's confinement creates missing parents) is X's next pull's to take over or
    remove.  The daemon checks a requested DEST with it before it creates anything."""
    if any(_RESERVED.fullmatch(part) for part in dest.parts):
        raise UsageError(
            f"DEST {dest}: names like .NAME.wsync-lock, -prev, -old and -tmp-* are "
            "wsync's own, beside a DEST; choose another name"
        )


def _name_fits(name: str, parent_fd: int | None = None) -> None:
    """UsageError when the tree wsync builds beside DEST NAME (``.NAME.wsync-tmp-`` and
    12 hex digits) cannot have its name: a name may have NAME_MAX bytes, or what the
    filesystem of ``parent_fd`` says (eCryptfs: 143).  Found late, this failed the pull
    once its work was done, creating that tree.  ``parent_fd`` is closed on refusal."""
    size, extra = len(os.fsencode(name)), len(".") + len(TMP_INFIX) + TMP_HEX
    most = NAME_MAX
    if parent_fd is not None:
        with contextlib.suppress(OSError, ValueError):
            said = os.fpathconf(parent_fd, "PC_NAME_MAX")
            if extra < said < most:  # (a FUSE filesystem may say 0 or -1: not believed)
                most = said
    if size + extra > most:
        if parent_fd is not None:
            os.close(parent_fd)
        raise UsageError(
            f"DEST's name is {size} bytes: wsync builds the new tree beside it as "
            f".NAME{TMP_INFIX}..., {extra} bytes more, and a name there may have {most}; "
            f"choose a DEST name of at most {most - extra} bytes"
        )


class DestDir:
    """An open fd on DEST's parent, the DEST lock, and the writes made through them."""

    def __init__(self, path: Path, parent_fd: int, root: Path | None, rel: tuple[str, ...]):
        #: DEST as an absolute path whose parent part holds no symlink (as opened)
        self.path = path
        self.name = path.name
        self.parent_fd = parent_fd
        self.root = root
        self._rel = rel
        self._lock_fd: int | None = None
        #: the tree locks (DEST's directory, its ancestors): see the module docstring
        self._tree_fds: list[int] = []
        #: DEST's ``(st_dev, st_ino)`` when it was locked (None: no DEST then); the swap
        #: replaces only that directory
        self.found: tuple[int, int] | None = None
        #: DEST was accepted only because it was empty (no DEST of wsync's, no ``--force``):
        #: the swap replaces it only while it still is (:func:`~wsync.engine.fsutil.swap_at`)
        self.empty = False
        self._tmp_fd: int | None = None

    # -- opening ----------------------------------------------------------------------

    @classmethod
    def open(cls, dest: Path, root: Path | None = None) -> DestDir:
        """Open DEST's parent (beneath ``root`` without symlinks when given); UsageError if not."""
        dest = Path(os.path.abspath(dest))
        if dest == dest.parent:
            raise UsageError("DEST cannot be the filesystem root")
        refuse_reserved(dest)
        _name_fits(dest.name)
        if root is None:
            with _refusing(dest, None, dest.parent):
                fd = os.open(dest.parent, _DIR_FLAGS)
            _name_fits(dest.name, fd)
            return cls(Path(os.path.realpath(dest.parent)) / dest.name, fd, None, ())
        real_root = Path(os.path.realpath(root))
        rel: tuple[str, ...] | None = None
        for base in (real_root, Path(os.path.abspath(root))):
            if dest.is_relative_to(base) and dest != base:
                rel = dest.relative_to(base).parts
                break
        if rel is None:
            raise UsageError(f"DEST {dest} is not beneath the dest root {root}")
        with _refusing(dest, root, real_root):
            root_fd = os.open(real_root, _DIR_FLAGS)
        try:
            with _refusing(dest, root, real_root):
                fd = open_beneath(root_fd, rel[:-1])
        finally:
            os.close(root_fd)
        _name_fits(dest.name, fd)
        return cls(real_root.joinpath(*rel), fd, real_root, rel[:-1])

    def verify(self) -> None:
        """With a root: the walk from it must still reach the directory we hold."""
        if self.root is None:
            return
        try:
            root_fd = os.open(self.root, _DIR_FLAGS)
            try:
                fd = open_beneath(root_fd, self._rel)
            finally:
                os.close(root_fd)
            try:
                now, held = os.fstat(fd), os.fstat(self.parent_fd)
            finally:
                os.close(fd)
            same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
            why = "it is another directory now"
        except OSError as exc:
            same, why = False, exc.strerror or str(exc)
        if not same:
            raise UsageError(
                f"the parent of DEST {self.path} was replaced during the pull ({why}: "
                f"renamed, or a symlink put in its path); refusing to write outside {self.root}"
            )

    # -- the DEST lock --------------------------------------------------------------------

    @property
    def lock_name(self) -> str:
        return lock_name(self.name)

    def lock(self, is_dest: Callable[[Path], bool] = lambda path: False) -> None:
        """Hold the DEST lock until :meth:`close`; UsageError naming the holder if taken.
        ``is_dest`` says which directories above DEST are DESTs (:meth:`_lock_tree`)."""
        name = self.lock_name
        for _ in range(_LOCK_TRIES):
            with host_io(f"locking DEST {self.path}"):
                fd = self._open_lock(name)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                who = f" (pid {holder})" if holder else ""
                raise Busy(
                    f"DEST {self.path} is being written by another wsync pull{who}; "
                    "wait for it to finish or choose another DEST"
                ) from None
            except OSError as exc:
                os.close(fd)
                raise HostIOError(f"locking DEST {self.path}: {exc.strerror or exc}") from exc
            # the holder before us unlinks the name on release: a lock taken on
            # an unlinked inode locks nothing, so take the one the name holds now
            if self._names_fd(name, fd):
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._lock_fd = fd
                self._lock_tree(is_dest)
                return
            os.close(fd)
        raise HostIOError(f"could not take the lock {name} beside DEST {self.path}")

    def fs_now(self) -> int | None:
        """A ctime that DEST's filesystem stamps now, by its own clock and to its own
        precision (a file server's clock, a filesystem of whole seconds): a directory's,
        made beside DEST and removed again.  That needs only the write access the swap
        needs (a chmod of the lock file fails where another user's killed pull left it in
        a shared directory, and moves no ctime where a filesystem ignores modes); a
        left-over has a stale tmp name, removed by the next pull.  None without the lock,
        or where it cannot be had (then no window: re-hashes, never a missed change)."""
        if self._lock_fd is None:
            return None
        return fs_stamp(self.parent_fd, self.name)

    def _lock_tree(self, is_dest: Callable[[Path], bool]) -> None:
        """DEST's directory exclusively, and shared each directory above it that is a DEST
        wsync wrote (``is_dest``: the registry of this pull's state directory): see the
        module docstring.

        Only those: ``flock`` on a directory needs nothing but read access, so a shared
        lock on every ancestor let any local user stop every pull by holding ``/``
        exclusively (a reviewer did, and a test run failed with "lies in /").  A
        directory that is no registered DEST cannot be replaced by a pull without
        ``--force``; a pull that would replace one created meanwhile is stopped at its
        swap (:func:`wsync.engine.fsutil.swap_at`).  Where a lock cannot be taken for
        another reason than a holder (a filesystem without ``flock`` on directories), it
        is skipped: the name lock beside DEST still holds."""
        try:
            fd = os.open(self.name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.parent_fd)
        except OSError:
            fd = -1  # no DEST yet (or not a directory, refused later): nothing beneath it
        if fd >= 0:
            self._tree_fds.append(fd)
            st = os.fstat(fd)
            self.found = (st.st_dev, st.st_ino)
            if not self._flock(fd, fcntl.LOCK_EX):
                raise Busy(
                    f"DEST {self.path} is locked by another process (a wsync pull into a "
                    "directory inside it?); a pull replaces DEST whole: wait for that one"
                )
        fd, above = os.dup(self.parent_fd), self.path.parent
        try:
            while above != above.parent:  # the walk follows the held inodes, not names
                if is_dest(above):
                    try:  # (a walked fd is a path's: flock needs one opened for reading)
                        self._tree_fds.append(os.open(".", _DIR_FLAGS, dir_fd=fd))
                    except OSError as exc:  # a DEST this user may not read: no lock on it
                        # (its name lock is still looked at, one step up)
                        log.debug("tree lock not taken", dest=str(above), error=exc.strerror)
                    else:
                        if not self._flock(self._tree_fds[-1], fcntl.LOCK_SH):
                            raise Busy(
                                f"DEST {self.path} lies in the DEST {above}, which another "
                                "process (a wsync pull replacing it?) holds: wait for that one"
                            )
                try:
                    # O_PATH: an ancestor this user may search but not read (mode 711)
                    # is walked through too, its DEST lock file looked at like any other
                    up = os.open("..", _PATH_FLAGS, dir_fd=fd)
                except OSError:
                    return  # an ancestor this user may not search: nothing to lock above
                os.close(fd)
                fd = up
                if self._pull_into(fd, above.name):
                    raise Busy(
                        f"DEST {self.path} lies in {above}, which another wsync pull is "
                        "replacing: wait for that one"
                    )
                above = above.parent
        finally:
            os.close(fd)

    @staticmethod
    def _pull_into(parent_fd: int, name: str) -> bool:
        """Whether a pull holds the DEST lock of directory ``name`` of ``parent_fd``: a
        pull into a directory that is no DEST yet (an empty one, accepted as such) holds
        no lock on the directory that a pull beneath it would meet, only this one (a
        review had both succeed, the tree beneath thrown away with the old one).  Only a
        regular lock file of ours or root's counts: another user's, in a directory anyone
        may write (``/tmp``), could otherwise stop every pull beneath it (or, a FIFO,
        hang it in its ``open``: opened without waiting)."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO: no wait
        try:
            fd = os.open(lock_name(name), flags, dir_fd=parent_fd)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()):
                return False
            return not DestDir._flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)

    @staticmethod
    def _flock(fd: int, how: int) -> bool:
        """False when another holder has it; True when taken, or when it cannot be had."""
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:  # e.g. NFS: flock on a directory fd is EBADF there
            log.debug("tree lock not taken", error=exc.strerror or str(exc))
        return True

    def _open_lock(self, name: str) -> int:
        flags = os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(name, flags | os.O_RDWR | os.O_CREAT, 0o644, dir_fd=self.parent_fd)
        except PermissionError as denied:  # another user's lock file: flock works read-only
            try:
                return os.open(name, flags | os.O_RDONLY, dir_fd=self.parent_fd)
            except FileNotFoundError:
                raise denied from None  # no lock file, and we may not create one

    def _names_fd(self, name: str, fd: int) -> bool:
        try:
            now = os.stat(name, dir_fd=self.parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)

    # -- DEST itself ----------------------------------------------------------------------

    def stat(self) -> os.stat_result | None:
        """``lstat`` of DEST through the parent fd; None when it does not exist."""
        try:
            return os.stat(self.name, dir_fd=self.parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostIOError(f"checking DEST {self.path}: {exc.strerror or exc}") from exc

    def check_not_mount(self, st: os.stat_result) -> None:
        """Refuse a DEST that is a mount point: the swap could only fail, after the transfer."""
        parent = os.fstat(self.parent_fd)
        if st.st_dev != parent.st_dev or str(self.path) in fsutil.mount_points():
            raise UsageError(
                f"DEST {self.path} is a mount point, and wsync replaces DEST by renaming a "
                "new tree over it, which a mount point does not allow; "
                f"pull into a subdirectory of it instead (e.g. {self.path / 'workspace'})"
            )

    def is_empty(self) -> bool:
        with host_io(f"reading DEST {self.path}"):
            fd = os.open(self.name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.parent_fd)
            try:
                with os.scandir(fd) as entries:
                    return next(entries, None) is None
            finally:
                os.close(fd)

    # -- the writes of a pull -------------------------------------------------------------

    @property
    def prev_name(self) -> str:
        """Where an incremental pull keeps the old tree (:mod:`wsync.engine.prevtree`)."""
        return f".{self.name}.wsync-prev"

    def _ours(self) -> re.Pattern[str]:
        """Exactly our names beside DEST: DEST "out.wsync-tmp-x" has tmp trees that start
        like ours."""
        return re.compile(re.escape(f".{self.name}.wsync-") + r"(tmp-[0-9a-f]{12}|old|prev)")

    def leftovers(self) -> list[str]:
        """The trees earlier runs left beside DEST (every ``.NAME.wsync-tmp-*``,
        ``.NAME.wsync-old`` and the previous tree), for a pull that builds no tree to say
        which of them go (:meth:`make_tmp` finds them there otherwise)."""
        self.verify()
        ours = self._ours()
        with host_io(f"listing {self.path.parent}"), os.scandir(self.parent_fd) as entries:
            return sorted(e.name for e in entries if ours.fullmatch(e.name))

    def make_tmp(self, name: str, *, reuse: bool = False) -> tuple[int, list[str], bool, list[str]]:
        """The tmp tree ``name`` beside DEST: its fd, warnings, whether it was reused, and
        the left-overs of earlier runs for the caller to remove (the DEST lock says no other
        pull is writing here; a worker thread, since a kept tree is as large as DEST): every
        other ``.NAME.wsync-tmp-*`` and ``.NAME.wsync-old``, and the previous tree unless
        ``reuse``.  With ``reuse`` (an
        incremental pull, :mod:`wsync.engine.prevtree`) the tree is ``name`` as an earlier
        run of this pull left it, else the previous tree renamed to ``name``; it is reused
        only if it is a directory of ours, made 0700.  Otherwise it is created empty.
        """
        self.verify()
        warnings: list[str] = []
        ours = self._ours()
        with host_io(f"listing {self.path.parent}"), os.scandir(self.parent_fd) as entries:
            present = {e.name for e in entries if ours.fullmatch(e.name)}
        base = next((n for n in (name, self.prev_name) if n in present), None) if reuse else None
        stale = sorted(present - {name, base or name})
        self.close_tmp()
        shown = self.path.parent / name
        if base is not None:
            fd = self._reusable(base, name)
            if fd is not None:
                self._tmp_fd = fd
                return fd, warnings, True, stale
        aside = self.set_aside(name)  # removed on the caller's worker thread, with the rest
        if aside is not None:
            stale.append(aside)
        with host_io(f"creating {shown}"):
            os.mkdir(name, 0o700, dir_fd=self.parent_fd)
            self._tmp_fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.parent_fd)
        return self._tmp_fd, warnings, False, stale

    def _reusable(self, base: str, name: str) -> int | None:
        """``base`` renamed to ``name`` and opened, if it is a directory of ours (made
        0700); None otherwise (``name`` is then made afresh; a rejected previous tree is
        left where it is, and replaced by the next one kept)."""
        try:
            fd = os.open(base, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.parent_fd)
        except OSError:
            return None
        try:
            # a mount below it (someone else's doing: wsync never mounts) would bring what
            # it covers into DEST, names and all: such a tree is never reused
            if not fsutil.make_private(fd) or fsutil.mount_below(fd):
                os.close(fd)
                return None
            if base != name:
                self.remove(name)
                os.rename(base, name, src_dir_fd=self.parent_fd, dst_dir_fd=self.parent_fd)
        except (OSError, HostIOError):
            os.close(fd)
            return None
        return fd

    def keep_prev(self, old: str) -> int | None:
        """Keep the old tree (named ``old`` after the swap) as the previous tree; return
        an fd on it, or None when it could not be kept (the caller removes it).

        Its root is made 0700 first: its directories keep the old DEST's modes and its
        files are DEST's inodes, so a directory the guest has since closed (``chmod 700
        secrets``) would otherwise still show DEST's files to others through it."""
        fd = -1
        try:
            fd = os.open(old, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.parent_fd)
            if not fsutil.make_private(fd):
                raise OSError(errno.EPERM, "the old tree is not ours")
            if fsutil.mount_below(fd):
                # someone mounted something in DEST: its prune would take the files the
                # scan saw in the mount for the tree's (the removal leaves the mount alone)
                raise OSError(errno.EBUSY, "a mount point is below the old tree")
            self.set_aside(self.prev_name)  # not expected: removed by the next pull
            os.rename(old, self.prev_name, src_dir_fd=self.parent_fd, dst_dir_fd=self.parent_fd)
            return fd
        except (OSError, HostIOError) as exc:
            log.info("previous tree not kept", error=str(exc))
            if fd >= 0:
                os.close(fd)
            return None

    def set_aside(self, name: str) -> str | None:
        """Give tree ``name`` a stale tmp name (removed by whoever removes it, or by the
        next pull), so that nothing takes it for a tree to reuse or to extract into while a
        worker thread may still be at work in it.  Returns the new name; None when there
        was nothing to rename or the rename failed (logged)."""
        stale = tmp_name(self.name)
        try:
            os.rename(name, stale, src_dir_fd=self.parent_fd, dst_dir_fd=self.parent_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("tree not set aside", path=str(self.path.parent / name), error=str(exc))
            return None
        return stale

    def close_tmp(self) -> None:
        if self._tmp_fd is not None:
            os.close(self._tmp_fd)
            self._tmp_fd = None

    def swap(self, tmp: str) -> str | None:
        """Swap the tmp tree into DEST; return the name now holding the old tree (or None)."""
        self.verify()
        self.close_tmp()
        return swap_at(self.parent_fd, tmp, self.name, str(self.path), self.found, empty=self.empty)

    def remove(self, name: str) -> None:
        """Remove entry ``name`` beside DEST, whole tree; HostIOError naming what stayed."""
        remove_tree_at(self.parent_fd, name, shown=str(self.path.parent / name))

    def removal(self, name: str) -> Callable[[], None]:
        """:meth:`remove` for a worker thread: it works on its own copy of the parent fd,
        so closing this DestDir meanwhile cannot make it act on a reused fd number, and on
        the tree under a stale name given here, so that a removal still running after its
        wait was given up never has a name a later pull reuses."""
        fd = os.dup(self.parent_fd)
        name = self.set_aside(name) or name
        shown = str(self.path.parent / name)  # where what cannot go stays (a mount in it)

        def run() -> None:
            try:
                remove_tree_at(fd, name, shown=shown)
            finally:
                os.close(fd)

        return run

    def discard(self, name: str) -> str | None:
        """Remove a tmp tree on a failure path (give it a stale name first, on the calling
        thread, then remove it here): never raises (the pull's own error must be what is
        reported), returns what went wrong, if anything."""
        try:
            self.close_tmp()
            self.removal(name)()
        except (WsyncError, OSError) as exc:
            log.warning("tmp tree not removed", path=str(self.path.parent / name), error=str(exc))
            return str(exc)
        return None

    def close(self) -> None:
        """Release the DEST lock (removing its file while still holding it) and the fds."""
        self.close_tmp()
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            with contextlib.suppress(OSError):
                if self._names_fd(self.lock_name, fd):
                    os.unlink(self.lock_name, dir_fd=self.parent_fd)
            os.close(fd)
        while self._tree_fds:
            os.close(self._tree_fds.pop())
        if self.parent_fd >= 0:
            os.close(self.parent_fd)
            self.parent_fd = -1


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


@contextlib.contextmanager
def _refusing(dest: Path, root: Path | None, where: Path) -> Iterator[None]:
    """Turn an OSError from opening DEST's parent into a clear UsageError (or HostIOError)."""
    try:
        yield
    except OSError as exc:
        beneath = f" beneath the dest root {root}" if root is not None else ""
        if exc.errno == errno.ENOENT:
            raise UsageError(f"the parent of DEST does not exist{beneath}: {dest.parent}") from None
        if exc.errno == errno.ELOOP:
            raise UsageError(
                f"the path of DEST {dest} crosses a symlink{beneath}; "
                "name the real directory (a dest root is walked without following symlinks)"
            ) from None
        if exc.errno == errno.ENOTDIR:
            raise UsageError(f"the parent of DEST is not a directory: {dest.parent}") from None
        if exc.errno == errno.EXDEV:
            raise UsageError(f"DEST {dest} is not beneath the dest root {root}") from None
        raise HostIOError(f"opening {where}: {exc.strerror or exc}") from exc


def lock_name(dest_name: str) -> str:
    """The DEST lock's file beside DEST ``dest_name``."""
    return f".{dest_name}.wsync-lock"


def tmp_name(dest_name: str, tag: str | None = None) -> str:
    """A tree's name beside DEST ``dest_name``: ``.NAME.wsync-tmp-`` and ``tag``, 12 hex
    digits (a pull's own, from its journal key), or random ones (a stale name)."""
    return f".{dest_name}{TMP_INFIX}{tag or os.urandom(TMP_HEX // 2).hex()}"


def fs_stamp(parent_fd: int, dest_name: str) -> int | None:
    """The ctime of a directory made in ``parent_fd`` and removed again (see
    :meth:`DestDir.fs_now`), under a stale tmp name of DEST ``dest_name``."""
    name = tmp_name(dest_name)
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except OSError:
        return None
    try:
        return os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_ctime_ns
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=parent_fd)
