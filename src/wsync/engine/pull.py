"""Drive one pull: probe, manifest and diff, admit, fetch chunks in parallel, extract,
verify, swap, record the incremental state.

Where the guest can list its workspace, every pull begins with a manifest run and a diff
against what the last pull into DEST recorded (:mod:`wsync.engine.incremental`); then only
the changed entries are archived (a ``select`` run) and applied over a hardlink farm of
DEST's unchanged entries, or, without a baseline, the whole workspace as before.  Each
producer run is admitted, fetched and verified by :class:`~wsync.engine.phases.StreamRunner`.

The order of trust:

1. A chunk's bytes are believed when every read of it came back in a complete
   envelope whose hash matched, *and* the assembled chunk hashes to the value
   in the guest's index.  Then it is journaled durably, and only then counted.
2. The stream is believed when the index agrees with the ``done`` record
   (chunk count, total length) and the bytes the extractor consumed hash to
   the ``done`` record's whole-stream hash.
3. Only then is the extracted tree flushed and swapped into DEST.

Extraction runs in a worker thread while chunks are still arriving; it reads
journaled chunk files in order through :class:`~wsync.engine.feed.ChunkFeed`.
On any failure the half-extracted tree beside DEST is removed and DEST is
untouched; the journal stays, so the next run resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import structlog

from wsync.engine.api import ProgressCallback, PullOptions, PullResult
from wsync.engine.destcheck import check_dest
from wsync.engine.extract import ExtractStats
from wsync.engine.feed import ChunkFeed, extract_feed
from wsync.engine.finish import FinishRunner
from wsync.engine.fsutil import EarlyFlush, host_io, syncfs
from wsync.engine.helpers import HelperPool
from wsync.engine.incremental import Incremental
from wsync.engine.journal import DestRegistry, Journal
from wsync.engine.prefarm import Prefarm
from wsync.engine.settle import apply_lists
from wsync.engine.tarstream import show_name
from wsync.engine.winddown import in_thread, owned, raise_if_cancelled
from wsync.errors import (
    DestReplaced,
    HostileArchive,
    HostIOError,
    IntegrityFailed,
    Interrupted,
    LimitExceeded,
    ListMissing,
    StagingFailed,
    StagingGone,
    UnstableFiles,
    WsyncError,
)
from wsync.transports.base import Transport
from wsync.transports.registry import open_transport

log = structlog.get_logger("wsync.pull")

_T = TypeVar("_T")


class _Pull(FinishRunner):
    """One pull: the phases in order, the swap, and what follows it."""

    #: what ``finish`` and the result need, set the moment DEST is swapped: a stop that
    #: lands after it (say while the progress ticker is put away) is a success
    outcome: tuple[ExtractStats, int, int, str | None] | None = None

    async def run(self) -> tuple[ExtractStats, int, int, str | None] | None:
        """Everything up to and including the swap.  Returns what ``finish`` needs, or
        None when DEST stays as it is (nothing changed, or a dry run)."""
        self.emit("probe")
        self.start_early()
        try:
            plan = await self.session.probe(self.workspace)
            self.plan = plan
            inc = await self.open_incremental(plan)
            if inc is not None:
                await self.manifest_and_diff(plan, inc)
        except BaseException:
            await self.stop_scan()
            raise
        run = "tar"
        if inc is not None:
            if self.options.dry_run and inc.diff is not None:
                diff = inc.diff
                refused = await in_thread(lambda: inc.locked(diff.refused))
                if refused is not None:  # what the pull would fail with (exit 7)
                    raise HostileArchive(f"{show_name(refused[0])}: {refused[1]}")
                self.changes = await in_thread(lambda: inc.locked(lambda: list(diff.itemize())))
            run = inc.run
            if not run or self.options.dry_run:
                await self.drop_late_load()  # (a state recorded where the guest cannot select)
                # an early farm's make_tmp took the left-overs of earlier runs, and its own
                # tree may still be going in a thread: only without one are they swept
                sweep = self.early_task is None
                if await self.drop_early_farm():
                    # its links and unlinks moved the ctime of every inode of DEST
                    await in_thread(lambda: inc.locked(inc.refresh_after_farm))
                if not self.options.dry_run:
                    if sweep:
                        await self.sweep_leftovers()
                    # DEST is the tree the state records: its size (0 said "empty" in
                    # --json and in the daemon's wsync_tree_bytes_total)
                    with contextlib.suppress(WsyncError, OSError):
                        self.tree_bytes = await in_thread(lambda: inc.locked(inc.tree_bytes))
                return None
            if run == "tar" or inc.mode != "incremental":
                await self.drop_early_farm()  # a whole-tree run starts from an empty tree
        if run == "apply":
            return await self.apply_only(inc)
        journal = self.journal if run == "tar" else self.journal.phase("select")
        other = self.journal.phase("select") if run == "tar" else self.journal
        if other.meta is not None and not self.options.dry_run:
            # an earlier run of the other kind (a whole-tree run killed, rerun with an
            # exclude; or the other way round), which this one does not resume: its
            # staging goes with this pull's (a later run that could have resumed it, the
            # option put back under the same listing, fetches afresh: slower, never wrong)
            self.give_up(other)
        listing = b""
        extra: dict[str, Any] = {}
        if self.listing is not None:
            # a content run resumes only under the listing it was admitted after (which a
            # rerun replays): recorded with a later listing, a file edited in between
            # would count as fetched in a version DEST does not hold
            extra["after"] = self.listing
        if inc is not None and run == "select":
            listing = await in_thread(lambda: inc.locked(inc.select_list))
            extra["list"] = hashlib.sha256(listing).hexdigest()
        snapshot = self.choose_snapshot(plan, journal, run, extra)
        if run == "select":
            await self.upload(snapshot, listing)
        # a whole-tree run's room check in the guest takes the size the listing gave (or,
        # loaded late, its count)
        need = None
        if inc is not None:
            need = inc.state.listed_kb if inc.loaded else self.late_listed_kb
            await self.after_listing_second(plan, inc, whole=run == "tar")
        try:
            journaled = await self.admit_phase(plan, journal, snapshot, run, need_kb=need)
        except ListMissing:
            # its staging went between the upload and the admission: the admission of a
            # killed run of this pull that removed it once its stream was out (it never
            # reached us), or a wiped /tmp.  Once more, the list first
            await self.upload(snapshot, listing)
            journaled = await self.admit_phase(plan, journal, snapshot, run, need_kb=need)
        replace = run == "select"
        tmp, tmp_fd, reused, early = await self.farm_tmp(reuse=replace and self.keeps_prev)
        hook = None
        if inc is not None:
            inc.hashes.start()
            hook = inc.hashes.add

        # the extractor's own fd on the tree: a thread given up on after a failure must
        # never act through a closed fd whose number the process reuses meanwhile
        work_fds = [os.dup(tmp_fd)]
        # worker threads at work in the tree after the extractor (a cancelled wait leaves
        # one running: see drop_tmp)
        in_tree: list[threading.Event] = []

        async def tree_work(work: Callable[[int], object]) -> None:
            done = threading.Event()
            in_tree.append(done)
            inner = owned(tmp_fd, work)

            def run() -> None:
                try:
                    inner()
                finally:
                    done.set()

            await in_thread(run)

        def extract(feed: ChunkFeed) -> ExtractStats:
            fd = work_fds.pop()
            try:
                if inc is not None and replace:
                    check = feed.check_cancel
                    inc.locked(lambda: inc.farm(fd, check, reused=reused, early=early))
                limits = self.options.limits
                return extract_feed(
                    feed, plan.compressor, fd, limits, self.extracted, replace=replace, on_file=hook
                )
            finally:
                os.close(fd)

        try:
            flush = EarlyFlush(tmp_fd)
            try:
                self.emit("pull")
                stats, chunks, length = await self.stream(plan, journal, journaled, extract)
            finally:
                flush.stop()
                for fd in work_fds:  # the extractor never started
                    os.close(fd)
                work_fds.clear()
            if inc is not None:
                inc.hashes.close()
            self.unstable = await apply_lists(
                self.session, self.done, self.sizer, tmp_fd, self.options.best_effort, self.warnings
            )
            if inc is not None and replace:
                self.emit("apply")
                await tree_work(lambda fd: inc.locked(lambda: inc.join_groups(fd)))
                await tree_work(lambda fd: inc.locked(lambda: inc.dir_meta(fd)))
            # the manifest, when it loaded while the content run went on: a listing that
            # does not load fails the pull here, DEST untouched
            await self.load_late()
            if inc is not None:
                await tree_work(lambda fd: inc.locked(lambda: inc.note_tree(fd)))
            old = self.swap_in(tmp, tmp_fd)
            self.outcome = (stats, chunks, length, old)
        except BaseException as exc:
            # a wait cancelled while a worker thread was at work in the tree leaves it
            # running there; a write into the tree that failed (exactly HostIOError: its
            # subclasses name host conditions the next run resumes past, DiskLow say)
            # would fail again
            busy = any(not done.is_set() for done in in_tree)
            await self.drop_tmp(tmp, reused, busy=busy, broken=type(exc) is HostIOError)
            raise
        return self.outcome

    def swap_in(self, tmp: str, tmp_fd: int) -> str | None:
        """Flush the finished tree, then make it DEST; returns the old tree's name."""
        self.emit("swap")
        with host_io(f"flushing {self.dest.parent / tmp}"):
            syncfs(tmp_fd)
        if self.options.fence is not None:
            self.options.fence()  # last word of a daemon fleet's lease before the swap
        # recorded before the swap: a kill right after it must not make
        # the next run refuse a DEST that wsync itself just wrote
        registry = DestRegistry(self.options.state_dir)
        registry.record(self.dest)
        try:
            old = self.target.swap(tmp)
        except DestReplaced:
            registry.forget(self.dest)  # what is there now is not ours
            raise
        self.swapped = True
        if self.manifest_journal is not None:
            # its listing is in DEST now: a rerun after a kill from here on lists afresh
            # (and finds the state committed, or diffs the new DEST against the old state).
            # DEST is the new tree already: a failure from here on is a warning, never the
            # pull's error (an error promises DEST untouched)
            try:
                self.manifest_journal.forget()
            except WsyncError as exc:
                self.warnings.append(f"the journal's listing was not cleared: {exc}")
        return old

    async def farm_tmp(self, *, reuse: bool) -> tuple[str, int, bool, Prefarm | None]:
        """:meth:`make_tmp`, or the early farm's tree when there is one (with its record)."""
        taken = await self.take_early_farm()
        if taken is not None:
            tmp, tmp_fd, early = taken
            return tmp, tmp_fd, False, early
        await self.take_walk()
        tmp, tmp_fd, reused = await self.make_tmp(reuse=reuse)
        return tmp, tmp_fd, reused, None

    async def apply_only(
        self, inc: Incremental | None
    ) -> tuple[ExtractStats, int, int, str | None]:
        """Changes without an entry to fetch (deletions, directory modes or mtimes, a
        host-side chmod of a directory): the new tree is the farm alone, no producer run."""
        assert inc is not None
        tmp, tmp_fd, reused, early = await self.farm_tmp(reuse=self.keeps_prev)
        inc.hashes.start()
        inc.hashes.close()
        stop = threading.Event()

        def check() -> None:
            if stop.is_set():
                raise Interrupted("pull stopped")

        try:
            self.emit("apply")
            await in_thread(
                owned(
                    tmp_fd,
                    lambda fd: inc.locked(lambda: inc.farm(fd, check, reused=reused, early=early)),
                )
            )
            await in_thread(owned(tmp_fd, lambda fd: inc.locked(lambda: inc.dir_meta(fd))))
            await in_thread(owned(tmp_fd, lambda fd: inc.locked(lambda: inc.note_tree(fd))))
            old = self.swap_in(tmp, tmp_fd)
            self.outcome = (ExtractStats(), 0, 0, old)
        except BaseException:
            stop.set()
            # the farm's thread is not waited for: it may still be at work in the tree
            await self.drop_tmp(tmp, reused, busy=True)
            raise
        return self.outcome

    async def drop_tmp(
        self, tmp: str, reused: bool, *, busy: bool = False, broken: bool = False
    ) -> None:
        """After a failure: a reused tree stays for the next run (it is as good a start as
        it was), unless a worker may still be at work in it (``busy``, or stuck), or the
        reuse itself or a host write failed (``broken``: it would fail again, as a kept
        directory made immutable did on every later pull); any other goes
        (:meth:`remove_tmp` gives it a stale name first, so no later pull takes it for
        its own)."""
        reuse_failed = self.inc is not None and self.inc.reuse_failed
        if not reused or busy or broken or self.stuck or reuse_failed:
            await self.remove_tmp(tmp)

    async def upload(self, snapshot: str, listing: bytes) -> None:
        """The select run's list, once more where the guest refused it: a killed run of
        this pull may still be removing that snapshot's staging (the admission that
        carried its stream whole), under the upload."""
        try:
            await self.session.upload_list(snapshot, listing)
        except StagingFailed as exc:
            log.info("list upload refused; once more", error=str(exc))
            await self.session.upload_list(snapshot, listing)


