"""The incremental side of a pull (issue 8): manifest, diff, farm, state commit.

A pull whose guest can list its workspace (GNU ``find -printf``, or busybox ``find`` with
``stat``) begins with a **manifest run**: the producer's ``manifest`` mode, fetched with
the same verified, journaled, resumable chunk reads as an archive (its own journal
phase), streamed into the host state (:class:`~wsync.engine.incstate.PullState`).  The
manifest is taken before any content is read, so the state never describes content newer
than what DEST holds: a file changed afterwards differs next time and is fetched again.

Then :meth:`Incremental.decide` picks the content run:

- no baseline (first pull, another sandbox or workspace, ``--full``, DEST missing): a
  **full** pull, the ``tar`` run as before; with excludes, a ``select`` run of every
  entry left, so excluded bytes never cross;
- a baseline: the diff's changed entries are uploaded as a list and a ``select`` run
  archives exactly those; nothing changed and DEST intact: no run, no write.

DEST is scanned while the guest writes the manifest (:meth:`Incremental.scan`).  When the
last pull found nothing to do, the state remembers the digest of that manifest and of that
scan; a pull that sees both again is a no-op without parsing the manifest or diffing (the
diff is a function of the two and of the state, which only a commit changes).  DEST is
still scanned every time, so any change made to it on the host changes the scan's digest
and takes the full diff, which repairs it.

The new tree is built in the usual tmp dir beside DEST: a hardlink farm of DEST's
unchanged entries (:func:`~wsync.engine.farm.build_farm`; or DEST's scan linked by a worker
process while the diff runs, then brought to the same farm: :mod:`~wsync.engine.prefarm`;
with ``--keep-prev``, the previous pull's old tree, kept beside DEST and brought to the same
farm at a cost of what changed: :mod:`~wsync.engine.prevtree`), the archive applied in the
extractor's replace mode (no inode of the live DEST is ever written), gone entries removed,
directory modes and mtimes set from the manifest, then the usual flush and swap.  The old
tree is removed (or kept for the next pull, minus what the new DEST does not share) while
the state is committed with the extractor's file hashes and a ctime window over the
pull's own links and unlinks (:mod:`wsync.engine.finish`, :meth:`PullState.window`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar

import structlog

from wsync.engine import hostscan, prefarm, prevtree
from wsync.engine.api import PullOptions
from wsync.engine.destdir import DestDir
from wsync.engine.excludes import Excludes
from wsync.engine.extract import Written, written
from wsync.engine.farm import build_farm, join_groups, set_dir_meta
from wsync.engine.fsutil import host_io
from wsync.engine.guest import GuestPlan
from wsync.engine.incdiff import Diff
from wsync.engine.incstate import HOLD, PullState
from wsync.engine.itemize import escape
from wsync.engine.prefarm import Prefarm
from wsync.errors import (
    FILES_KNOB,
    GuestToolsMissing,
    HostileArchive,
    HostIOError,
    Interrupted,
    LimitExceeded,
    ProtocolError,
    UsageError,
)
from wsync.protocol.manifest import Entry, Known, ManifestParser

log = structlog.get_logger("wsync.incremental")

_R = TypeVar("_R")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = 1 << 20
_LEN = struct.Struct(">I")
#: a hash log record's inode, mode and size (its mtime follows in 16 bytes)
_WRITTEN = struct.Struct("<QIQ")
#: how long :meth:`Incremental.close_window` waits for DEST's filesystem clock to tick;
#: longer where it stamps whole seconds (else every pull that began and ended within one
#: second would leave an empty window, and the next re-hash all it kept)
_TICK_WAIT_S = 0.02
_SECOND_TICK_WAIT_S = 1.1


def can_list(plan: GuestPlan) -> bool:
    """The guest can write a manifest: GNU find, or find + stat + readlink + xargs."""
    probe = plan.probe
    if not probe.has("find"):
        return False
    return probe.has("find_printf") or all(probe.has(t) for t in ("stat", "readlink", "xargs"))


def can_select(plan: GuestPlan, *, stdin: bool) -> bool:
    """The guest can take a list: on stdin, or in argv parts it base64-decodes."""
    return stdin or plan.probe.has("base64")


def read_manifest(
    stream: BinaryIO,
    state: PullState,
    excludes: Excludes,
    max_files: int,
    options: str,
    *,
    trust_known: bool = True,
    known: Known | None = None,
    min_free: int | None = None,
) -> int:
    """Parse the decompressed manifest ``stream`` into ``state``; return the entries read.

    The stream was verified chunk by chunk, so a record that does not parse is the guest's
    doing: refused like a hostile archive (the snapshot is discarded).  Records the state
    holds from the last pull (made under the same ``options``) are not parsed again but
    copied (:meth:`PullState.known`, or ``known`` when the caller read them already),
    unless not ``trust_known`` (``--full``: nothing recorded is relied on).
    """
    if not trust_known:
        known = Known(set())
    elif known is None:
        known = state.known(options)
    parser = ManifestParser(known)

    def entries() -> Iterator[Entry]:
        while block := stream.read(_READ):
            parser.receive_data(block)
            if parser.count > max_files:
                raise LimitExceeded(
                    f"the guest's manifest lists more than {max_files} entries ({FILES_KNOB})"
                )
            yield from parser.entries()
        parser.receive_eof()
        yield from parser.entries()

    try:
        state.load_manifest(
            entries(), excludes, max_entries=max_files, known=known, min_free=min_free
        )
    except ProtocolError as exc:
        raise HostileArchive(f"the guest's manifest: {exc}") from exc
    log.debug("manifest loaded", records=parser.count, known=known.matched)
    return parser.count


def open_dest(target: DestDir) -> int | None:
    """DEST itself, opened without following a symlink; None when it does not exist."""
    try:
        return os.open(target.name, _DIR_FLAGS, dir_fd=target.parent_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise HostIOError(f"opening DEST {target.path}: {exc.strerror or exc}") from exc


class HashLog:
    """The extractor's (path, xxh3_128, written) records, on disk: a million files must not
    be held in memory until the commit.  Written by the extractor thread, read once after."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO | None = None

    def start(self) -> None:
        self.close()
        with host_io(f"writing {self.path}"):
            self._file = self.path.open("wb")

    def reopen(self) -> None:
        """Append after a close: a later record of a path replaces an earlier one."""
        self.close()
        with host_io(f"writing {self.path}"):
            self._file = self.path.open("ab")

    def add(self, path: bytes, digest: str, written: Written) -> None:
        if self._file is not None:
            ino, mode, size, mtime = written
            try:  # once per file: no context manager on this path
                self._file.write(
                    _LEN.pack(len(path))
                    + path
                    + digest.encode().ljust(32)[:32]
                    + _WRITTEN.pack(ino, mode, size)
                    + mtime.to_bytes(16, "little", signed=True)  # times pass 64 bits in 2262
                )
            except OSError as exc:  # a full state directory: exit 8, not an internal error
                with contextlib.suppress(HostIOError):
                    self.close()  # the log is of no use now; its descriptor goes
                raise HostIOError(f"writing {self.path}: {exc.strerror or exc}") from exc

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            with host_io(f"writing {self.path}"):
                try:
                    file.close()
                except OSError:  # its flush failed: the descriptor is still open
                    with contextlib.suppress(OSError):
                        file.raw.close()  # type: ignore[attr-defined]
                    raise

    def __iter__(self) -> Iterator[tuple[bytes, str, Written]]:
        self.close()
        with (
            host_io(f"reading {self.path}"),
            contextlib.suppress(FileNotFoundError),
            self.path.open("rb") as f,
        ):
            while head := f.read(_LEN.size):
                (n,) = _LEN.unpack(head)
                path = f.read(n)
                digest = f.read(32).decode().rstrip()
                ino, mode, size = _WRITTEN.unpack(f.read(_WRITTEN.size))
                mtime = int.from_bytes(f.read(16), "little", signed=True)
                yield path, digest, (ino, mode, size, mtime)


