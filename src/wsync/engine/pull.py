"""Drive one pull: probe, admit, fetch chunks in parallel, extract, verify, swap.

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
import secrets
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import structlog

from wsync.engine import incremental
from wsync.engine.api import Progress, ProgressCallback, PullOptions, PullResult
from wsync.engine.destdir import DestDir
from wsync.engine.extract import ExtractStats
from wsync.engine.feed import ChunkFeed, consume_feed, extract_feed
from wsync.engine.fsutil import host_io, syncfs
from wsync.engine.guest import CallStats, GuestPlan, GuestSession
from wsync.engine.incremental import Incremental
from wsync.engine.journal import DestRegistry, Journal
from wsync.engine.settle import apply_lists
from wsync.engine.winddown import (
    WriterPool,
    await_future,
    await_thread,
    in_thread,
    raise_if_cancelled,
)
from wsync.errors import (
    HostileArchive,
    HostIOError,
    IntegrityFailed,
    LimitExceeded,
    ProducerVanished,
    StagingFailed,
    UnstableFiles,
    UsageError,
    WsyncError,
    first_error,
)
from wsync.protocol.policy import MIN_TEXT_READ, ReadSizer
from wsync.protocol.records import Chunk, DoneRecord, IndexParser
from wsync.protocol.scripts import BLOCK
from wsync.transports.base import Transport
from wsync.transports.registry import open_transport

log = structlog.get_logger("wsync.pull")

_T = TypeVar("_T")

_INDEX_READ = 1024 * 1024
_POLL_MIN, _POLL_MAX = 0.05, 1.0
_DEAD_CONFIRMATIONS = 3
#: progress is emitted at least this often, events or not (counters move between events)
_TICK = 0.5


class _ExtractorStopped(Exception):
    """Internal: the extractor thread ended before the stream did."""


def new_snapshot_id() -> str:
    return time.strftime("s%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(4)


def check_dest(dest: Path, transport: Transport, workspace: str, options: PullOptions) -> DestDir:
    """Refuse destinations that would lose data or loop; open and lock DEST's parent.

    The returned :class:`DestDir` holds DEST's parent open (reached from
    ``options.dest_root`` without symlinks when that is set) and the DEST
    lock; every write of the pull goes through it.  The caller closes it.
    """
    target = DestDir.open(Path(dest), options.dest_root)
    try:
        real = target.path
        inner = getattr(transport, "inner", transport)
        if inner.scheme == "local":
            source = Path(os.path.expanduser(workspace)).resolve()
            if real == source or source in real.parents:
                raise UsageError(f"DEST {dest} is inside the source workspace {source}")
            if real in source.parents:
                raise UsageError(f"the source workspace {source} is inside DEST {dest}")
        target.lock()  # for the whole pull: a second pull into DEST fails here, at once
        st = target.stat()
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise UsageError(f"DEST is a symlink; name the directory itself: {dest}")
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"DEST exists and is not a directory: {dest}")
        if st is not None:
            target.check_not_mount(st)
            if (
                not target.is_empty()
                and not options.force
                and not DestRegistry(options.state_dir).owns(real)
            ):
                raise UsageError(
                    f"DEST {dest} is a non-empty directory that wsync did not write; "
                    "it would be replaced entirely (pass --force to allow this)"
                )
    except BaseException:
        target.close()
        raise
    return target


class _Pull:
    def __init__(
        self,
        transport: Transport,
        workspace: str,
        dest: Path,
        options: PullOptions,
        journal: Journal,
        on_progress: ProgressCallback | None,
        stats: CallStats | None = None,
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
        self.session = GuestSession(transport, options, self.stats)
        # text channels carry base64, 4/3 the bytes: let reads go below one block there
        minimum = MIN_TEXT_READ if not transport.capabilities.binary_safe else BLOCK
        self.sizer = ReadSizer(options.chunk_size, minimum=minimum)
        self.progress = Progress()
        #: counted into by the extractor thread while it runs (progress reads it)
        self.extracted = ExtractStats()
        self.warnings: list[str] = []
        self.reconciled = False
        self.last_emit = 0.0
        self.done: DoneRecord | None = None
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

    # -- progress ----------------------------------------------------------------

    def emit(self, phase: str | None = None, *, force: bool = False) -> None:
        p = self.progress
        if phase:
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

    async def run(self) -> tuple[ExtractStats, int, int, str | None] | None:
        """Everything up to and including the swap.  Returns what ``finish`` needs, or
        None when DEST stays as it is (nothing changed, or a dry run)."""
        self.emit("probe")
        plan = await self.session.probe(self.workspace)
        self.plan = plan
        inc = self.inc = self.open_incremental(plan)
        run = "tar"
        if inc is not None:
            await self.manifest_phase(plan, inc)
            self.emit("diff")
            empty = self.journal.dir / "empty"
            await in_thread(lambda: self.decide(inc, plan, empty))
            if self.options.dry_run and inc.diff is not None:
                diff = inc.diff
                self.changes = await in_thread(lambda: list(diff.itemize()))
            run = inc.run
            if not run or self.options.dry_run:
                return None
        journal = self.journal if run == "tar" else self.journal.phase("select")
        listing = b""
        extra: dict[str, Any] = {}
        if inc is not None and run == "select":
            listing = await in_thread(inc.select_list)
            extra["list"] = hashlib.sha256(listing).hexdigest()
        snapshot = self.choose_snapshot(plan, journal, run, extra)
        if run == "select":
            await self.session.upload_list(snapshot, listing)
        journaled = await self.admit_phase(plan, journal, snapshot, run)
        tmp = f".{self.dest.name}.wsync-tmp-{self.journal.key[:12]}"
        tmp_fd, leftovers = self.target.make_tmp(tmp)
        self.warnings.extend(leftovers)
        replace = run == "select"
        hook = None
        if inc is not None:
            inc.hashes.start()
            hook = inc.hashes.add

        def extract(feed: ChunkFeed) -> ExtractStats:
            if inc is not None and replace:
                inc.farm(tmp_fd, feed.check_cancel)
            limits = self.options.limits
            return extract_feed(
                feed, plan.compressor, tmp_fd, limits, self.extracted, replace=replace, on_file=hook
            )

        try:
            self.emit("pull")
            stats, chunks, length = await self.stream(plan, journal, journaled, extract)
            if inc is not None:
                inc.hashes.close()
            self.unstable = await apply_lists(
                self.session, self.done, self.sizer, tmp_fd, self.options.best_effort, self.warnings
            )
            if inc is not None and replace:
                self.emit("apply")
                await in_thread(lambda: inc.dir_meta(tmp_fd))
            self.emit("swap")
            with host_io(f"flushing {self.dest.parent / tmp}"):
                syncfs(tmp_fd)
            # recorded before the swap: a kill right after it must not make
            # the next run refuse a DEST that wsync itself just wrote
            DestRegistry(self.options.state_dir).record(self.dest)
            old = self.target.swap(tmp)
            self.swapped = True
        except BaseException:
            await self.remove_tmp(tmp)
            raise
        finally:
            # every write was awaited on success; after a failure none is waited for here
            self.io.shutdown(wait=False)
        return stats, chunks, length, old

    def open_incremental(self, plan: GuestPlan) -> Incremental | None:
        """The incremental state of DEST, when this guest can list its workspace."""
        if not incremental.can_list(plan):
            return None
        key = f"{self.transport.description}\n{self.workspace}"
        hashes = incremental.HashLog(self.journal.dir / "hashes")
        return Incremental(self.options, self.target, key, hashes)

    def decide(self, inc: Incremental, plan: GuestPlan, empty: Path) -> None:
        """Diff (in a thread); a full pull with excludes or a dry run without a baseline
        diffs against an empty directory of the journal."""
        with contextlib.suppress(FileExistsError):
            empty.mkdir(mode=0o700)
        fd = os.open(empty, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            inc.decide(plan, stdin=self.session.gate, tmp_fd=fd)
            if self.options.dry_run and inc.diff is None:
                inc.diff = inc.state.diff(fd)
        finally:
            os.close(fd)

    async def manifest_phase(self, plan: GuestPlan, inc: Incremental) -> None:
        """The manifest run, streamed into the state (see :mod:`wsync.engine.incremental`)."""
        self.emit("manifest")
        journal = self.manifest_journal = self.journal.phase("manifest")
        prune = inc.prune()
        snapshot = self.choose_snapshot(plan, journal, "manifest", {"prune": list(prune)})
        journaled = await self.admit_phase(plan, journal, snapshot, "manifest", prune)

        def load(feed: ChunkFeed) -> None:
            consume_feed(feed, plan.compressor, inc.load)

        await self.stream(plan, journal, journaled, load)
        # verified and loaded: its staging goes now (even with keep_staging, which keeps
        # the content run's).  A kill -9 later takes a fresh manifest, whose diff (same
        # guest, same DEST) names the same list, so the select run's journal resumes
        self.snapshots.remove(snapshot)
        try:
            async with asyncio.timeout(self.options.call_timeout * 2):
                await self.session.cleanup()
        except (WsyncError, TimeoutError) as exc:
            self.warnings.append(f"guest staging not removed (GC removes it later): {exc}")

    async def admit_phase(
        self,
        plan: GuestPlan,
        journal: Journal,
        snapshot: str,
        mode: str,
        prune: tuple[str, ...] = (),
    ) -> dict[int, tuple[str, Path]]:
        """Admit ``snapshot``'s producer run; return the journal's chunks still good."""
        self.progress.snapshot = snapshot
        # every later log line of this pull (workers inherit the context) names it
        structlog.contextvars.bind_contextvars(snapshot=snapshot)
        self.emit("admit")
        self.chunk_journal = journal
        self.snapshots.append(snapshot)
        self.reconciled = await self.session.admit(
            snapshot, self.workspace, plan.compressor, mode=mode, prune=prune
        )
        journaled = journal.chunks()
        if journaled and not self.reconciled:
            # the guest staging is gone and a new producer started: its stream
            # differs from the one our chunks came from, so they are worthless
            log.info("guest staging restarted; discarding journaled chunks", n=len(journaled))
            journal.clear_chunks()
            journaled = {}
        return journaled

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

    async def remove_tmp(self, tmp: str) -> None:
        """Remove the partial tree beside DEST (bounded; the next run removes what stays)."""
        if self.stuck:
            return

        def remove() -> None:
            self.target.discard(tmp)  # never raises: the pull's own error is reported

        remover = threading.Thread(target=remove, name="wsync-cleanup", daemon=True)
        remover.start()
        if not await await_thread(remover, _WIND_DOWN_S):
            log.info("partial tree not removed yet; the next run removes it", tmp=str(tmp))

    async def finish(self, old: str | None) -> None:
        """After the swap DEST is final: nothing here may fail the pull.

        The old tree is removed, the guest staging cleaned up and the journal
        forgotten; problems become warnings.
        """
        self.emit("cleanup")
        if old is not None:
            try:
                await in_thread(self.target.removal(old))
            except (HostIOError, OSError) as exc:
                self.warnings.append(f"the previous tree was not fully removed: {exc}")
        inc = self.inc
        if inc is not None and self.swapped:
            # after the old tree is gone: unlinking it changed the ctimes of kept files
            try:
                await in_thread(inc.commit)
                self.tree_bytes = await in_thread(inc.tree_bytes)
            except (WsyncError, OSError) as exc:
                self.warnings.append(f"incremental state not recorded (next pull re-checks): {exc}")
        if not self.options.keep_staging:
            for snapshot in dict.fromkeys(self.snapshots):
                self.session.snapshot = snapshot
                try:
                    async with asyncio.timeout(self.options.call_timeout * 2):
                        await self.session.cleanup()
                except (WsyncError, TimeoutError) as exc:
                    self.warnings.append(f"guest staging not removed (GC removes it later): {exc}")
        try:
            self.journal.remove()
        except WsyncError as exc:
            self.warnings.append(f"journal not removed: {exc}")

    def choose_snapshot(
        self, plan: GuestPlan, journal: Journal, mode: str, extra: Mapping[str, Any]
    ) -> str:
        """The snapshot of ``journal`` to resume when it was admitted for the same run
        (same mode, and for a select run the same list), else a fresh one."""
        wanted = {
            "sandbox": self.transport.description,
            "workspace": self.workspace,
            "staging_root": self.options.staging_root,
            "chunk_size": self.options.chunk_size,
            "algorithm": plan.algorithm.name,
            "compressor": plan.compressor,
            **({"mode": mode} if mode != "tar" else {}),
            **extra,
        }
        meta = journal.meta
        fresh = meta is not None and (
            time.time() - float(meta.get("created", 0)) < self.options.staging_ttl
        )
        if meta and fresh and all(meta.get(k) == v for k, v in wanted.items()):
            snapshot = str(meta["snapshot"])
            log.info("resuming", snapshot=snapshot)
            return snapshot
        snapshot = new_snapshot_id()
        journal.start({**wanted, "snapshot": snapshot, "created": time.time()})
        return snapshot

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
        limits = self.options.limits
        try:
            async with asyncio.TaskGroup() as group:
                workers = [
                    group.create_task(self.worker(queue, feed, plan))
                    for _ in range(max(1, self.options.parallel))
                ]
                poll, dead, dead_since = _POLL_MIN, 0, 0.0
                while True:
                    status = await self.session.status()
                    if not status.exists:
                        raise ProducerVanished("the guest staging directory disappeared")
                    if status.failed is not None:
                        raise StagingFailed(status.failed)
                    self.progress.archive_produced = status.data_size
                    grew = index.consumed < status.index_size
                    while index.consumed < status.index_size:
                        n = min(_INDEX_READ, status.index_size - index.consumed)
                        data = await self.session.read("index", index.consumed, n, self.sizer)
                        for chunk in index.receive_data(data):
                            self.admit_chunk(chunk, journaled, queue, feed)
                    if (
                        index.next_offset > limits.max_bytes
                        and self.chunk_journal is not self.manifest_journal
                    ):
                        raise LimitExceeded(f"archive larger than {limits.max_bytes} bytes")
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
        return done.chunks, done.length

    async def discard(self) -> None:
        """Forget a snapshot that failed for a reason a retry of it cannot fix: remove the
        guest staging now (a full guest disk must not stay full until the GC) and the
        journal's chunks, so that the next run starts a fresh snapshot."""
        if self.session.snapshot and self.session.algorithm and not self.options.keep_staging:
            try:
                async with asyncio.timeout(self.options.call_timeout * 2):
                    await self.session.cleanup()
            except (WsyncError, TimeoutError) as exc:
                log.warning("failed snapshot not removed from the guest", error=str(exc))
        with contextlib.suppress(WsyncError):
            self.chunk_journal.forget()

    def check_tar(self, plan: GuestPlan, tar_rc: int, errors: str) -> None:
        """GNU tar exits 1 only for files that changed while read: a warning.

        Busybox tar exits 1 for any error, unreadable files left out included,
        so there exit 1 is a failure: the archive is not the workspace.
        """
        if tar_rc == 1 and "GNU tar" not in plan.probe.tar_version:
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
        queue.put_nowait(chunk)

    async def worker(
        self, queue: asyncio.Queue[Chunk | None], feed: ChunkFeed, plan: GuestPlan
    ) -> None:
        while (chunk := await queue.get()) is not None:
            data = await self.fetch_chunk(chunk, plan)
            store = self.io.submit(self.chunk_journal.store, chunk.seq, chunk.digest, data)
            path = await asyncio.wrap_future(store)
            feed.publish(chunk.seq, path)
            self.progress.chunks_done += 1
            self.progress.bytes_fetched += len(data)
            self.emit()

    async def fetch_chunk(self, chunk: Chunk, plan: GuestPlan) -> bytes:
        direct = await self.session.read_direct(chunk.offset, chunk.length, chunk.digest)
        if direct is not None:
            return direct
        for _ in range(self.options.max_attempts):
            buf = bytearray()
            while len(buf) < chunk.length:
                buf += await self.session.read(
                    "data", chunk.offset + len(buf), chunk.length - len(buf), self.sizer
                )
            if plan.algorithm.digest(buf) == chunk.digest:
                return bytes(buf)
            self.stats.faults["chunk-hash-mismatch"] += 1
            self.stats.retries += 1
            log.info(
                "retry", call=f"chunk {chunk.seq}", fault="chunk-hash-mismatch", asked=len(buf)
            )
        raise IntegrityFailed(f"chunk {chunk.seq} never matched its index hash")