#: failures that the same snapshot would repeat on every run: it is discarded at once
_PERMANENT = (StagingFailed, HostileArchive, UnstableFiles)


async def _attempt(runner: _Pull) -> tuple[ExtractStats, int, int, str | None]:
    try:
        return await _attempt_phases(runner)
    finally:
        # every path ends the journal's writer threads (a pull with nothing to swap, a dry
        # run, a failure): they are daemon threads that would wait for work forever, one
        # set a pull in a daemon process.  Every write was awaited on success; after a
        # failure none is waited for here (the wind-down waited, with a bound)
        runner.io.shutdown(wait=False)


async def _attempt_phases(runner: _Pull) -> tuple[ExtractStats, int, int, str | None]:
    async with runner.ticking():
        try:
            done = await runner.run()
        except _PERMANENT as exc:
            # the manifest's staging removal, started when its stream was in (with
            # keep_staging), is let finish: the guest's disk may be what failed, and must
            # not stay full until the GC (it is bounded by the call's own deadline, as the
            # discard below is, which otherwise takes the manifest's staging too)
            try:
                await runner.manifest_cleaned()
            except Exception as cleanup_error:  # the pull's own error is the one reported
                log.warning("manifest staging not removed", error=str(cleanup_error))
            await runner.drop_late_load()
            await runner.drop_early_farm()  # a no-op once the run took its tree
            # a host limit (disk space, --max-bytes) is not the snapshot's fault: the
            # next run, with room made or the limit raised, resumes it
            if isinstance(exc, LimitExceeded):
                if not runner.options.dry_run:
                    # (what lets the next run under the same limits give that snapshot
                    # up: see _pull)
                    with contextlib.suppress(WsyncError):
                        runner.journal.record_refusal()
                await runner.clean_other_runs()
            else:
                await runner.discard()  # (the manifest's staging with it)
            if runner.inc is not None:
                runner.inc.close()
            raise
        except BaseException:
            await runner.drop_late_load()
            await runner.drop_early_farm()
            if runner.inc is not None:
                runner.inc.close()
            raise
    # nothing to do (or a dry run): DEST stays as it is
    return done if done is not None else (ExtractStats(), 0, 0, None)


