"""The incremental phases of a pull (issue 8): DEST's scan, the manifest run, the diff.

:class:`IncrementalRunner` is the part of a pull (:mod:`wsync.engine.pull`) that runs before
the content run: it opens DEST's state, scans DEST in a worker thread while the guest
lists its workspace (the scan starts before the probe when the state says a baseline
exists, so the host's walk overlaps the probe, the admission and the guest's ``find``),
fetches the manifest with the verified chunk reads every run uses, and decides what the
content run must be (:meth:`wsync.engine.incremental.Incremental.decide`).

When the last pull found nothing to do, the manifest stream is only verified and
journaled, not parsed: if its digest and the scan's are the recorded ones the pull is a
no-op (:meth:`~wsync.engine.incremental.Incremental.nothing_changed`); otherwise it is
parsed from the journal (:meth:`IncrementalRunner.replay_manifest`) and diffed as always.

Without a baseline (a first pull, ``--full``) and with no ``--exclude`` or ``--dry-run``
the content run is the whole tree whatever the manifest says, so the manifest is not
parsed before the content run starts: it is verified and journaled, the content run is
admitted, and the manifest is loaded into the state from the journal meanwhile (the
**late load**, :meth:`IncrementalRunner.load_late`), which the pull waits for before the
swap (the commit records it; a manifest that does not load fails the pull with DEST
untouched).  The admission's room check takes the listed size from a quick count of
the journaled stream (:class:`wsync.protocol.manifest.ListedBytes`, 0.08 s for 61k
entries), not from the guest's ``du`` (0.25 s), nor from the load (0.8 s).

Once the manifest's bytes are in, if they differ from the listing the last pull diffed,
the tmp tree is made and DEST's scan linked into it while the manifest loads and the diff
runs (:mod:`wsync.engine.prefarm`); the content run takes that tree
(:meth:`IncrementalRunner.take_early_farm`), any other outcome removes it
(:meth:`IncrementalRunner.drop_early_farm`).  With ``--keep-prev`` the kept tree is the
start instead, and what goes ahead is its walk (:func:`wsync.engine.prevtree.walk_ahead`):
the reuse takes the rows if it renamed that very tree into place.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import structlog

from wsync.engine import incremental
from wsync.engine.feed import ChunkFeed, consume_feed
from wsync.engine.fsutil import host_io
from wsync.engine.guest import GuestPlan
from wsync.engine.incremental import Incremental
from wsync.engine.incstate import state_path
from wsync.engine.journal import Journal
from wsync.engine.leftovers import LeftoverRunner
from wsync.engine.phases import _WIND_DOWN_S
from wsync.engine.prefarm import Prefarm
from wsync.engine.winddown import in_thread, owned
from wsync.errors import GuestToolsMissing, HostIOError, Interrupted, WsyncError
from wsync.protocol import manifest
from wsync.protocol.records import DoneRecord
from wsync.protocol.scripts import SNAPSHOT_ID

log = structlog.get_logger("wsync.pull")


def _listing(snapshot: str, done: DoneRecord) -> str:
    """A listing's name in a content run's journal: its snapshot and its stream's hash."""
    return f"{snapshot}:{done.digest}"


def _manifest_digest(plan: GuestPlan, done: DoneRecord) -> str:
    """What the state records of a manifest stream (the no-op record, the last listing)."""
    return f"{plan.algorithm.name}:{plan.compressor}:{done.length}:{done.digest}"