class Incremental:
    """One pull's incremental state: opened after the probe, closed with the pull."""

    def __init__(
        self, options: PullOptions, target: DestDir, sandbox_key: str, hashes: HashLog
    ) -> None:
        self.options = options
        self.excludes: Excludes = options.excludes
        self.target = target
        #: this pull's ctime window opens here, before its first scan of DEST, by DEST's
        #: filesystem's own clock (see :meth:`PullState.window`); None: no window
        self.window_lo = target.fs_now()
        #: the commit records the whole new tree as read before the swap
        #: (:meth:`note_tree`): no link or unlink of this pull moves a ctime of it after
        #: that, so no window is opened, and an edit of DEST from the swap on, even a
        #: same-size rewrite with the mtime put back, is re-hashed by the next pull (unless
        #: it is stamped in the same tick of the filesystem's clock as the pull's own last
        #: change to that file: a second on a filesystem of whole seconds)
        self.noted_whole = False
        self.state = PullState.open(options.state_dir, target.path, sandbox_key)
        #: what the state held when opened: a baseline of this sandbox, and a no-op record
        #: (read once here: the loop thread must not wait for a worker using the state)
        self.recorded = self.state.has_baseline()
        self.noop_recorded = self.recorded and self.state.has_noop_record()
        #: the manifest digest of the last pull that diffed DEST (the early farm's trigger)
        self.last_listing = self.state.last_listing() if self.recorded else None
        self.hashes = hashes
        #: "full" or "incremental"
        self.mode = "full"
        #: the content run: "tar", "select", "apply" (no entry to fetch: farm and swap
        #: only) or "" (nothing to do)
        self.run = "tar"
        self.diff: Diff | None = None
        self.changed = 0
        self.deleted = 0
        self.entries = 0
        #: held while a worker thread uses the state's connection
        self.busy = threading.Lock()
        #: the state's records for the load, read ahead by :meth:`scan`
        self._known: Known | None = None
        #: the digests the no-op shortcut compares (see the module docstring): DEST's scan
        #: made during the manifest run, and the verified manifest stream
        self.host_digest = ""
        self.manifest_digest = ""
        #: the manifest was loaded into the state (it is not while the shortcut may apply)
        self.loaded = False
        #: the new tree was the previous one brought to the farm (not a fresh farm)
        self.reused = False
        #: bringing the previous tree to the farm failed (something in it we cannot remove)
        self.reuse_failed = False
        #: the content run was admitted before the listing loaded, within a second of it:
        #: files stamped in that listing's last second are not recorded (see commit)
        self.forget_racy = False
        #: the previous tree's walk, taken while the diff ran (see :meth:`walk_ahead`)
        self.walked: prevtree.Walked | None = None
        #: the new tree's directories as :meth:`dir_meta` left them, by path
        self.dir_rows: dict[bytes, hostscan.HostRow] = {}
        self._stop = threading.Event()

    def close(self) -> None:
        """Close the state, unless a worker thread still uses its connection (a pull
        stopped mid-diff): closing under it can crash the interpreter; it dies with us."""
        self.hashes.close()
        if self.busy.acquire(blocking=False):
            try:
                self.state.close()
            finally:
                self.busy.release()

    def locked(self, work: Callable[[], _R]) -> _R:
        """``work()`` holding :attr:`busy` (for worker threads using the state)."""
        with self.busy:
            return work()

    def prune(self) -> tuple[str, ...]:
        return tuple(self.excludes.guest_prune())

    def load(self, stream: BinaryIO) -> None:
        """The manifest phase's consumer (extractor thread)."""
        with self.busy:
            known, self._known = self._known, None  # (the parser uses it up)
            self.entries = read_manifest(
                stream,
                self.state,
                self.excludes,
                self.options.limits.max_files,
                self.options_key(),
                trust_known=not self.options.full,
                known=known,
                min_free=self.options.limits.min_free_bytes,
            )
            self.loaded = True

    def options_key(self) -> str:
        """What else, beside the manifest and DEST, decides the diff: the excludes and the
        entry limit (the state's schema and sandbox are checked by ``has_baseline``)."""
        what = [list(self.excludes.patterns), self.options.limits.max_files]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()

    def baseline(self, plan: GuestPlan, *, stdin: bool) -> bool:
        """This pull diffs against what the last pull into DEST recorded."""
        return self.recorded and not self.options.full and can_select(plan, stdin=stdin)

    def scan(self) -> None:
        """Scan DEST into the state (worker thread, during the manifest run).  The walk
        uses the state's connection only to write a scan larger than HOLD, and holds
        :attr:`busy` only for that: the manifest's load runs beside it."""
        if not (self.options.full or self.noop_recorded) and self.busy.acquire(blocking=False):
            # first, while the guest lists: the records the load will skip (the last
            # pull's), unless that pull found nothing to do and this one likely finds the
            # same (then the listing is most likely not loaded at all), or the load began
            # already (it reads them itself: the walk never waits for it)
            try:
                if not self.loaded:
                    self._known = self.state.known(self.options_key())
            finally:
                self.busy.release()
        dest_fd = open_dest(self.target)
        if dest_fd is None:
            return
        try:
            self.host_digest = self.state.scan(dest_fd, self._check_stop, lock=self.busy)
        finally:
            os.close(dest_fd)
        log.debug("DEST scanned")

    def stop(self) -> None:
        """Make a running :meth:`scan` stop at its next batch (the pull is failing)."""
        self._stop.set()

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise Interrupted("pull stopped")

    def nothing_changed(self) -> bool:
        """The no-op shortcut (see the module docstring): True sets the outcome."""
        key = self.options_key()
        with self.busy:
            if not self.state.noop_matches(key, self.manifest_digest, self.host_digest):
                return False
        self.mode, self.run = "incremental", ""
        self.changed = self.deleted = 0
        return True

    def decide(
        self,
        plan: GuestPlan,
        *,
        stdin: bool,
        tmp_fd: int | None = None,
        own_links: Callable[[bytes], int | None] | None = None,
    ) -> None:
        """Diff and choose the content run (see the module docstring).  Runs in a thread.

        ``tmp_fd`` is an empty directory to diff against when there is no baseline;
        ``own_links`` counts the early farm's links (see :meth:`PullState.diff`).
        """
        selectable = can_select(plan, stdin=stdin)
        baseline = self.baseline(plan, stdin=stdin)
        dest_fd = open_dest(self.target) if baseline else None
        if dest_fd is None:
            self.mode = "full"
            if self.excludes and not selectable:
                raise GuestToolsMissing("base64 (to hand the guest the list --exclude leaves)")
            if not self.excludes:
                self.run = "tar"
                return
            if tmp_fd is None:
                raise ValueError("a full pull with excludes diffs against the empty tmp tree")
            self.diff = self.state.diff(tmp_fd)
            self.run = "select"
            self.changed, self.deleted = self.diff.changed, 0
            self._selectable(self.diff)
            return
        try:
            self.diff = self.state.diff(dest_fd, own_links)
        finally:
            os.close(dest_fd)
        self.mode = "incremental"
        self.changed, self.deleted = self.diff.changed, self.diff.deleted
        if self.diff.nothing_to_do:
            self.run = ""
            # the scan the diff used was made this run (by scan() or by diff() itself)
            host = self.state.host_digest
            self.state.record_noop(self.options_key(), self.manifest_digest, host)
            self.settle()
        else:
            self.settle()  # (the re-hash's verdicts)
            self.run = "select" if self.diff.fetch else "apply"
            if self.run == "select" and not self._selectable(self.diff):
                # the whole workspace, by tar's own walk (by directory fds: any depth):
                # every entry is written afresh, none kept from DEST
                self.mode, self.run = "full", "tar"
                self.state.drop_plan()

    def _selectable(self, diff: Diff) -> bool:
        """Whether a ``select`` run can name every entry to fetch (see
        :meth:`Diff.longest_fetch`); where it cannot, a whole-tree run takes its place,
        or with excludes (which only a ``select`` run applies) the pull stops here."""
        if self.options.dry_run:
            return True  # nothing is archived: the preview shows the changes as they are
        longest = diff.longest_fetch()
        if longest is None:
            return True
        if self.excludes:
            raise UsageError(
                f"{escape(longest[:200])}…: a path of {len(longest)} bytes, longer than the "
                "guest's tar takes in a list; --exclude needs that list (pull without it)"
            )
        return False

    def select_list(self) -> bytes:
        """The NUL-separated, ``./``-prefixed list of entries to archive."""
        assert self.diff is not None
        return b"".join(b"./" + path + b"\0" for path in self.diff.fetch_paths())

    @property
    def reuses(self) -> bool:
        """The new tree may start from the previous one (:mod:`wsync.engine.prevtree`):
        only a diff against DEST gives what to keep."""
        return self.mode == "incremental" and self.diff is not None

    def farm(
        self,
        tmp_fd: int,
        check_cancel: Callable[[], None],
        *,
        reused: bool = False,
        early: Prefarm | None = None,
    ) -> int:
        """Link DEST's unchanged entries and create every directory in the tmp tree (a
        reused tree: remove what does not belong first; an ``early`` farm: bring it to
        the diff's); returns the entries made."""
        assert self.diff is not None
        dest_fd = open_dest(self.target) if self.mode == "incremental" else None
        source = dest_fd if dest_fd is not None else tmp_fd
        try:
            if early is not None:
                if early.broken is None and dest_fd is not None:
                    made = early.finish(dest_fd, tmp_fd, self.diff.keep(), check_cancel)
                    log.debug("early farm finished", touched=made)
                    return made
                log.debug("early farm unusable, farming afresh", reason=early.broken)
                prefarm.clear(tmp_fd)
            if reused and dest_fd is not None:
                try:
                    removed, made = prevtree.reuse(
                        self.state.db, dest_fd, tmp_fd, check_cancel, self.walked
                    )
                except (HostIOError, OSError):
                    self.reuse_failed = True  # the tree goes, not to the next run
                    raise
                self.reused = True
                log.debug("previous tree reused", removed=removed, linked=made)
                return made
            return build_farm(source, tmp_fd, self.diff.keep(), check_cancel)
        finally:
            if dest_fd is not None:
                os.close(dest_fd)

    def walk_ahead(
        self, parent_fd: int, names: list[str], check: Callable[[], None], since: int
    ) -> None:
        """Walk the tree a ``--keep-prev`` reuse will start from (the first of ``names`` in
        DEST's parent, open at ``parent_fd``), in a worker thread while the diff runs: the
        reuse then only checks that it renamed that very tree into place and that none of
        its directories changed since (:func:`prevtree.walk_ahead`)."""
        walked = prevtree.walk_ahead(parent_fd, names, check, HOLD, since, self.target.name)
        self.walked = walked
        log.debug("previous tree walked", entries=None if walked is None else len(walked.rows))

    def prune_prev(self, prev_fd: int) -> int:
        """After the swap, before :meth:`commit`: drop from the kept old tree what the new
        DEST does not share (old versions, deleted entries)."""
        return prevtree.prune(self.state.db, prev_fd, self._check_stop)

    def join_groups(self, tmp_fd: int) -> int:
        """After a ``select`` run: give the guest's hardlink groups one inode each in the
        new tree (:func:`wsync.engine.farm.join_groups`), recording every name linked anew
        with its leader's hash and signature; returns how many."""
        assert self.diff is not None
        joined = 0
        self.hashes.reopen()
        try:
            for path, leader, st in join_groups(tmp_fd, self.diff.fetched_groups()):
                digest = hostscan.file_hash(tmp_fd, leader, st.st_ino)
                if digest is None:
                    raise HostIOError(f"{escape(leader)}: changed while its names were joined")
                self.hashes.add(path, digest, written(st))
                joined += 1
        finally:
            self.hashes.close()
        return joined

    def dir_meta(self, tmp_fd: int) -> None:
        """The new tree's directories their modes and mtimes; each one's lstat row kept
        for the commit (:attr:`dir_rows`, at most HOLD), which then need not look again:
        nothing of the pull touches them after this but the swap (which moves the root,
        looked at again).  Anything done to one since from outside differs from the row
        recorded, next time."""
        assert self.diff is not None
        rows = self.dir_rows
        rows.clear()

        def seen(path: bytes, st: os.stat_result) -> None:
            if len(rows) < HOLD:
                rows[path] = hostscan.row(path, st)

        set_dir_meta(tmp_fd, self.diff.dirs(), seen)

    def note_tree(self, tmp_fd: int) -> None:
        """The last step before the swap: what the commit records of DEST is read off the
        finished new tree now (:meth:`PullState.note_tree`), so that nothing done to DEST
        after the swap is recorded as this pull's.  After a diff, the rows of what it made
        (:func:`prevtree.restat`); after a whole-tree run, the whole tree.  A diff without
        a listing (no window) leaves it to the commit, which scans DEST once the old tree
        is gone."""
        if self.reuses:
            if self.manifest_digest:
                db = self.state.db
                self.state.note_tree(tmp_fd, prevtree.restat(db, tmp_fd, self.dir_rows))
        else:
            self.state.note_tree(tmp_fd)
            self.noted_whole = True

    def commit(self, *, kept_prev: bool = False) -> bool:
        """Record DEST as this sandbox's baseline (after the swap, while the old tree is
        removed), from what :meth:`note_tree` read before the swap.  After a diff only what
        this pull made was read (:func:`prevtree.restat`): every entry it kept is the inode
        the diff scanned, whose ctime its links and unlinks move within the window
        :meth:`close_window` closes.

        A reused previous tree that is kept again (``kept_prev``) moved no ctime of what
        it kept (only of the few entries it linked anew: the next pull re-hashes those):
        no window is opened, so an edit of DEST during this pull that only its ctime tells
        is still seen by the next pull.  False when DEST is not there to record."""
        dest_fd = open_dest(self.target)
        if dest_fd is None:
            return False
        if self.forget_racy:
            # (the wait of IncrementalRunner.after_listing_second could not come first:
            # the next pull fetches them again, after its own listing's second)
            self.state.forget_racy()
        try:
            self.state.commit(
                dest_fd,
                iter(self.hashes),
                listing=self.manifest_digest,
                options=self.options_key(),
                window_lo=None
                if self.noted_whole or (kept_prev and self.reused)
                else self.window_lo,
            )
        finally:
            os.close(dest_fd)
        return True

    def close_window(self) -> None:
        """After the commit and after the old tree is gone (or kept): no link or unlink of
        this pull moves a ctime of DEST from now on.  Every one of them was stamped at or
        before DEST's filesystem's ``now``; the window ends, exclusive, at its next tick
        when that comes within a moment (a second on a filesystem of whole seconds; else
        at ``now`` itself, and what the pull moved in that last tick is re-hashed once), so
        anything done to DEST after the pull is stamped outside it, whatever the host's
        clock says."""
        hi = self._next_tick()
        if hi is not None:
            self.state.close_window(hi)

    def settle(self) -> None:
        """Once this run recorded ctimes of DEST as its scans saw them outside a commit (a
        re-hash's verdict, the no-op record, a refresh after an early farm): wait, as
        :meth:`close_window` does, for DEST's filesystem clock to tick past them.  On a
        filesystem of whole seconds an edit right after the pull, its size kept and its
        mtime put back, was stamped in the very second scanned, looked like the entry
        recorded, and stayed hidden from every later pull.  (An edit before the tick is
        one made during the pull, which the README says a default pull may not see.)"""
        if self.state.stamped:
            self._next_tick()
            self.state.stamped = False

    def _next_tick(self) -> int | None:
        """DEST's filesystem's next tick, when it comes within a moment (a second on a
        filesystem of whole seconds), else its ``now``; None when it cannot be read."""
        first = hi = self.target.fs_now()
        whole = first is not None and first % 1_000_000_000 == 0
        deadline = time.monotonic() + (_SECOND_TICK_WAIT_S if whole else _TICK_WAIT_S)
        while first is not None and hi is not None and hi <= first:
            if time.monotonic() >= deadline:
                return first
            time.sleep(0.01 if whole else 0.001)
            hi = self.target.fs_now()
        return hi

    def refresh_after_farm(self) -> None:
        """An early farm was made and removed without a change to DEST: record the ctimes
        that moved (:meth:`PullState.refresh_ctimes`), and the no-op record with them."""
        dest_fd = open_dest(self.target)
        if dest_fd is None:
            return
        try:
            host = self.state.refresh_ctimes(dest_fd)
        finally:
            os.close(dest_fd)
        if self.run == "" and self.mode == "incremental":
            self.state.record_noop(self.options_key(), self.manifest_digest, host)
        self.settle()

    def tree_bytes(self) -> int:
        return self.state.tree_bytes()