#: how long closing the transport may take once the pull is over
_CLOSE_S = 10.0


async def pull(
    transport: Transport,
    workspace: str,
    dest: Path,
    options: PullOptions,
    *,
    sandbox: str | None = None,
    on_progress: ProgressCallback | None = None,
) -> PullResult:
    """Pull ``workspace`` from the guest behind ``transport`` into ``dest``, exactly.

    Raises a :class:`~wsync.errors.WsyncError` on failure (DEST untouched).
    """
    # one more helper than parallel reads: a status long poll runs beside them
    helpers = HelperPool(transport, options.parallel + 1) if options.helpers else None
    result: PullResult | None = None
    try:
        result = await _pull(transport, workspace, dest, options, sandbox, on_progress, helpers)
    finally:
        if helpers is not None:
            # shielded: a second stop (the daemon cancels a job twice when it shuts down)
            # must not leave helpers half closed; the close is bounded per helper
            try:
                await asyncio.shield(helpers.aclose())
            except asyncio.CancelledError:
                if result is None:
                    raise
                # DEST is swapped: a stop that lands while the helpers close is the
                # success it follows (the shielded close goes on)
    return result


async def _pull(
    transport: Transport,
    workspace: str,
    dest: Path,
    options: PullOptions,
    sandbox: str | None,
    on_progress: ProgressCallback | None,
    helpers: HelperPool | None,
) -> PullResult:
    started = time.monotonic()
    sandbox = sandbox or transport.description
    target = check_dest(Path(dest), transport, workspace, options)
    real = target.path
    journal = Journal(
        options.state_dir, sandbox, real, options.limits.min_free_bytes, target,
        dry_run=options.dry_run,
    ).open()  # fmt: skip
    runner = _Pull(transport, workspace, real, options, journal, on_progress, helpers=helpers)
    runner.deadline = started + options.timeout if options.timeout > 0 else None
    try:
        if options.restart and not options.dry_run:
            journal.restart()
        # what the last cleanup of this run (of any, until one succeeds) removes too
        forgotten = [] if options.dry_run else journal.forgotten()
        # the snapshots a host limit refused in an earlier run (before this run's own)
        refused = set() if options.dry_run else journal.refused()
    except BaseException:
        journal.close()
        raise
    runner.snapshots.extend(forgotten)

    def afresh(warning: str, error: Exception) -> _Pull:
        """The run that takes the place of one given up on: a fresh snapshot, once."""
        raise_if_cancelled()  # no fresh start for a pull being stopped
        log.warning("starting a fresh snapshot", why=warning, error=str(error))
        fresh = _Pull(
            transport, workspace, real, options, journal, on_progress, runner.stats, helpers
        )
        # (read again: this run may have named more, abandoning an earlier run's snapshot)
        fresh.snapshots.extend(journal.forgotten())
        fresh.warnings.append(f"{warning} ({error}); started afresh")
        fresh.deadline = runner.deadline
        return fresh

    try:
        async with asyncio.timeout(options.timeout or None):
            try:
                stats, chunks, length, old = await _attempt(runner)
            except StagingFailed as exc:
                # a snapshot whose staging is gone where admissions remove the staging of
                # what they carry whole: an admission attempt given up on (a deadline)
                # removed it under its retry (a select run's producer may then have found
                # its list gone: the retry's admission made the snapshot again), or the
                # guest's base64 encoded other bytes than it did for the probe: afresh
                # once, no admission removing anything
                cleaned = runner.asked_clean and isinstance(exc, StagingGone | ListMissing)
                if not runner.reconciled and not cleaned:
                    raise
                # we adopted a snapshot from an earlier run and it had failed or
                # died, or ours is gone (and is now discarded)
                lost = "a snapshot's guest staging was lost"
                runner = afresh(lost if cleaned else "an adopted snapshot had failed", exc)
                runner.self_clean = not cleaned
                stats, chunks, length, old = await _attempt(runner)
            except LimitExceeded as exc:
                # a snapshot an earlier run left, over this run's limits: kept so that a
                # raised limit resumes it, it failed the same way on every run while the
                # limit stood, even after the workspace shrank (a daemon stuck until the
                # staging's TTL).  Refused twice, it gives way to the workspace as it is
                # now, as --restart does (Journal.give_way: not a first refusal, nor too
                # soon after the last fresh start)
                if not runner.earlier_run or options.dry_run:
                    raise
                raise_if_cancelled()  # (before anything is forgotten)
                if not journal.give_way(refused, time.time()):
                    raise
                runner = afresh("the snapshot an earlier run left is over this run's limits", exc)
                stats, chunks, length, old = await _attempt(runner)
    except TimeoutError:
        journal.close()
        late = IntegrityFailed(
            f"the overall deadline of {options.timeout:g}s passed; run again to resume"
        )
        late.so_far = _so_far(runner)
        raise late from None
    except asyncio.CancelledError as exc:
        if runner.outcome is None:
            journal.close()
            exc.so_far = _so_far(runner)  # type: ignore[attr-defined]
            raise
        # stopped between the swap and the cleanup (the ticker being put away): DEST is
        # complete, so this is the success below, as a stop during the cleanup is
        stats, chunks, length, old = runner.outcome
        stopped = True
    except BaseException as exc:
        journal.close()
        with contextlib.suppress(AttributeError, TypeError):  # a few built-ins take none
            exc.so_far = _so_far(runner)  # type: ignore[attr-defined]
        raise
    else:
        stopped = False
    try:
        if not stopped:
            async with runner.ticking():
                await runner.finish(old)
    except asyncio.CancelledError:
        stopped = True
    finally:
        if stopped:
            # DEST was swapped: it is complete and exact, so a stop from here on is a
            # success, not an interruption (the CLI exits 0).  The journal goes (the
            # next run must take a fresh snapshot, not resume this finished one); the
            # old tree and the guest staging are left to the next run and the GC.
            runner.warnings.append("stopped while cleaning up; DEST is complete")
            with contextlib.suppress(WsyncError):
                journal.remove()
        if runner.inc is not None:
            runner.inc.close()
        journal.close()
    runner.emit("done", force=True)
    inc = runner.inc
    files = stats.files + stats.symlinks + stats.hardlinks
    return PullResult(
        ok=True,
        sandbox=sandbox,
        dest=str(real),
        reconciled=runner.earlier_run,
        files=files,
        bytes=length,
        chunks=chunks,
        **_so_far(runner),
        elapsed_s=time.monotonic() - started,
        unstable_files=runner.unstable,
        mode=inc.mode if inc is not None else "full",
        # a dry run extracts nothing: its count is the diff's, as its itemized lines are
        changed_files=(
            inc.changed if inc is not None and (inc.mode != "full" or options.dry_run) else files
        ),
        deleted_files=inc.deleted if inc is not None else 0,
        tree_bytes=runner.tree_bytes,
        changes=runner.changes,
        compress_level=runner.compress_level,
        link_bytes_per_s=round(runner.session.link.rate() or 0),
    )