class IncrementalRunner(LeftoverRunner):
    """The incremental phases of one pull (see the module docstring)."""

    scan_task: asyncio.Task[None] | None = None
    #: the early farm and the task making it (tmp name and fd when done), until taken
    early: Prefarm | None = None
    early_task: asyncio.Task[tuple[str, int] | None] | None = None
    #: set once the early farm holds DEST's scan rows, or will not farm (the diff waits
    #: for it: the diff consumes the rows)
    early_ready: asyncio.Event | None = None
    #: ``--keep-prev``: the previous tree's walk, taken while the diff runs (see
    #: :meth:`Incremental.walk_ahead`), and what stops it
    walk_task: asyncio.Task[None] | None = None
    walk_stop: threading.Event | None = None
    #: the manifest's guest staging being removed while the diff runs (keep_staging)
    manifest_cleanup: asyncio.Task[None] | None = None
    #: the manifest being loaded into the state while the content run goes on (see the
    #: module docstring); awaited before the swap
    late_load: asyncio.Task[None] | None = None
    #: KiB of file bytes the manifest lists, counted for a late load's admission
    late_listed_kb: int | None = None
    #: this run's listing, ``SNAPSHOT:DIGEST``: a content run's journal names the one it
    #: was admitted after, and is resumed only under that very listing
    listing: str | None = None
    #: when this run's listing was known done (monotonic; see :meth:`after_listing_second`)
    listed_at: float | None = None

    def new_incremental(self) -> Incremental:
        key = f"{self.transport.description}\n{self.workspace}"
        hashes = incremental.HashLog(self.journal.dir / "hashes")
        return Incremental(self.options, self.target, key, hashes)

    def start_early(self) -> None:
        """Before the probe: open DEST's state when it exists and may hold a baseline, and
        start scanning DEST (:meth:`open_incremental` keeps or drops both)."""
        if self.options.full or not state_path(self.options.state_dir, self.dest).exists():
            return
        inc = self.inc = self.new_incremental()
        if inc.recorded:
            self.scan_task = asyncio.create_task(in_thread(inc.scan))

    async def stop_scan(self) -> None:
        """Stop a DEST scan still running (the pull failed or does not need it)."""
        task, self.scan_task = self.scan_task, None
        if task is not None:
            if self.inc is not None:
                self.inc.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def open_incremental(self, plan: GuestPlan) -> Incremental | None:
        """The incremental state of DEST, when this guest can list its workspace."""
        if not incremental.can_list(plan):
            await self.stop_scan()
            if self.inc is not None:
                self.inc.close()
                self.inc = None
            if self.options.excludes or self.options.dry_run:
                # a full tar would carry the excluded bytes and list nothing
                what = "--exclude" if self.options.excludes else "--dry-run"
                raise GuestToolsMissing(
                    f"find with -printf, or find, stat, readlink and xargs (for {what})"
                )
            return None
        if self.inc is None:
            self.inc = self.new_incremental()
        if not self.inc.baseline(plan, stdin=self.session.gate):
            await self.stop_scan()  # nothing to diff DEST against
        return self.inc

    async def manifest_and_diff(self, plan: GuestPlan, inc: Incremental) -> None:
        """The manifest run (DEST's scan finishing meanwhile), then the diff."""
        late = self.loads_late(plan, inc)
        skip = late or (self.scan_task is not None and inc.noop_recorded)
        await self.manifest_phase(plan, inc, skip=skip)
        if late and not inc.loaded:
            done = self.done
            assert done is not None
            self.late_listed_kb = await self.count_listed(plan, done)
            self.late_load = asyncio.create_task(self.replay(plan, inc, done))
        # with keep_staging the manifest's staging removal, started by manifest_phase,
        # runs beside the diff (a failure cancels it: drop_late_load)
        await self.diff_phase(plan, inc)
        if self.late_load is None:
            await self.manifest_cleaned()

    async def diff_phase(self, plan: GuestPlan, inc: Incremental) -> None:
        """DEST's scan finished, then the no-op shortcut or the diff."""
        if self.scan_task is not None:
            await self.scan_task
            self.scan_task = None
        self.emit("diff")
        if inc.nothing_changed():
            return
        if not inc.loaded and self.late_load is None:
            await self.replay(plan, inc)
        if self.early_ready is not None:
            # the early farm takes DEST's scan rows first (the diff hands them to the
            # state's tables and drops them); it does so as soon as the scan is done
            await self.early_ready.wait()
        empty = self.journal.dir / "empty"
        await in_thread(lambda: inc.locked(lambda: self.decide(inc, plan, empty)))

    def decide(self, inc: Incremental, plan: GuestPlan, empty: Path) -> None:
        """Diff (in a thread); a full pull with excludes diffs against an empty directory of
        the journal, a full dry run against DEST with no state (see :meth:`preview_full`)."""
        with host_io(f"writing {empty}"):
            with contextlib.suppress(FileExistsError):
                empty.mkdir(mode=0o700)
            fd = os.open(empty, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        early = self.early
        try:
            own_links = early.links_to if early is not None else None
            inc.decide(plan, stdin=self.session.gate, tmp_fd=fd, own_links=own_links)
            if self.options.dry_run and inc.mode == "full":
                self.preview_full(inc, fd)  # (with excludes, in place of the diff above)
        finally:
            os.close(fd)

    def preview_full(self, inc: Incremental, empty_fd: int) -> None:
        """What a full pull would do, for a dry run: every entry fetched, and what DEST
        holds that the guest does not list deleted.  So the diff is against DEST as it is,
        with no recorded state (an empty directory where DEST is missing or is not a
        directory, which a pull would refuse or replace whole)."""
        try:
            dest_fd = incremental.open_dest(self.target)
        except HostIOError:
            dest_fd = None
        try:
            inc.diff = inc.state.diff(empty_fd if dest_fd is None else dest_fd, baseline=False)
        finally:
            if dest_fd is not None:
                os.close(dest_fd)
        inc.changed = inc.diff.changed  # what it lists, as a dry run says
        inc.deleted = inc.diff.deleted

    async def manifest_phase(self, plan: GuestPlan, inc: Incremental, *, skip: bool) -> None:
        """The manifest run, streamed into the state (see :mod:`wsync.engine.incremental`).

        With ``skip`` (the no-op shortcut may apply, or the manifest loads late) the stream
        is only verified and journaled, not parsed: :meth:`replay_manifest` parses it from
        the journal when it must.  Its guest staging is left to the pull's last cleanup,
        which removes every run's in one call.
        """
        self.emit("manifest")
        journal = self.manifest_journal = self.journal.phase("manifest")
        prune = inc.prune()
        recorded = str(journal.meta.get("snapshot", "")) if journal.meta else ""
        if SNAPSHOT_ID.fullmatch(recorded) and not self.options.keep_staging:
            # an earlier run's listing (a pull stopped before its last cleanup), whose
            # staging may still be in the guest: whether this run replays it, goes on
            # with it or lists afresh, its last cleanup (or a discard) names it
            self.snapshots.append(recorded)
        snapshot = self.choose_snapshot(plan, journal, "manifest", {"prune": list(prune)})
        done = journal.recorded_done(snapshot)
        if done is not None and await self.replayable(plan, snapshot, done):
            # an earlier run of this pull listed the workspace, admitted a content run
            # after it and was killed: that run may be resumed now, and a snapshot must
            # never be recorded with a listing taken after it read the files (an edit in
            # between would count as fetched, and no later pull would fetch it), so the
            # journaled listing is used again, not a fresh one
            log.info("manifest replayed from the journal", snapshot=snapshot)
            self.earlier_run = True
            self.listed(plan, inc, snapshot, done)
            if not skip:
                await self.replay(plan, inc)
            return
        if journal.meta is not None and (journal.has_done() or self.options.dry_run):
            # no run of that listing to resume, or the journal cannot give it back whole
            # (a lost or damaged chunk or record), or a dry run, which must list the
            # workspace as it is now: it neither adopts a listing still staged under that
            # id nor resumes one an earlier dry run was stopped in (a dry run has a journal
            # of its own, where only an earlier dry run can have left one).  The runs
            # admitted after it go with it, so that a fresh listing never meets an older
            # snapshot
            self.give_up(self.journal, self.journal.phase("select"))
            journal.forget()
            snapshot = self.choose_snapshot(plan, journal, "manifest", {"prune": list(prune)})
        journaled = await self.admit_phase(plan, journal, snapshot, "manifest", prune)

        def load(feed: ChunkFeed) -> None:
            if skip:
                while feed.read(1 << 20):
                    pass
            else:
                consume_feed(feed, plan.compressor, inc.load)

        await self.stream(plan, journal, journaled, load)
        assert self.done is not None
        journal.record_done(snapshot, self.done)
        self.listed(plan, inc, snapshot, self.done)
        # verified (and loaded, or loaded later from the journal): its staging goes in the
        # pull's last cleanup, with the content run's (one call; a discard after a
        # failure for good takes it too, a rerun that replays this listing names it
        # again).  A call of its own now would make the next call (the content run's
        # admission, the list's upload) wait for its helper or open another: a round trip
        # on a remote backend.  With keep_staging, which keeps the content run's, it goes
        # now, beside the diff
        if not self.options.keep_staging:
            return
        self.snapshots.remove(snapshot)
        self.manifest_cleanup = asyncio.create_task(self.clean_snapshot(snapshot))

    def listed(self, plan: GuestPlan, inc: Incremental, snapshot: str, done: DoneRecord) -> None:
        """This run's listing is ``snapshot``'s stream, ``done`` (fetched or replayed)."""
        self.done = done
        self.listing = _listing(snapshot, done)
        self.listed_at = time.monotonic()
        inc.manifest_digest = _manifest_digest(plan, done)

    async def after_listing_second(self, plan: GuestPlan, inc: Incremental, *, whole: bool) -> None:
        """Before a content run reads what the listing named, within a second of it: where
        a file it fetches may sit on a filesystem of whole seconds (a loaded listing names
        one with a ctime of whole seconds and no content digest: :meth:`PullState.racy`;
        a busybox listing, all of whose ctimes are whole seconds), wait until that second
        has passed; where the listing is not loaded yet (a first pull's late load: nothing
        to tell by), have the commit leave such files unrecorded instead
        (:attr:`Incremental.forget_racy`).

        Why: the state records a fetched file with the listing's record.  Read in the
        second it was listed in, and edited again in that second after the read (the size
        kept), the file kept its record, ctime included: DEST held the older bytes, and no
        later pull saw a difference.  Read a second later, any edit after the read is
        stamped in a later second than the record's (found by a red-team review)."""
        if self.listed_at is None:
            return
        wait = self.listed_at + 1.0 - time.monotonic()
        if wait <= 0:
            return
        if not inc.loaded:
            if plan.probe.has("find_printf"):
                inc.forget_racy = True
                return
        elif not await in_thread(lambda: inc.locked(lambda: inc.state.racy(whole=whole))):
            return
        log.debug("a fetched file may be stamped in whole seconds: waiting", seconds=wait)
        await asyncio.sleep(wait)

    # -- the early farm (wsync.engine.prefarm) ------------------------------------------

    def fetched(self, plan: GuestPlan, journal: Journal) -> None:
        """The manifest's bytes are in: start the early farm if a farm is likely needed."""
        inc, scan = self.inc, self.scan_task
        if journal is not self.manifest_journal or inc is None or self.done is None:
            return
        if scan is None or self.options.dry_run:
            return  # no baseline or no DEST, or no farm
        if not inc.baseline(plan, stdin=self.session.gate):
            return
        if inc.last_listing == _manifest_digest(plan, self.done):
            return  # the guest lists what it listed last time: most likely nothing to do
        if self.options.keep_prev:
            # a kept previous tree is the start: its walk is what can go ahead, from a
            # stamp of its filesystem's clock (what changes after it is walked again)
            since = self.target.fs_now()
            if since is None:
                return
            stop = self.walk_stop = threading.Event()

            def check() -> None:
                if stop.is_set():
                    raise Interrupted("the previous tree's walk stopped")

            names = [self.tmp_name, self.target.prev_name]
            walk = owned(self.target.parent_fd, lambda fd: inc.walk_ahead(fd, names, check, since))
            self.walk_task = asyncio.create_task(in_thread(walk))
            return
        self.early = Prefarm()
        self.early_ready = asyncio.Event()
        self.early_task = asyncio.create_task(self._early_farm(inc, scan, self.early))

    async def _early_farm(
        self, inc: Incremental, scan: asyncio.Task[None], farm: Prefarm
    ) -> tuple[str, int] | None:
        """Once DEST's scan is done: the tmp tree (name, fd), DEST's scan linked into it;
        None when the scan is not at hand (failed, too large to hold, or diffed already)."""
        ready = self.early_ready
        try:
            return await self._early_tree(inc, scan, farm, ready)
        except BaseException:
            farm.stop()  # cancelled (the loop is shutting down): the worker goes too
            raise
        finally:
            farm.settle()  # whatever happened, the diff must not wait for a build
            if ready is not None:
                ready.set()

    async def _early_tree(
        self,
        inc: Incremental,
        scan: asyncio.Task[None],
        farm: Prefarm,
        ready: asyncio.Event | None,
    ) -> tuple[str, int] | None:
        await asyncio.wait({scan})
        if scan.cancelled() or scan.exception() is not None:
            return None
        rows = inc.state.held_scan()
        if ready is not None:
            ready.set()  # the rows are ours (or not there): the diff may take them now
        if rows is None:
            return None
        tmp, tmp_fd, _ = await self.make_tmp(reuse=False)
        try:
            dest_fd = incremental.open_dest(self.target)
            if dest_fd is None:
                farm.broken = "DEST is gone"
                return tmp, tmp_fd

            def build(fd: int) -> None:
                try:
                    farm.build(rows, dest_fd, fd)
                finally:
                    os.close(dest_fd)

            log.debug("early farm", entries=len(rows))
            await in_thread(owned(tmp_fd, build))
            log.debug("early farm built", broken=farm.broken)
        except (WsyncError, OSError) as exc:
            farm.broken = str(exc)
        return tmp, tmp_fd

    async def take_early_farm(self) -> tuple[str, int, Prefarm] | None:
        """The early farm's tmp tree (name, fd) and its record, once it is built; None
        when there is none (or its tmp tree could not be made: the caller makes one)."""
        task, farm = self.early_task, self.early
        if task is None or farm is None:
            return None
        try:
            # shielded: a pull stopped while it waits leaves the task to drop_early_farm
            made = await asyncio.shield(task)
        except (WsyncError, OSError) as exc:
            log.debug("no early farm", error=str(exc))
            made = None
        self.early_task = self.early = None
        return None if made is None else (*made, farm)

    async def take_walk(self) -> None:
        """The previous tree's walk over (its rows with the state, or none: the reuse walks
        then).  The task stays known while it is waited for: a pull stopped here stops the
        walk too (:meth:`drop_early_farm`), never leaving it at work in the tree."""
        task = self.walk_task
        if task is not None:
            with contextlib.suppress(WsyncError, OSError):
                await asyncio.shield(task)
            self.walk_task = None

    async def drop_early_farm(self) -> bool:
        """Stop the early farm and remove its tree, or stop the previous tree's walk
        (nothing to do, a whole-tree run, a failure); True when there was a tree.
        Bounded: a tree left behind is removed by the next run's make_tmp."""
        walk, self.walk_task = self.walk_task, None
        if walk is not None and self.walk_stop is not None:
            self.walk_stop.set()
            await asyncio.wait({walk}, timeout=_WIND_DOWN_S)
        task, farm = self.early_task, self.early
        self.early_task = self.early = None
        if task is None or farm is None:
            return False
        farm.stop()
        farm.settle()
        if self.early_ready is not None:
            self.early_ready.set()
        done, _ = await asyncio.wait({task}, timeout=_WIND_DOWN_S)
        if not done or task.cancelled() or task.exception() is not None:
            return False
        made = task.result()
        if made is None:
            return False
        await self.remove_tmp(made[0])
        return True

    async def replayable(self, plan: GuestPlan, snapshot: str, done: DoneRecord) -> bool:
        """Whether the journaled listing ``done`` is to be used again: a content run
        admitted after it is journaled (else a fresh listing is newer and as good), this
        is no dry run (a preview shows the workspace as it is now), and the journal holds
        the listing whole."""
        if self.options.dry_run:
            return False
        listing = _listing(snapshot, done)
        runs = (self.journal.meta, self.journal.phase("select").meta)
        if not any(meta is not None and meta.get("after") == listing for meta in runs):
            return False
        return await in_thread(lambda: self.journaled_whole(plan, done))

    def journaled_whole(self, plan: GuestPlan, done: DoneRecord) -> bool:
        """Whether the journal holds all of ``done``'s stream, hashing as ``done`` says
        (worker thread; a manifest is small, so it is read twice rather than parsed
        before it is known whole)."""
        assert self.manifest_journal is not None
        chunks = self.manifest_journal.chunks()
        whole, length = plan.algorithm.new(), 0
        try:
            for seq in range(done.chunks):
                data = chunks[seq][1].read_bytes()
                if plan.algorithm.digest(data) != chunks[seq][0]:
                    return False
                whole.update(data)
                length += len(data)
        except (KeyError, OSError):
            return False
        return length == done.length and whole.hexdigest() == done.digest

    async def replay(
        self, plan: GuestPlan, inc: Incremental, done: DoneRecord | None = None
    ) -> None:
        """:meth:`replay_manifest` into the state in a worker thread.  A cancel aborts
        the feed, so the thread stops at its next read; the wait does not outlast it
        (:func:`~wsync.engine.winddown.in_thread`), and the thread's state is closed
        with the pull's.  ``done`` is the manifest's record (by default this run's: a
        late load names it, as the content run's record takes its place meanwhile)."""
        listing = done or self.done
        assert listing is not None
        await self._replayed(plan, listing, inc.load)

    async def count_listed(self, plan: GuestPlan, done: DoneRecord) -> int | None:
        """KiB of file bytes the journaled manifest ``done`` lists, without loading it;
        None where it cannot tell (the guest's ``du`` measures then, and the load reports
        what is wrong with the manifest)."""
        counter = manifest.ListedBytes()

        def count(stream: BinaryIO) -> None:
            while piece := stream.read(1 << 20):
                counter.receive_data(piece)

        try:
            await self._replayed(plan, done, count)
        except WsyncError:  # a ProtocolError too
            return None
        return -(-counter.total // 1024)

    async def _replayed(
        self, plan: GuestPlan, done: DoneRecord, use: Callable[[BinaryIO], None]
    ) -> None:
        """:meth:`replay_manifest` in a worker thread; a cancel aborts its feed (the
        thread stops at its next read)."""
        feed = ChunkFeed(plan.algorithm)
        try:
            await in_thread(lambda: self.replay_manifest(plan, feed, done, use))
        except BaseException:
            feed.abort("the pull stopped")
            raise

    def replay_manifest(
        self, plan: GuestPlan, feed: ChunkFeed, done: DoneRecord, use: Callable[[BinaryIO], None]
    ) -> None:
        """Decompress the verified manifest ``done`` from its journaled chunks into
        ``use`` (worker thread): the stream was only verified because the no-op shortcut
        might have applied, it is loaded late (module docstring), or it is an earlier
        run's listing."""
        assert self.manifest_journal is not None
        chunks = self.manifest_journal.chunks()
        for seq in range(done.chunks):
            if seq not in chunks:
                raise HostIOError(f"the manifest's chunk {seq} left the journal during the pull")
            feed.publish(seq, chunks[seq][1])
        feed.finish(done.chunks)
        try:
            consume_feed(feed, plan.compressor, use)
        finally:
            feed.close()
        if feed.length != done.length or feed.digest != done.digest:
            raise HostIOError("the journaled manifest changed on disk during the pull")

    # -- the late load ------------------------------------------------------------------

    def loads_late(self, plan: GuestPlan, inc: Incremental) -> bool:
        """Whether the manifest may load while the content run goes on: without a
        baseline, excludes or a dry run, that run is the whole tree whatever it lists.
        Not where a scan of DEST finished (a recorded state the guest cannot select
        from): the no-op shortcut may then apply, and the pull end before any content run
        (called after :meth:`open_incremental`, which stops a scan it does not need)."""
        if self.options.excludes or self.options.dry_run or inc.host_digest:
            return False
        return not inc.baseline(plan, stdin=self.session.gate)

    async def load_late(self) -> None:
        """Wait for the late load, if any (before the swap: the commit records it)."""
        task = self.late_load
        if task is not None:
            started = time.monotonic()
            await task
            self.late_load = None
            log.debug("manifest loaded late", waited=round(time.monotonic() - started, 3))
        await self.manifest_cleaned()

    async def manifest_cleaned(self) -> None:
        """Wait for the manifest's staging removal, if it runs (a failure is the pull's
        warning: :meth:`clean_snapshot`)."""
        cleanup, self.manifest_cleanup = self.manifest_cleanup, None
        if cleanup is not None:
            await cleanup

    async def drop_late_load(self) -> None:
        """Stop a late load still running (the pull failed, or has nothing to do), and
        the manifest's staging removal beside it (the GC takes the staging later)."""
        for task in (self.late_load, self.manifest_cleanup):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self.late_load = self.manifest_cleanup = None