#: failures that the same snapshot would repeat on every run: it is discarded at once
_PERMANENT = (StagingFailed, HostileArchive, UnstableFiles)


async def _attempt(runner: _Pull) -> tuple[ExtractStats, int, int, str | None]:
    async with runner.ticking():
        try:
            done = await runner.run()
        except _PERMANENT as exc:
            # a host limit (disk space, --max-bytes) is not the snapshot's fault: the
            # next run, with room made or the limit raised, resumes it
            if not isinstance(exc, LimitExceeded):
                await runner.discard()
            if runner.inc is not None:
                runner.inc.close()
            raise
        except BaseException:
            if runner.inc is not None:
                runner.inc.close()
            raise
    # nothing to do (or a dry run): DEST stays as it is
    return done if done is not None else (ExtractStats(), 0, 0, None)


#: how long a failing or cancelled pull waits for its threads before it leaves them
_WIND_DOWN_S = 10.0
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
    started = time.monotonic()
    sandbox = sandbox or transport.description
    target = check_dest(Path(dest), transport, workspace, options)
    real = target.path
    journal = Journal(
        options.state_dir, sandbox, real, options.limits.min_free_bytes, target
    ).open()
    runner = _Pull(transport, workspace, real, options, journal, on_progress)
    try:
        async with asyncio.timeout(options.timeout or None):
            try:
                stats, chunks, length, old = await _attempt(runner)
            except StagingFailed as exc:
                if not runner.reconciled:
                    raise
                raise_if_cancelled()  # no fresh start for a pull being stopped
                # we adopted a snapshot from an earlier run and it had failed or
                # died (and is now discarded): start afresh once
                log.warning("adopted snapshot failed; starting a fresh one", error=str(exc))
                runner = _Pull(
                    transport, workspace, real, options, journal, on_progress, runner.stats
                )
                runner.warnings.append(f"an adopted snapshot had failed ({exc}); started afresh")
                stats, chunks, length, old = await _attempt(runner)
    except TimeoutError:
        journal.close()
        raise IntegrityFailed(
            f"the overall deadline of {options.timeout:.0f}s passed; run again to resume"
        ) from None
    except BaseException:
        journal.close()
        raise
    try:
        async with runner.ticking():
            await runner.finish(old)
    except asyncio.CancelledError:
        # DEST was swapped: it is complete and exact, so a stop from here on is a
        # success, not an interruption (the CLI exits 0).  The journal goes (the
        # next run must take a fresh snapshot, not resume this finished one); the
        # old tree and the guest staging are left to the next run and the GC.
        runner.warnings.append("stopped while cleaning up; DEST is complete")
        with contextlib.suppress(WsyncError):
            journal.remove()
    finally:
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
        snapshot=runner.progress.snapshot,
        reconciled=runner.reconciled,
        files=files,
        bytes=length,
        transferred_bytes=runner.stats.transferred,
        chunks=chunks,
        resumed_chunks=runner.progress.resumed_chunks,
        retries=runner.stats.retries,
        faults=dict(runner.stats.faults),
        elapsed_s=time.monotonic() - started,
        warnings=runner.warnings,
        unstable_files=runner.unstable,
        mode=inc.mode if inc is not None else "full",
        changed_files=inc.changed if inc is not None and inc.mode != "full" else files,
        deleted_files=inc.deleted if inc is not None else 0,
        tree_bytes=runner.tree_bytes,
        changes=runner.changes,
    )


async def pull_uri(
    uri: str,
    dest: Path,
    options: PullOptions,
    transport_options: Mapping[str, Any] | None = None,
    *,
    on_progress: ProgressCallback | None = None,
) -> PullResult:
    """Open the transport named by ``uri`` and pull its workspace into ``dest``."""
    parsed, transport = open_transport(uri, transport_options)
    try:
        return await pull(
            transport, parsed.path, dest, options, sandbox=parsed.raw, on_progress=on_progress
        )
    finally:
        # bounded: a close that hangs (a dead ssh connection) must not hold a
        # finished or cancelled pull; the connection dies with its process
        try:
            async with asyncio.timeout(_CLOSE_S):
                await transport.aclose()
        except TimeoutError:
            log.warning("closing the transport timed out", sandbox=parsed.raw)
