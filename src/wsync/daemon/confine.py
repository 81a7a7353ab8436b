"""Keeping the daemon inside its roots at the time of the write, not only of the request.

Why a second check at run time: a request is accepted (``check_dest`` resolves
the path and finds it inside a dest root), then waits in the queue, survives a
restart, or outlives a reload that changed the roots.  Meanwhile anyone who can
write inside a root can replace a directory on DEST's path with a symlink to
``/etc``; a check done with ``Path.resolve`` at that point would simply follow
it.  So just before a job runs, the path is walked again from the root, one
component at a time with ``O_NOFOLLOW`` (the ``openat``/``mkdirat`` way): a
component that is a symlink *now* stops the job with a clear error, and missing
parents are created by ``mkdir`` relative to the directory fd just opened, so a
symlink swapped in during the walk is never followed either.

What this cannot close alone: between this walk and the engine's own writes a
component could be swapped again.  That window is the engine's to close; it
receives the root as :attr:`PullOptions.dest_root` and walks from it the same
way when it writes.

Local sources (``local:PATH`` given in a request) follow the same rules
against ``api.local_roots``: the real path must lie under a configured root,
and at run time no component below the root may be a symlink.  A source is read
by the guest's shell, which follows the path again, later: whoever may rename
its last component (write the directory holding it, or any below the root
above it) could swap it for a symlink to elsewhere between the check and the
read (a review did, and had the daemon copy its own API token).  So every
directory from the root down to the source's parent must belong to the daemon's
user or root and be writable by nobody else (:func:`confine_source`); the
source itself may be anyone's, and a root itself is the operator's word.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from wsync.engine.destdir import refuse_reserved
from wsync.errors import HostIOError, UsageError

#: the group a source's owner without a passwd entry runs in (Debian's nogroup)
_NOGROUP = 65534
#: symlinks :func:`local_reader` follows (as Linux's own limit)
_LINKS = 40
#: the longest name of one directory entry (Linux's NAME_MAX)
_NAME_MAX = 255


class Forbidden(UsageError):
    """A well-formed request outside what the daemon is configured to allow (HTTP 403)."""

    kind = "forbidden"


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def find_root(path: Path, roots: Sequence[Path], *, strict: bool) -> Path | None:
    """The resolved root that ``path`` (already absolute, no ``..``) lies beneath.

    ``strict``: the path must be *below* the root, not the root itself (a DEST
    equal to a root would replace the whole root), and hold no root (roots may nest).
    Roots are the operator's own configuration, so their own symlinks are followed.
    """
    real_roots = [root.resolve(strict=False) for root in roots]
    if strict and any(real_root.is_relative_to(path) for real_root in real_roots):
        return None  # a root itself, or one holding a root (roots may nest)
    for real_root in real_roots:
        if path == real_root and not strict:
            return real_root
        if path != real_root and path.is_relative_to(real_root):
            return real_root
    return None


@contextlib.contextmanager
def _open_root(root: Path, *, create: bool) -> Iterator[int]:
    """Open a root; with ``create``, make it first (the operator's own path, as configured)."""
    try:
        if create:
            os.makedirs(root, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise HostIOError(f"cannot open the root {root}: {err.strerror}") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _step(fd: int, name: str, shown: Path, what: str) -> int:
    """Open directory ``name`` under ``fd`` without following a symlink; raise Forbidden."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Forbidden(
                f"{what}: {shown} is a symlink or not a directory now; "
                "refusing to follow it out of the configured root"
            ) from None
        raise


def walk_beneath(
    root: Path,
    path: Path,
    *,
    create: bool,
    what: str,
    leaf: str | None = None,
    guard: Callable[[int, Path, str], None] | None = None,
) -> os.stat_result | None:
    """Walk from ``root`` down to ``path`` (a directory) with no symlink followed.

    ``create``: make missing directories (mode 0777 & ~umask, like ``mkdir -p``)
    with ``mkdirat`` relative to the parent fd just opened.  ``leaf``: a name
    inside ``path`` to ``lstat`` through the final fd (None when it is absent).
    ``guard(fd, shown, what)`` looks at each directory before the walk steps into the
    next one (the root down to ``path``'s parent) and raises to stop it.
    Raises :class:`Forbidden` for a symlink or a non-directory on the way,
    :class:`HostIOError` for other failures.
    """
    parts = path.relative_to(root).parts
    with _open_root(root, create=create) as root_fd:
        fd = root_fd
        shown = root
        try:
            for name in parts:
                if guard is not None:
                    guard(fd, shown, what)
                shown = shown / name
                try:
                    nxt = _step(fd, name, shown, what)
                except FileNotFoundError:
                    if not create:
                        raise Forbidden(f"{what}: {shown} does not exist") from None
                    with contextlib.suppress(FileExistsError):  # raced: opened below
                        os.mkdir(name, 0o777, dir_fd=fd)
                    nxt = _step(fd, name, shown, what)
                if fd != root_fd:
                    os.close(fd)
                fd = nxt
            if leaf is None:
                return None
            try:
                return os.stat(leaf, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
        except OSError as err:
            raise HostIOError(f"{what}: cannot open or create {shown}: {err.strerror}") from None
        finally:
            if fd != root_fd:
                os.close(fd)


def confine_dest(dest: Path, roots: Sequence[Path]) -> Path:
    """Re-check DEST against the *current* roots just before a pull; return its root.

    DEST must be strictly beneath a root, every directory between the root and
    DEST's parent must be a real directory (missing ones are created here,
    never through a symlink), and DEST itself must not be a symlink.
    """
    what = f"dest {dest}"
    refuse_reserved(dest)  # before a missing parent is made: it could be another DEST's lock
    root = find_root(dest, roots, strict=True)
    if root is None:
        allowed = ", ".join(str(r) for r in roots) or "none configured"
        raise Forbidden(f"{what} is no longer inside the allowed roots ({allowed})")
    found = walk_beneath(root, dest.parent, create=True, what=what, leaf=dest.name)
    if found is not None and stat.S_ISLNK(found.st_mode):
        raise Forbidden(f"{what} is a symlink now; refusing to replace what it points to")
    return root


def check_local_source(path: Path, roots: Sequence[Path]) -> Path:
    """The real path of a requested ``local:`` source, if it lies under a local root
    (:func:`confine_source` checks the rest when the job runs)."""
    if not roots:
        raise Forbidden(
            "local: sources are disabled for API requests; configure api.local_roots "
            "to allow directories of this host to be pulled"
        )
    real = path.resolve(strict=False)
    if find_root(real, roots, strict=False) is None:
        allowed = ", ".join(str(r) for r in roots)
        raise Forbidden(f"local source {str(path)!r} resolves outside api.local_roots ({allowed})")
    return real


def confine_source(path: Path, roots: Sequence[Path]) -> None:
    """At run time: the source is still under a local root, with no symlink below the root
    and no directory above it, below the root, that another user could change."""
    what = f"local source {path}"
    root = find_root(path, roots, strict=False)
    if root is None:
        allowed = ", ".join(str(r) for r in roots) or "none configured"
        raise Forbidden(f"{what} is no longer inside api.local_roots ({allowed})")
    walk_beneath(root, path, create=False, what=what, guard=_only_ours)


def local_reader(path: Path, *, requested: bool) -> tuple[int, int] | None:
    """Whom the guest side of a ``local:`` pull of ``path`` runs as: None for the daemon
    itself, where only it or root could have put there what the guest will read; else
    the first other user found who could (:func:`wsync.transports.local.as_user` says
    why), as ``(uid, gid)``.

    The path is walked from ``/`` as the kernel resolves it: every directory passed
    through and every symlink followed (relative ones from the real directory holding
    them) must be root's or the daemon's, and a directory that others may write to must
    have the sticky bit, its entry there be ours, and a missing entry is refused (anyone
    could make it).  The first entry another user owns decides: below it, that user
    controls what the guest reads.  Switching users needs a daemon running as root; one
    that cannot refuses a requested source, and reads a configured one as itself (the
    operator's choice).  (Three reviews found the holes of the first forms: a link to
    root's files read as root, a missing source read as the daemon, a directory above
    the holder swapped, ``..`` in a link's target.)"""
    trusted = (0, os.geteuid())
    if not path.is_absolute():
        # ("~" and relative paths are the guest shell's: its HOME and working directory)
        raise Forbidden(f"local source {path}: give an absolute path")
    todo = list(reversed(str(path).split("/")))
    where, links = "/", 0
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            where = os.path.dirname(where)  # a real directory: its parent is ".."
            continue
        holder = os.lstat(where)
        shared = holder.st_mode & 0o022
        if shared and not holder.st_mode & stat.S_ISVTX:
            raise Forbidden(
                f"local source {path}: {where} may be changed by other users "
                f"(mode {stat.S_IMODE(holder.st_mode):o}): any of them could swap the source"
            )
        step = os.path.join(where, name)
        try:
            st = os.lstat(step)
        except (FileNotFoundError, NotADirectoryError):
            if shared:
                raise Forbidden(
                    f"local source {path}: {step} is missing, and anyone may make it"
                ) from None
            return None  # only the daemon or root could make it: the pull says it is missing
        except PermissionError:
            return None  # not ours to read: the guest, run as the daemon, cannot either
        except OSError as err:
            if err.errno == errno.ENAMETOOLONG and len(os.fsencode(name)) > _NAME_MAX:
                return None  # a name no file can have (nobody can make it): "missing"
            # a path past PATH_MAX, say: the guest may still reach it, through links
            raise Forbidden(f"local source {path}: cannot tell who owns {step}: {err}") from None
        if st.st_uid not in trusted:
            return _reader(path, st.st_uid, requested)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _LINKS:
                raise Forbidden(f"local source {path}: more than {_LINKS} symlinks to follow")
            target = os.readlink(step)
            if target.startswith("/"):
                where = "/"
            todo.extend(reversed(target.split("/")))
        elif stat.S_ISDIR(st.st_mode):
            where = step
        else:
            return None  # not a directory: the pull says so
    if os.lstat(where).st_mode & 0o022:
        # the guest reads it whole: anyone may put into it what tar then reads as root
        raise Forbidden(f"local source {path}: other users may write to it")
    return None


def _reader(path: Path, uid: int, requested: bool) -> tuple[int, int] | None:
    """``uid`` with its own passwd group (never a directory's: a workspace made by root
    and chown'ed to its agent keeps group root, which reads what root's group may)."""
    if os.geteuid() == 0:
        try:
            return uid, pwd.getpwuid(uid).pw_gid
        except KeyError:
            return uid, _NOGROUP
    if not requested:
        return None
    raise Forbidden(
        f"local source {path} belongs to uid {uid}: the daemon reads a workspace "
        "another user owns only as that user, which needs it to run as root (or the "
        "daemon's user must own the workspace)"
    )


def _only_ours(fd: int, shown: Path, what: str) -> None:
    """The directory at ``fd`` is the daemon user's or root's, and writable by no one
    else: no one else can rename what it holds."""
    st = os.fstat(fd)
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise Forbidden(
            f"{what}: {shown} (uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}) may be changed by another user, who "
            "could swap what it holds for a symlink between this check and "
            "the read; a local source must lie in directories only the daemon's "
            "user or root can change (or be a local root itself)"
        )
