"""The machinery every producer run of a pull shares: admit, fetch, verify, consume.

A pull runs the guest producer once or twice (issue 8): a ``manifest`` run, then a
``tar`` or ``select`` run.  Each is admitted under its own journal (phase), its chunks
fetched in parallel with the same verified reads, journaled durably, and fed in order to
a consumer thread (the extractor, or the manifest loader) while they still arrive; the
whole stream is checked against the guest's ``done`` record before anything is believed.
See :mod:`wsync.engine.pull` for the order of trust.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from wsync.engine.api import GiB, Progress, ProgressCallback, PullOptions
from wsync.engine.extract import ExtractStats
from wsync.engine.feed import ChunkFeed
from wsync.engine.guest import GuestPlan, GuestSession
from wsync.engine.guestcall import CallStats
from wsync.engine.helpers import HelperPool
from wsync.engine.incremental import Incremental
from wsync.engine.journal import Journal
from wsync.engine.linkmemo import remembered
from wsync.engine.winddown import (
    WriterPool,
    await_future,
    await_thread,
    in_thread,
    raise_if_cancelled,
)
from wsync.errors import (
    BYTES_KNOB,
    IntegrityFailed,
    LimitExceeded,
    ListMissing,
    ProducerVanished,
    StagingFailed,
    StagingGone,
    UsageError,
    first_error,
)
from wsync.protocol import level, scripts
from wsync.protocol.policy import MIN_TEXT_READ, ReadSizer
from wsync.protocol.records import Chunk, DoneRecord, IndexParser
from wsync.protocol.scripts import BLOCK
from wsync.transports.base import Transport

log = structlog.get_logger("wsync.pull")

_T = TypeVar("_T")

_INDEX_READ = 1024 * 1024
#: the largest listing (manifest run) fetched: some 30 bytes a compressed entry, so room
#: for hundreds of millions of entries, and a bound on the chunks it may queue
MAX_LISTING = 16 * GiB
_POLL_MIN, _POLL_MAX = 0.05, 1.0
#: how long a status call may wait in the guest for the next chunk, seconds
_LONG_POLL = 1.0
#: the long poll an admission through a helper carries: long enough for a small run to
#: finish (20-40 ms) or a big one to index its first chunk (about 0.1 s), short enough
#: that the host's own setup after the admission (the journal's check, the tmp tree)
#: does not wait on a slow producer
_CARRIED_POLL = 0.1
_DEAD_CONFIRMATIONS = 3
#: progress is emitted at least this often, events or not (counters move between events)
_TICK = 0.5


class _ExtractorStopped(Exception):
    """Internal: the extractor thread ended before the stream did."""


def new_snapshot_id() -> str:
    return time.strftime("s%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(4)


#: how long a failing or cancelled pull waits for its threads before it leaves them
_WIND_DOWN_S = 10.0


class StreamRunner:
    """The state of one pull shared by its producer runs (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        workspace: str,
        dest: Path,
        options: PullOptions,
        journal: Journal,
        on_progress: ProgressCallback | None,
        stats: CallStats | None = None,
        helpers: HelperPool | None = None,
    ) -> None:
        self.transport = transport
        self.workspace = workspace
        self.dest = dest
        self.options = options
        self.journal = journal
        #: DEST's parent fd and the DEST lock (closed with the journal)
        if journal.dest_dir is None:
            raise ValueError("a pull's journal must carry its DestDir (see check_dest)")
        self.target = journal.dest_dir
        self.on_progress = on_progress
        self.stats = stats or CallStats()
        self.session = GuestSession(transport, options, self.stats, helpers)
        # text channels carry base64, 4/3 the bytes: let reads go below one block there
        minimum = MIN_TEXT_READ if not transport.capabilities.binary_safe else BLOCK
        self.sizer = ReadSizer(options.chunk_size, minimum=minimum)
        self.progress = Progress()
        #: counted into by the extractor thread while it runs (progress reads it)
        self.extracted = ExtractStats()
        self.warnings: list[str] = []
        #: the pull's overall deadline (``time.monotonic()``; None: none), which bounds
        #: the guest cleanup that runs after the swap, outside the timeout around the rest
        self.deadline: float | None = None
        #: the latest admission adopted a snapshot an earlier run had started
        self.reconciled = False
        #: this pull delivers an interrupted earlier run's work: it adopted a snapshot, or
        #: used a listing again from the journal (the tree is the workspace as listed then;
        #: what changed since comes with the next pull, and the result must say so)
        self.earlier_run = False
        self.last_emit = 0.0
        self.done: DoneRecord | None = None
        #: the run's stream, when a status carried it whole (small runs: no read calls)
        self.inline: bytes | None = None
        #: and the guest removed its staging then: nothing is left there to read
        self.inline_cleaned = False
        #: admissions may ask the guest to remove the staging of a stream they carry whole
        #: (off for a fresh start after one vanished under a retried admission: see pull)
        self.self_clean = True
        #: an admission asked for that
        self.asked_clean = False
        #: files taken as last read although they kept changing (best effort only)
        self.unstable: list[str] = []
        #: journal writes run here, so that a cancelled pull can wait for the
        #: writes in flight before it releases the journal (to_thread cannot)
        self.io = WriterPool(
            max_workers=max(1, options.parallel), thread_name_prefix="wsync-journal"
        )
        #: the journal (or journal phase) the chunks being fetched go to
        self.chunk_journal = journal
        #: every snapshot this run admitted (cleaned up at the end)
        self.snapshots: list[str] = []
        self.inc: Incremental | None = None
        self.swapped = False
        #: the consumer thread outlived the wind-down: its tmp tree is left to the next run
        self.stuck = False
        self.tree_bytes = 0
        #: the manifest phase's journal (its stream is not bounded by ``max_bytes``, which
        #: bounds file bytes; the entry count is bounded by ``max_files`` as it loads)
        self.manifest_journal: Journal | None = None
        self.changes: list[str] = []
        #: the archive's compression level, once admitted
        self.compress_level = 0

    # -- progress ----------------------------------------------------------------

    def emit(self, phase: str | None = None, *, force: bool = False) -> None:
        p = self.progress
        if phase:
            if phase != p.phase:
                log.debug("phase", phase=phase)
            p.phase = phase
        p.retries = self.stats.retries
        p.transferred_bytes = self.stats.transferred
        p.faults = dict(self.stats.faults)
        x = self.extracted
        p.files = x.files + x.symlinks + x.hardlinks
        now = time.monotonic()
        if self.on_progress and (force or phase or now - self.last_emit > 0.1):
            self.last_emit = now
            self.on_progress(p)

    @contextlib.asynccontextmanager
    async def ticking(self) -> AsyncIterator[None]:
        """Emit every ``_TICK`` seconds meanwhile: retries, faults and the extractor's
        file count change while no chunk arrives (a hanging call, a resume's extract)."""

        async def tick() -> None:
            while True:
                await asyncio.sleep(_TICK)
                self.emit()

        task = asyncio.create_task(tick())
        try:
            yield
        finally:
            task.cancel()
            # gather: the ticker's own cancellation is a result, the caller's propagates
            await asyncio.gather(task, return_exceptions=True)

    # -- the pull ------------------------------------------------------------------

    async def admit_phase(
        self,
        plan: GuestPlan,
        journal: Journal,
        snapshot: str,
        mode: str,
        prune: tuple[str, ...] = (),
        need_kb: int | None = None,
    ) -> dict[int, tuple[str, Path]]:
        """Admit ``snapshot``'s producer run; return the journal's chunks still good."""
        # the counters are per producer run: a manifest's chunks are not the archive's
        self.progress = dataclasses.replace(
            Progress(), phase=self.progress.phase, snapshot=snapshot
        )
        # every later log line of this pull (workers inherit the context) names it
        structlog.contextvars.bind_contextvars(snapshot=snapshot)
        self.chunk_journal = journal
        if journal is not self.manifest_journal:  # the manifest run shows as one phase
            self.emit("admit")
        self.snapshots.append(snapshot)
        chosen = await self.choose_level(plan, manifest=journal is self.manifest_journal)
        # (a guest base64 that encodes other bytes keeps its staging: the host reads what
        # its copy got wrong)
        clean = self.self_clean and not self.options.keep_staging
        clean = clean and plan.probe.has("base64_exact")
        self.asked_clean = self.asked_clean or clean
        self.reconciled = await self.session.admit(
            snapshot,
            self.workspace,
            plan.compressor,
            level=chosen,
            mode=mode,
            prune=prune,
            need_kb=need_kb,
            status_wait=_CARRIED_POLL,
            clean=clean,
        )
        first = self.session.first_status
        if first is not None and first.cleaned:
            # its stream came whole and its staging is gone: no cleanup call for it
            self.snapshots = [s for s in self.snapshots if s != snapshot]
        self.earlier_run = self.earlier_run or self.reconciled
        if journal is not self.manifest_journal:
            # an adopted producer kept the level an earlier run gave it
            self.compress_level = 0 if self.reconciled else chosen
        journaled = journal.chunks()
        if journaled and not self.reconciled:
            # the guest staging is gone and a new producer started: its stream
            # differs from the one our chunks came from, so they are worthless
            log.info("guest staging restarted; discarding journaled chunks", n=len(journaled))
            journal.clear_chunks()
            journaled = {}
        if journaled:
            found = journaled
            journaled = await in_thread(lambda: Journal.intact(found, plan.algorithm.digest))
        return journaled

    async def choose_level(self, plan: GuestPlan, *, manifest: bool) -> int:
        """This producer run's compression level: pinned, or from the link's measured
        speed (:mod:`wsync.protocol.level`).  The manifest run's is fixed: the no-op
        shortcut compares its compressed stream with the last pull's."""
        pinned = self.options.compress_level
        if pinned is not None and pinned not in level.LEVELS:
            raise UsageError(f"compression level {pinned} is not 1-19")
        if plan.compressor == "gzip":
            # gzip's higher levels cost several times the CPU for a few percent
            return min(pinned, level.GZIP_MAX) if pinned is not None and not manifest else 1
        if manifest:
            return level.DEFAULT
        if pinned is not None:
            return pinned
        # (looked up once a run: only the content run's admission gets here)
        key, state_dir = self.transport.description, self.options.state_dir
        known = await in_thread(lambda: remembered(state_dir, key))
        link = self.session.link
        measured, ceiling = link.rate(), link.ceiling()
        chosen = level.choose(link.meter.bytes, measured, known, run_ceiling=ceiling)
        log.debug(
            "compression level",
            level=chosen,
            measured=measured,
            ceiling=ceiling,
            measured_bytes=link.meter.bytes,
            latency=link.latency,
            remembered=known,
        )
        return chosen

    async def stream(
        self,
        plan: GuestPlan,
        journal: Journal,
        journaled: dict[int, tuple[str, Path]],
        consume: Callable[[ChunkFeed], _T],
    ) -> tuple[_T, int, int]:
        """Fetch the admitted snapshot's stream while ``consume`` reads it in a thread;
        verify the whole stream; return what ``consume`` returned, chunks and length."""
        feed = ChunkFeed(plan.algorithm)
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["value"] = consume(feed)
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=work, name="wsync-extract", daemon=True)
        thread.start()
        self.chunk_journal = journal
        try:
            chunks, length = await self.fetch_all(plan, feed, journaled, thread)
            self.fetched(plan, journal)
            if journal is not self.manifest_journal:
                self.emit("extract")
            await await_thread(thread, None)
            raise_if_cancelled()  # a cancel swallowed on the way must not swap DEST
            if "error" in box:
                raise box["error"]
            assert self.done is not None
            if feed.length != length or feed.digest != self.done.digest:
                raise IntegrityFailed(
                    f"whole stream: {feed.length} bytes hashing to {feed.digest[:16]}…, "
                    f"guest says {length} bytes hashing to {self.done.digest[:16]}…"
                )
            return box["value"], chunks, length
        except BaseException as exc:
            await self.wind_down(feed, thread)
            if isinstance(exc, _ExtractorStopped) and "error" in box:
                raise box["error"] from None
            raise
        finally:
            feed.close()

    def fetched(self, plan: GuestPlan, journal: Journal) -> None:
        """Every chunk of ``journal``'s stream is in (``self.done`` says what it is), and
        its consumer may still be at work: a hook for work that can overlap the rest."""

    async def wind_down(self, feed: ChunkFeed, thread: threading.Thread) -> None:
        """After a failure or a cancel: stop the consumer thread and the journal writers.

        This runs on the event loop while the pull is being cancelled, so it never
        blocks it: a cancelled CLI pull must exit within a second or two and the
        daemon's loop keeps serving.  The extractor sees ``feed.abort`` at its next
        read or ``check_cancel`` (milliseconds); journal writes in flight finish
        their fsync+rename (a chunk either counts or leaves a temp file the next
        run deletes).  Each wait is polled with a bound, never joined: what is
        still running after :data:`_WIND_DOWN_S` is left to finish or die with the
        process (daemon threads), and so is the tmp tree, which the next run removes
        before it extracts.  Never :func:`asyncio.to_thread` here: the default
        executor is joined without a bound by ``asyncio.run`` and at exit.
        """
        feed.abort("pull stopped")
        self.io.shutdown(wait=False, cancel_futures=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _WIND_DOWN_S
        if not await await_thread(thread, _WIND_DOWN_S):
            log.warning("the extractor is still running; its partial tree stays")
            self.stuck = True
            return
        for write in list(self.io.pending):
            if not await await_future(write, deadline - loop.time()):
                log.warning("a journal write is still running")
                break

    async def fetch_all(
        self,
        plan: GuestPlan,
        feed: ChunkFeed,
        journaled: dict[int, tuple[str, Path]],
        thread: threading.Thread,
    ) -> tuple[int, int]:
        """Follow the guest index until ``done``; fetch every chunk; return (chunks, length)."""
        queue: asyncio.Queue[Chunk | None] = asyncio.Queue()
        index = IndexParser(plan.algorithm, self.options.chunk_size)
        # another run's (a manifest's) never stands in for this one's
        self.inline, self.inline_cleaned = None, False
        limits = self.options.limits
        try:
            async with asyncio.TaskGroup() as group:
                workers = [
                    group.create_task(self.worker(queue, feed, plan))
                    for _ in range(max(1, self.options.parallel))
                ]
                poll, dead, dead_since = _POLL_MIN, 0, 0.0
                wait = _LONG_POLL
                # the first status may have come with the admission (through a helper)
                first, self.session.first_status = self.session.first_status, None
                done: DoneRecord | None = None
                while True:
                    if first is not None:
                        status, first = first, None
                    else:
                        # before any chunk is read, a small finished stream may come whole
                        inline = scripts.STATUS_INLINE_MAX if index.consumed == 0 else 0
                        status = await self.session.status(index.consumed, wait, inline)
                    if not status.exists:
                        raise StagingGone("the guest staging directory disappeared")
                    if status.failed == "no list":  # (a select run's producer, said short)
                        raise ListMissing("the list of entries to archive is missing")
                    if status.failed is not None:
                        raise StagingFailed(status.failed)
                    if status.inline is not None or status.cleaned:
                        self.inline, self.inline_cleaned = status.inline, status.cleaned
                    self.progress.archive_produced = status.data_size
                    grew = index.consumed < status.index_size
                    for chunk in index.receive_data(status.index_tail):
                        self.admit_chunk(chunk, journaled, queue, feed)
                    self.check_size(index.next_offset, limits.max_bytes)
                    while index.consumed < status.index_size:
                        n = min(_INDEX_READ, status.index_size - index.consumed)
                        data = await self.session.read("index", index.consumed, n, self.sizer)
                        for chunk in index.receive_data(data):
                            self.admit_chunk(chunk, journaled, queue, feed)
                        # at every read: the index size is the guest's word, and an index
                        # of a thousand terabytes whose chunks are never served would
                        # queue chunks until the host's memory ran out
                        self.check_size(index.next_offset, limits.max_bytes)
                    if status.done is not None:
                        done = status.done
                        break
                    if not thread.is_alive():
                        raise _ExtractorStopped  # stop fetching; run() reports why
                    if status.alive:
                        dead = 0
                    else:
                        dead += 1
                        dead_since = dead_since if dead > 1 else time.monotonic()
                        if dead >= _DEAD_CONFIRMATIONS and time.monotonic() - dead_since > 5:
                            raise ProducerVanished("the guest producer died without a result")
                    self.emit()
                    if status.alive:
                        # the next status waits in the guest for the index to grow (a
                        # long poll): no sleep here, no exec while nothing happens
                        wait = _LONG_POLL
                        continue
                    wait = 0.0
                    await asyncio.sleep(poll)
                    poll = _POLL_MIN if grew else min(_POLL_MAX, poll * 1.5)
                if not index.clean or index.next_seq != done.chunks:
                    raise IntegrityFailed(
                        f"index lists {index.next_seq} chunks, done record says {done.chunks}"
                    )
                if index.next_offset != done.length:
                    raise IntegrityFailed(
                        f"index covers {index.next_offset} bytes, done record says {done.length}"
                    )
                self.check_tar(plan, done.tar_rc, status.tar_errors)
                self.done = done
                self.progress.archive_bytes = done.length
                self.progress.chunks_total = done.chunks
                feed.finish(done.chunks)
                for _ in workers:
                    queue.put_nowait(None)
        except BaseExceptionGroup as group_error:
            raise first_error(group_error) from None
        self.inline = None
        return done.chunks, done.length

    def check_tar(self, plan: GuestPlan, tar_rc: int, errors: str) -> None:
        """GNU tar exits 1 only for files that changed while read: a warning.

        Busybox tar exits 1 for any error, unreadable files left out included,
        so there exit 1 is a failure: the archive is not the workspace.
        """
        if tar_rc == 1 and not plan.probe.has("gnu_tar"):
            raise StagingFailed(f"tar exited 1: {errors or 'no details'}")
        if tar_rc == 1:
            self.warnings.append(
                "tar reported files changed while archiving (exit 1): " + (errors or "no details")
            )
        elif errors:
            self.warnings.append(f"tar printed: {errors}")

    def admit_chunk(
        self,
        chunk: Chunk,
        journaled: dict[int, tuple[str, Path]],
        queue: asyncio.Queue[Chunk | None],
        feed: ChunkFeed,
    ) -> None:
        have = journaled.get(chunk.seq)
        if have is not None and have[0] == chunk.digest:
            with contextlib.suppress(OSError):
                if have[1].stat().st_size == chunk.length:
                    feed.publish(chunk.seq, have[1])
                    self.progress.resumed_chunks += 1
                    self.progress.bytes_resumed += chunk.length
                    self.progress.chunks_done += 1
                    return
        inline, end = self.inline, chunk.offset + chunk.length
        algorithm = self.session.algorithm
        if self.inline_cleaned and not (
            inline is not None
            and algorithm is not None
            and end <= len(inline)
            and algorithm.digest(inline[chunk.offset : end]) == chunk.digest
        ):
            # the answer that carried it was verified whole, so the guest's base64 encoded
            # other bytes (right on the probe's text, wrong here), and its staging is gone
            # (said here, on the loop's own task, not in a worker: see pull)
            self.stats.faults["chunk-hash-mismatch"] += 1
            raise StagingGone(
                f"chunk {chunk.seq}: the stream the guest sent whole is not the one its "
                "index describes, and it removed its staging"
            )
        queue.put_nowait(chunk)

    def check_size(self, indexed: int, max_bytes: int) -> None:
        """The stream indexed so far within its bound: ``--max-bytes`` for an archive,
        :data:`MAX_LISTING` for a listing (``--max-bytes`` bounds what is fetched, and a
        listing of a large tree would pass it where the change to fetch is small)."""
        if self.chunk_journal is self.manifest_journal:
            if indexed > MAX_LISTING:
                raise LimitExceeded(f"listing larger than {MAX_LISTING} bytes")
        elif indexed > max_bytes:
            raise LimitExceeded(f"archive larger than {max_bytes} bytes ({BYTES_KNOB})")

    async def worker(
        self, queue: asyncio.Queue[Chunk | None], feed: ChunkFeed, plan: GuestPlan
    ) -> None:
        while (chunk := await queue.get()) is not None:
            data = await self.fetch_chunk(chunk, plan)
            store = self.io.submit(self.chunk_journal.store, chunk.seq, chunk.digest, data)
            # journaled, the chunk is read back from disk by the feed: its bytes go now, not
            # when the next read's replace them (each reader would hold two chunks, 16 MiB
            # more at the peak of a pull)
            del data
            path = await asyncio.wrap_future(store)
            feed.publish(chunk.seq, path)
            if self.chunk_journal is not self.manifest_journal:  # archive chunks only
                self.progress.chunks_done += 1
                self.progress.bytes_fetched += chunk.length
            self.emit()

    async def fetch_chunk(self, chunk: Chunk, plan: GuestPlan) -> bytes:
        inline, end = self.inline, chunk.offset + chunk.length
        if inline is not None and end <= len(inline):
            # the status carried the stream: the chunk counts as a read's would, only if
            # it hashes to the index's digest (else it is read)
            data = inline[chunk.offset : end]
            if plan.algorithm.digest(data) == chunk.digest:
                return data
            self.stats.faults["chunk-hash-mismatch"] += 1
        # the manifest (a fraction of an archive) is read by exec reads only, so that the
        # file API's reads and ``chunks`` both count archive chunks alone
        if self.chunk_journal is not self.manifest_journal:
            direct = await self.session.read_direct(chunk.offset, chunk.length, chunk.digest)
            if direct is not None:
                return direct
        for _ in range(self.options.max_attempts):
            data = await self.session.read("data", chunk.offset, chunk.length, self.sizer)
            if len(data) < chunk.length:  # the read size shrank: the rest in pieces
                buf = bytearray(data)
                while len(buf) < chunk.length:
                    buf += await self.session.read(
                        "data", chunk.offset + len(buf), chunk.length - len(buf), self.sizer
                    )
                data = bytes(buf)
            if plan.algorithm.digest(data) == chunk.digest:
                return data
            self.stats.faults["chunk-hash-mismatch"] += 1
            self.stats.retries += 1
            log.info(
                "retry", call=f"chunk {chunk.seq}", fault="chunk-hash-mismatch", asked=chunk.length
            )
        raise IntegrityFailed(f"chunk {chunk.seq} never matched its index hash")
