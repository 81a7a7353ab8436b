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
import os
import secrets
import stat
import threading
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import structlog

from wsync.engine.api import Progress, ProgressCallback, PullOptions, PullResult
from wsync.engine.destdir import DestDir
from wsync.engine.extract import ExtractStats
from wsync.engine.feed import ChunkFeed, extract_feed
from wsync.engine.fsutil import host_io, syncfs
from wsync.engine.guest import CallStats, GuestPlan, GuestSession
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

    async def run(self) -> tuple[ExtractStats, int, int, str | None]:
        """Everything up to and including the swap.  Returns what ``finish`` needs."""
        self.emit("probe")
        plan = await self.session.probe(self.workspace)
        self.plan = plan
        snapshot = self.choose_snapshot(plan)
        self.progress.snapshot = snapshot
        # every later log line of this pull (workers inherit the context) names it
        structlog.contextvars.bind_contextvars(snapshot=snapshot)
        self.emit("admit")
        self.reconciled = await self.session.admit(snapshot, self.workspace, plan.compressor)
        journaled = self.journal.chunks()
        if journaled and not self.reconciled:
            # the guest staging is gone and a new producer started: its stream
            # differs from the one our chunks came from, so they are worthless
            log.info("guest staging restarted; discarding journaled chunks", n=len(journaled))
            self.journal.clear_chunks()
            journaled = {}
        tmp = f".{self.dest.name}.wsync-tmp-{self.journal.key[:12]}"
        tmp_fd, leftovers = self.target.make_tmp(tmp)
        self.warnings.extend(leftovers)
        feed = ChunkFeed(plan.algorithm)
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["stats"] = extract_feed(
                    feed, plan.compressor, tmp_fd, self.options.limits, self.extracted
                )
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=work, name="wsync-extract", daemon=True)
        thread.start()
        try:
            self.emit("pull")
            chunks, length = await self.fetch_all(plan, feed, journaled, thread)
            self.emit("extract")
            await await_thread(thread, None)
            raise_if_cancelled()  # a cancel swallowed on the way must not swap DEST
            if "error" in box:
                raise box["error"]
            stats: ExtractStats = box["stats"]
            assert self.done is not None
            if feed.length != length or feed.digest != self.done.digest:
                raise IntegrityFailed(
                    f"whole stream: {feed.length} bytes hashing to {feed.digest[:16]}…, "
                    f"guest says {length} bytes hashing to {self.done.digest[:16]}…"
                )
            self.unstable = await apply_lists(
                self.session, self.done, self.sizer, tmp_fd, self.options.best_effort, self.warnings
            )
            self.emit("swap")
            with host_io(f"flushing {self.dest.parent / tmp}"):
                syncfs(tmp_fd)
            if self.options.fence is not None:
                self.options.fence()  # last word of a daemon fleet's lease before the swap
            # recorded before the swap: a kill right after it must not make
            # the next run refuse a DEST that wsync itself just wrote
            DestRegistry(self.options.state_dir).record(self.dest)
            old = self.target.swap(tmp)
        except BaseException as exc:
            await self.wind_down(feed, thread, tmp)
            if isinstance(exc, _ExtractorStopped) and "error" in box:
                raise box["error"] from None
            raise
        finally:
            # every write was awaited on success; after wind_down() none is waited for here
            self.io.shutdown(wait=False)
            feed.close()
        return stats, chunks, length, old

    async def wind_down(self, feed: ChunkFeed, thread: threading.Thread, tmp: str) -> None:
        """After a failure or a cancel: stop the extractor and the journal writers,
        then remove the partial tree beside DEST.

        This runs on the event loop while the pull is being cancelled, so it never
        blocks it: a cancelled CLI pull must exit within a second or two and the
        daemon's loop keeps serving.  The extractor sees ``feed.abort`` at its next
        read or ``check_cancel`` (milliseconds); journal writes in flight finish
        their fsync+rename (a chunk either counts or leaves a temp file the next
        run deletes).  Each wait is polled with a bound, never joined: what is
        still running after :data:`_WIND_DOWN_S` is left to finish or die with the
        process (daemon threads), and so is ``tmp``, which the next run removes
        before it extracts.  Never :func:`asyncio.to_thread` here: the default
        executor is joined without a bound by ``asyncio.run`` and at exit.
        """
        feed.abort("pull stopped")
        self.io.shutdown(wait=False, cancel_futures=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _WIND_DOWN_S
        if not await await_thread(thread, _WIND_DOWN_S):
            log.warning("the extractor is still running; its partial tree stays", tmp=str(tmp))
            return
        for write in list(self.io.pending):
            if not await await_future(write, deadline - loop.time()):
                log.warning("a journal write is still running", tmp=str(tmp))
                break

        def remove() -> None:
            self.target.discard(tmp)  # never raises: the pull's own error is reported

        remover = threading.Thread(target=remove, name="wsync-cleanup", daemon=True)
        remover.start()
        if not await await_thread(remover, max(0.1, deadline - loop.time())):
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
        if not self.options.keep_staging:
            try:
                async with asyncio.timeout(self.options.call_timeout * 2):
                    await self.session.cleanup()
            except (WsyncError, TimeoutError) as exc:
                self.warnings.append(f"guest staging not removed (GC removes it later): {exc}")
        try:
            self.journal.remove()
        except WsyncError as exc:
            self.warnings.append(f"journal not removed: {exc}")

    def choose_snapshot(self, plan: GuestPlan) -> str:
        wanted = {
            "sandbox": self.transport.description,
            "workspace": self.workspace,
            "staging_root": self.options.staging_root,
            "chunk_size": self.options.chunk_size,
            "algorithm": plan.algorithm.name,
            "compressor": plan.compressor,
        }
        meta = self.journal.meta
        fresh = meta is not None and (
            time.time() - float(meta.get("created", 0)) < self.options.staging_ttl
        )
        if meta and fresh and all(meta.get(k) == v for k, v in wanted.items()):
            snapshot = str(meta["snapshot"])
            log.info("resuming", snapshot=snapshot)
            return snapshot
        snapshot = new_snapshot_id()
        self.journal.start({**wanted, "snapshot": snapshot, "created": time.time()})
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
                    if index.next_offset > limits.max_bytes:
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
            self.journal.forget()

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
            store = self.io.submit(self.journal.store, chunk.seq, chunk.digest, data)
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
            return await runner.run()
        except _PERMANENT as exc:
            # a host limit (disk space, --max-bytes) is not the snapshot's fault: the
            # next run, with room made or the limit raised, resumes it
            if not isinstance(exc, LimitExceeded):
                await runner.discard()
            raise


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
        journal.close()
    runner.emit("done", force=True)
    return PullResult(
        ok=True,
        sandbox=sandbox,
        dest=str(real),
        snapshot=runner.progress.snapshot,
        reconciled=runner.reconciled,
        files=stats.files + stats.symlinks + stats.hardlinks,
        bytes=length,
        transferred_bytes=runner.stats.transferred,
        chunks=chunks,
        resumed_chunks=runner.progress.resumed_chunks,
        retries=runner.stats.retries,
        faults=dict(runner.stats.faults),
        elapsed_s=time.monotonic() - started,
        warnings=runner.warnings,
        unstable_files=runner.unstable,
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