def _so_far(runner: _Pull) -> dict[str, Any]:
    """What a pull did: part of its result, and of a failed one's ``--json`` result too
    (an operator wants the retries and faults of a pull that gave up more than of one
    that succeeded, and its warnings: a fresh start that failed too says why it was
    made)."""
    return {
        "snapshot": runner.progress.snapshot,
        "transferred_bytes": runner.stats.transferred,
        "execs": runner.stats.execs,
        "resumed_chunks": runner.progress.resumed_chunks,
        "retries": runner.stats.retries,
        "faults": dict(runner.stats.faults),
        "warnings": list(runner.warnings),
    }


async def pull_uri(
    uri: str,
    dest: Path,
    options: PullOptions,
    transport_options: Mapping[str, Any] | None = None,
    *,
    on_progress: ProgressCallback | None = None,
) -> PullResult:
    """Open the transport named by ``uri`` and pull its workspace into ``dest``."""
    started = time.monotonic()
    parsed, transport = open_transport(uri, transport_options)
    result: PullResult | None = None
    try:
        result = await pull(
            transport, parsed.path, dest, options, sandbox=parsed.raw, on_progress=on_progress
        )
        return result
    finally:
        # bounded: a close that hangs (a dead ssh connection, a backend's kill of the
        # guest's readers) must not hold a finished or cancelled pull, nor run past the
        # overall deadline by more than a second; the connection dies with its process
        budget = _CLOSE_S
        if options.timeout > 0:
            budget = min(budget, max(1.0, options.timeout - (time.monotonic() - started)))
        try:
            async with asyncio.timeout(budget):
                await transport.aclose()
        except TimeoutError:
            log.warning("closing the transport timed out", sandbox=parsed.raw)
        except asyncio.CancelledError:
            if result is None:
                raise
            # the pull returned: DEST is swapped, and a stop that lands while the
            # transport closes is that success (the CLI exits 0), never an interruption
