"""The early farm: an incremental pull links DEST into its tmp tree while the diff runs.

Why: a fresh hardlink farm (:func:`~wsync.engine.farm.build_farm`) costs one ``mkdir`` or
``linkat`` per entry of DEST, about 0.8 s for a 59k-entry tree, and it used to start only
after the diff said what to keep.  Yet most of the new tree is DEST as it is, and DEST's
scan (taken while the guest lists its workspace) is in memory before the manifest is even
parsed.  So when the guest's listing differs from the one the last pull diffed (something
will very likely change), the pull links every entry of that scan into its tmp tree in a
worker thread, while the manifest is loaded and the diff runs on the other core; the
kernel's work of the farm and Python's work of the diff overlap.  After the diff,
:meth:`Prefarm.finish` brings the tree to exactly the farm :func:`build_farm` would have
made, at a cost of what changed: entries the diff does not keep (changed, deleted, another
kind now) are removed, entries it keeps that are missing (new directories, a link that
failed) are made.

Nothing is trusted that build_farm does not trust: the tree is the pull's own tmp tree
(0700, beside DEST), reached through directory fds as in build_farm, and what it holds is
known from what this thread made, never from a listing of it.  A kept entry that the host
replaced between the scan and its link holds another inode than the diff saw; so does a
build_farm link made after such a change, and the commit's scan of the new DEST leaves
either out of the state (``incsql.KEPT_MOVED``), so the next pull fetches it again.

When the diff finds nothing to do, or a whole-tree run takes the place of the ``select``
run, the early farm was wasted and is removed with the tmp tree: the cost of a guess that
failed, which the trigger keeps rare (an unchanged guest lists the same bytes).  Linking
and unlinking moved the ctime of every inode of DEST, so after a wasted farm the state
records them again (:meth:`wsync.engine.incstate.PullState.refresh_ctimes`): else the next
pull would re-hash all of DEST.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Sequence

from wsync.engine.farm import CANCEL_EVERY, _farm_error, _Parents, _split, make_entry
from wsync.engine.fsutil import remove_tree_at
from wsync.engine.hostscan import HostRow
from wsync.engine.itemize import escape
from wsync.engine.prevtree import remove_all
from wsync.errors import HostIOError


class Prefarm:
    """One pull's early farm (see the module docstring): :meth:`build` in a worker thread,
    then :meth:`finish` with the diff's ``keep`` list."""

    def __init__(self) -> None:
        #: what the tmp tree holds: path -> is a directory
        self.made: dict[bytes, bool] = {}
        #: why :meth:`build` stopped short of a tree it can account for (None: it did not)
        self.broken: str | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self._child: subprocess.Popen[bytes] | None = None
        #: set once :meth:`build` is over (or will never run): :attr:`made` is final
        self._settled = threading.Event()

    def settle(self) -> None:
        """No :meth:`build` is running, or will run: what the tree holds is final."""
        self._settled.set()

    def links_to(self, path: bytes) -> int | None:
        """How many links to DEST's entry ``path`` the tree holds (0 or 1), once
        :meth:`build` is over; None when that cannot be known (the farm is broken).  The
        diff's re-check of a moved inode counts them (the host may have joined it to
        another name; this pull's own link is not such a join)."""
        self._settled.wait()
        if self.broken is not None or self._stopped:
            return None
        return 1 if self.made.get(path) is False else 0

    def stop(self) -> None:
        """Stop a running :meth:`build` (the pull is failing, or needs no farm): its
        worker process is killed, and the farm is broken."""
        with self._lock:
            self._stopped = True
            if self._child is not None:
                self._child.kill()

    def build(self, rows: Sequence[HostRow], dest_fd: int, tmp_fd: int) -> None:
        """Link DEST's scanned entries ``rows`` (parents first) into the empty tree at
        ``tmp_fd`` (directories made 0700, as build_farm makes them), in a worker process
        (:mod:`wsync.engine.linker`); worker thread.  Never raises: a farm it cannot account
        for is marked broken, and the caller farms afresh."""
        try:
            self._build(rows, dest_fd, tmp_fd)
        finally:
            self.settle()

    def _build(self, rows: Sequence[HostRow], dest_fd: int, tmp_fd: int) -> None:
        try:
            with self._lock:
                if self._stopped:
                    raise OSError(errno.ECANCELED, "stopped")
                if not sys.executable:
                    raise OSError(errno.ENOENT, "no Python interpreter to run it")
                self._child = subprocess.Popen(
                    # -P: nothing from the current directory is imported
                    [sys.executable, "-P", "-m", "wsync.engine.linker", str(dest_fd), str(tmp_fd)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(dest_fd, tmp_fd),
                    env=_worker_env(),
                )
            out, err = _talk(self._child, rows)
        except OSError as exc:
            self.broken = f"its worker process: {exc.strerror or exc}"
            return
        said = out.split(b"\0")
        if self._child.returncode != 0 or said[-2:] != [b"K", b""]:
            last = said[-2] if len(said) > 1 and said[-2][:1] == b"E" else err.strip()[-300:]
            self.broken = f"its worker process ended with {self._child.returncode}: {escape(last)}"
            return
        skipped = {record[1:] for record in said[:-2]}
        self.made = {
            path: kind == "d" for path, kind, *_ in rows if path != b"." and path not in skipped
        }

    def finish(
        self,
        dest_fd: int,
        tmp_fd: int,
        keep: Iterable[tuple[bytes, str]],
        check_cancel: Callable[[], None],
    ) -> int:
        """Make the tree at ``tmp_fd`` the farm of ``keep`` (build_farm's argument, sorted
        by path, directories first); return the entries made or removed here."""
        if self.broken is not None:
            raise HostIOError(f"the early farm is unusable ({self.broken})")
        made, touched = self.made, 0
        dest, tmp = _Parents(dest_fd), _Parents(tmp_fd)
        try:
            for path, kind in keep:
                if touched % CANCEL_EVERY == 0:
                    check_cancel()
                is_dir = kind == "d"
                have = made.pop(path, None)
                if have is is_dir:
                    continue
                if have is not None:  # the other kind in DEST: a file where a directory goes
                    parent, leaf = _split(path)
                    try:
                        into = tmp.get(parent)
                        _forget_below(tmp, path)
                        remove_tree_at(into, os.fsdecode(leaf), shown=escape(path))
                    except OSError as exc:
                        raise _farm_error(path, exc) from exc
                make_entry(dest, tmp, path, is_dir=is_dir)
                touched += 1
            # what the new tree does not have, children before their parents: every entry
            # below a path left here is left too (the manifest's entries lie in its
            # directories); one that went with a tree removed above is passed over
            touched += remove_all(tmp_fd, sorted(made, reverse=True), check_cancel)
        finally:
            made.clear()
            dest.close()
            tmp.close()
        return touched


def _worker_env() -> dict[str, str]:
    """What the worker needs of our environment to find its interpreter and wsync; no
    more (a daemon's environment may hold tokens, and the worker needs none)."""
    keep = ("PATH", "PYTHONPATH", "PYTHONHOME")
    return {name: os.environ[name] for name in keep if name in os.environ}


def _talk(child: subprocess.Popen[bytes], rows: Sequence[HostRow]) -> tuple[bytes, bytes]:
    """Send the worker its records (a batch at a time: a whole 100k-entry scan at once
    would be a second copy of it in memory), then read what it said."""
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    batch: list[bytes] = []
    try:
        try:
            with child.stdin:
                for path, kind, *_ in rows:
                    if path != b".":
                        batch.append((b"d" if kind == "d" else b"n") + path + b"\0")
                    if len(batch) >= 4096:
                        child.stdin.write(b"".join(batch))
                        batch.clear()
                child.stdin.write(b"".join(batch))
        except BrokenPipeError:
            pass  # it ended before reading them all: what it says (or its status) tells why
        # it writes its answer only after its last record, and to stderr only if it crashed
        return child.stdout.read(), child.stderr.read()
    except BaseException:
        child.kill()
        raise
    finally:
        child.stdout.close()
        child.stderr.close()
        child.wait()


def _forget_below(parents: _Parents, path: bytes) -> None:
    """Close the cached fds of ``path`` and of directories below it (about to be removed)."""
    below = path + b"/"
    for cached in [p for p in parents.fds if p == path or p.startswith(below)]:
        os.close(parents.fds.pop(cached))


def clear(tmp_fd: int) -> None:
    """Remove everything in the tree at ``tmp_fd`` (a broken early farm: start over)."""
    for name in os.listdir(tmp_fd):
        remove_tree_at(tmp_fd, name, shown=name)
