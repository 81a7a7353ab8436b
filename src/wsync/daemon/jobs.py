"""The daemon's scheduler and runner: jobs in, engine pulls out, results stored.

Why a hand-rolled dispatcher instead of semaphores: limits (global and per
sandbox) change on reload, and a dispatcher that simply re-checks the limits
each time something changes honours a new limit at once, where a semaphore
would keep its old size.  Queued jobs start in FIFO order as slots free up.

Durability rules:

* Every state change is written to the :class:`~wsync.daemon.store.JobStore`
  before it is announced, so an API answer never gets ahead of the disk.
* At start-up, jobs that were ``queued`` or ``running`` when the previous
  process died are queued again; the engine resumes them from its durable
  journal under ``state_dir/engine`` (nothing verified is fetched twice).
* On SIGTERM, running pulls are cancelled (the engine keeps its journal) and
  their jobs go back to ``queued`` so the next start resumes them.  A user's
  ``DELETE`` is different: that job ends ``cancelled``.

Each engine pull runs on its own thread and loop (:mod:`wsync.daemon.pullthread`):
the engine's clean-up after a cancel blocks (thread joins, removing a large
half-written tree), and on this loop it froze the API and SIGTERM handling.
The job's own task stays here and is the only writer of the job's record, so
the store is never written from another thread, and shutdown can record every
job before it closes the store even when a pull's thread is still busy.

Where a job may write is decided twice: when it is accepted, and again just
before it runs against the configuration of *that* moment
(:mod:`wsync.daemon.confine`), walking DEST's path from its root without
following symlinks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import structlog

from wsync.daemon.config import (
    DaemonConfig,
    SandboxConfig,
    check_dest,
    check_uri,
    resolve_transport_options,
)
from wsync.daemon.confine import (
    Forbidden,
    check_local_source,
    confine_dest,
    confine_source,
    local_reader,
)
from wsync.daemon.metrics import Metrics
from wsync.daemon.pullthread import PullCancelled, PullThread
from wsync.daemon.store import FINAL_STATES, Job, JobStore, StoreUnavailable, new_job_id
from wsync.engine.api import ProgressCallback, PullOptions, PullResult
from wsync.errors import InternalError, UsageError, WsyncError
from wsync.uri import parse

Puller = Callable[
    [str, Path, PullOptions, Mapping[str, Any] | None, ProgressCallback | None],
    Awaitable[PullResult],
]

log = structlog.get_logger("wsync.daemon")

#: at most one progress event per job per this many seconds (SSE and store)
PROGRESS_EVENT_INTERVAL = 0.5
PROGRESS_SAVE_INTERVAL = 2.0


class NotAccepting(WsyncError):
    """The daemon is shutting down and takes no new jobs (HTTP 503)."""

    exit_code = 2
    kind = "shutting-down"


class UnknownJob(UsageError):
    """No job has that id (HTTP 404)."""


class JobFinished(UsageError):
    """The job already ended, so it cannot be cancelled (HTTP 409)."""


async def engine_pull(
    uri: str,
    dest: Path,
    options: PullOptions,
    transport_options: Mapping[str, Any] | None,
    on_progress: ProgressCallback | None,
) -> PullResult:
    """The real engine, imported late so the API starts even if a backend module is broken."""
    from wsync.engine.pull import pull_uri

    return await pull_uri(uri, dest, options, transport_options, on_progress=on_progress)


def _make_parent(dest: Path, roots: list[Path]) -> Path:
    """Re-confine DEST to the current roots and create its parent; return DEST's root.

    Runs on the pull's thread just before the engine starts.  The parent is
    created by an ``O_NOFOLLOW``/``mkdirat`` walk from the root, so a symlink
    swapped into the path since the request was accepted is refused, never
    followed (:func:`wsync.daemon.confine.confine_dest`).
    """
    return confine_dest(dest, roots)


def _check_source(job: Job, config: DaemonConfig) -> dict[str, Any]:
    """Re-check a requested (not configured) source against the config of this moment;
    return the transport options the source adds.

    A sandbox the operator configured is trusted as configured.  A URI that
    came in a request needs ``api.allow_uris`` still on, and a ``local:`` one
    must still lie under ``api.local_roots`` with no symlink below the root
    (its path was stored resolved when the request was accepted).  Either
    ``local:`` source is read as its owner where that is another user
    (:func:`~wsync.daemon.confine.local_reader`).
    """
    parsed = parse(job.uri)
    box = config.sandboxes.get(job.sandbox)
    requested = box is None or box.uri != job.uri
    if requested and not config.api.allow_uris:
        raise Forbidden("sandbox URIs are disabled (api.allow_uris = false); job not started")
    if parsed.scheme != "local":
        return {}
    if requested:
        confine_source(Path(parsed.path), config.api.local_roots)
    reader = local_reader(Path(parsed.path), requested=requested)
    return {} if reader is None else {"run_as": reader}


def resolve_request(config: DaemonConfig, sandbox: str, dest: str | None) -> tuple[str, str, str]:
    """(sandbox label, uri, resolved dest) for a request; raises UsageError/DestForbidden."""
    box = config.sandboxes.get(sandbox)
    if box is not None:
        name, uri = sandbox, box.uri
        dest = dest or (str(box.dest) if box.dest else None)
    elif ":" in sandbox:
        parsed = check_uri(sandbox)
        if not config.api.allow_uris:
            raise Forbidden(
                "sandbox URIs are disabled (api.allow_uris = false); use a configured sandbox name"
            )
        uri = parsed.raw
        if parsed.scheme == "local":
            real = check_local_source(Path(parsed.path), config.api.local_roots)
            uri = f"local:{real}"
        name = uri
    else:
        known = ", ".join(sorted(config.sandboxes)) or "none configured"
        raise UsageError(f"unknown sandbox {sandbox!r} (configured: {known})")
    if not dest:
        raise UsageError(f"dest is required for sandbox {sandbox!r} (it has no default dest)")
    return name, uri, str(check_dest(dest, config.dest_roots, config.own_dirs))


def failure_summary(job: Job, err: WsyncError | None) -> dict[str, Any]:
    """A failed job's result: the PullResult shape, filled from the last progress."""
    prog = job.progress
    result = PullResult(
        ok=False,
        sandbox=job.uri,
        dest=job.dest,
        snapshot=str(prog.get("snapshot") or ""),
        bytes=int(prog.get("archive_bytes") or 0),
        transferred_bytes=int(prog.get("transferred_bytes") or 0),
        chunks=int(prog.get("chunks_done") or 0),
        resumed_chunks=int(prog.get("resumed_chunks") or 0),
        retries=int(prog.get("retries") or 0),
        faults=dict(prog.get("faults") or {}),
    )
    if err is not None:
        result.error, result.error_kind, result.exit_code = str(err), err.kind, err.exit_code
        # the engine's warnings till the failure (why a fresh start was made, say: see
        # wsync.engine.pull._so_far), as PullResult.from_error gives --json
        warnings = (getattr(err, "so_far", None) or {}).get("warnings")
        if isinstance(warnings, list):
            result.warnings = [w for w in warnings if isinstance(w, str)]
        job.error, job.error_kind, job.exit_code = str(err), err.kind, err.exit_code
    return result.to_json()


class EventBroker:
    """Fan-out of job events to SSE subscribers; a slow subscriber loses old events."""

    def __init__(self, maxsize: int = 1000) -> None:
        self._subscribers: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._maxsize = maxsize
        self._seq = 0

    def subscribe(self) -> asyncio.Queue[dict[str, Any] | None]:
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(self._maxsize)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        self._subscribers.discard(queue)

    def publish(self, event: str, data: dict[str, Any]) -> None:
        self._seq += 1
        item = {"seq": self._seq, "event": event, "data": data}
        for queue in self._subscribers:
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
            queue.put_nowait(item)

    def close(self) -> None:
        """End every stream (None is the end marker) so shutdown is not held open."""
        for queue in self._subscribers:
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
            queue.put_nowait(None)


@dataclasses.dataclass(slots=True)
class _Running:
    job: Job
    task: asyncio.Task[None]
    sandbox: str
    started: float
    last_event: float = 0.0
    last_save: float = 0.0
    snapshot: str = ""
    cancel_requested: bool = False
    thread: PullThread[PullResult] | None = None

    def stop(self) -> None:
        """Ask the pull's thread to stop; the job task records the outcome."""
        if self.thread is not None:
            self.thread.cancel()


class JobManager:
    """Owns the job store, the dispatcher, scheduled pulls and the event stream."""

    def __init__(
        self,
        config: DaemonConfig,
        store: JobStore,
        metrics: Metrics,
        puller: Puller = engine_pull,
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.events = EventBroker()
        self._puller = puller
        self._queue: list[str] = []  # job ids, FIFO
        self._running: dict[str, _Running] = {}
        self._schedulers: dict[str, asyncio.Task[None]] = {}
        #: when each schedule fires next (monotonic): a reload restarts the schedulers,
        #: which go on from there instead of firing every sandbox again at once
        self._next_fire: dict[str, float] = {}
        self._accepting = False
        self._shutting_down = False
        self._threads: list[PullThread[PullResult]] = []
        #: ended jobs whose record the store refused (a full disk, a lock held too long),
        #: written again by :meth:`_resave` until it takes them
        self._unsaved: dict[str, Job] = {}
        self._resaving: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------

    async def start(self) -> int:
        """Re-queue jobs interrupted by the previous process, start schedulers."""
        resumed = self.store.list(states=("queued", "running"), limit=1_000_000, newest_first=False)
        for job in list(resumed):
            if self.store.cancel_requested(job.id):
                # a DELETE was acknowledged and the daemon died before the pull stopped:
                # the job ends as the client was told, it is not pulled again
                job.state, job.finished_at = "cancelled", time.time()
                job.error, job.error_kind, job.exit_code = (
                    "cancelled by request",
                    "interrupted",
                    130,
                )
                resumed.remove(job)
                self.metrics.pulls.labels(self._label(job.sandbox), "cancelled").inc()
                log.info("job.cancelled", job_id=job.id, sandbox=job.sandbox)
                if not self._save(job):  # refused: written again until the store takes it
                    self._keep_unsaved(job)
                continue
            if job.state == "running":
                job.state = "queued"
                self._save(job)  # refused: the row says running, and it runs all the same
            self._queue.append(job.id)
            log.info("job.requeued", job_id=job.id, sandbox=job.sandbox, attempts=job.attempts)
        self._accepting = True
        self._start_schedulers()
        self._pump()
        return len(resumed)

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def shutdown(self, grace: float) -> None:
        """Stop taking jobs; stop in-flight pulls (journals persist); every job recorded.

        The pulls' threads get ``grace`` seconds to stop by themselves.  A job
        whose thread is still busy after that has its task cancelled: the task
        records the job as interrupted (back to ``queued``) at once, without
        waiting for the thread, so when this returns no job task is left and
        the store can be closed.  A thread still running then is abandoned
        (see :meth:`busy_threads`); its journal survives like after ``kill -9``.
        """
        self._accepting = False
        self._shutting_down = True
        for task in self._schedulers.values():
            task.cancel()
        runs = list(self._running.values())
        for run in runs:
            run.stop()
        tasks = [run.task for run in runs]
        waiting = [*tasks, *self._schedulers.values()]
        if waiting:
            _done, pending = await asyncio.wait(waiting, timeout=grace)
            if pending:
                log.warning("shutdown.grace_exceeded", pending=len(pending))
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        self._schedulers.clear()
        if self._resaving is not None:
            self._resaving.cancel()
            await asyncio.gather(self._resaving, return_exceptions=True)
        for job in list(self._unsaved.values()):  # a last try: else the next start requeues it
            self._save(job)
        self.events.close()

    def busy_threads(self) -> int:
        """Pull threads still alive (after :meth:`shutdown`: ones that outlived the grace)."""
        return sum(1 for t in self._threads if t.is_alive())

    def running_jobs(self) -> list[Job]:
        return [run.job for run in self._running.values()]

    def reload(self, config: DaemonConfig) -> None:
        """Adopt a new configuration: limits, roots, token, sandboxes and schedules."""
        self.config = config
        for task in self._schedulers.values():
            task.cancel()
        self._schedulers.clear()
        if self._accepting:
            self._start_schedulers()
        self._pump()

    # -- submission and queries --------------------------------------------

    def resolve(self, sandbox: str, dest: str | None) -> tuple[str, str, str]:
        """(sandbox label, uri, resolved dest) for a request; raises UsageError/DestForbidden."""
        return resolve_request(self.config, sandbox, dest)

    def submit(self, sandbox: str, dest: str | None, trigger: str = "api") -> tuple[Job, bool]:
        """Queue a pull, or return the active job for the same (uri, dest) as reconciled."""
        if not self._accepting:
            raise NotAccepting("the daemon is shutting down and takes no new jobs")
        name, uri, real_dest = self.resolve(sandbox, dest)
        existing = self.store.find_active(uri, real_dest)
        if existing is not None and existing.id in self._unsaved:
            # over, though the store has not taken its end yet: record it now, so that the
            # new job is not merged into it (and the dedupe index lets it in)
            if not self._save(self._unsaved[existing.id]):
                raise StoreUnavailable("it takes no writes now (a job's end is unrecorded)")
            existing = self.store.find_active(uri, real_dest)
        if existing is not None:
            return self.live(existing), True
        job = Job(id=new_job_id(), sandbox=name, uri=uri, dest=real_dest, trigger=trigger)
        try:
            self.store.insert(job)
        except sqlite3.IntegrityError:  # pragma: no cover - find_active saw none a moment ago
            raced = self.store.find_active(uri, real_dest)
            if raced is None:
                raise InternalError("job store refused a job with no active duplicate") from None
            return self.live(raced), True
        self._queue.append(job.id)  # stored: it must run whatever comes next
        with contextlib.suppress(WsyncError):  # pruning old records can wait for the next job
            self.store.prune(self.config.limits.keep_finished_jobs)
        log.info("job.queued", job_id=job.id, sandbox=name, dest=real_dest, trigger=trigger)
        self._announce(job)
        self._pump()
        return job, False

    def get(self, job_id: str) -> Job:
        job = self.store.get(job_id)
        if job is None:
            raise UnknownJob(f"no job {job_id!r}")
        return self.live(job)

    def live(self, job: Job) -> Job:
        """The in-memory record of a running job (fresher progress than the store's), or
        of an ended one whose end the store has not taken yet."""
        run = self._running.get(job.id)
        return run.job if run is not None else self._unsaved.get(job.id, job)

    def list_jobs(
        self, *, states: Iterable[str] | None = None, sandbox: str | None = None, limit: int = 100
    ) -> list[Job]:
        wanted = None if states is None else set(states)
        found = (
            self.live(job) for job in self.store.list(states=states, sandbox=sandbox, limit=limit)
        )
        # a job whose end the store has not taken yet is listed as what it is now
        return [job for job in found if wanted is None or job.state in wanted]

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.state in FINAL_STATES:
            raise JobFinished(f"job {job_id} already {job.state}")
        run = self._running.get(job_id)
        if run is not None:
            # recorded first, so that a daemon killed before the pull stops does not pull
            # the job again at its next start (refused: the caller's error, nothing asked)
            self.store.request_cancel(job_id)
            # only a request to the pull's thread: its clean-up (joins, removing
            # a half-written tree) happens there, never on this loop
            run.cancel_requested = True
            run.stop()
            return job  # the job task records the final state
        job.state = "cancelled"
        job.finished_at = time.time()
        self.store.save(job)  # first: refused, the job stays queued and runs (the caller's error)
        with contextlib.suppress(ValueError):
            self._queue.remove(job_id)
        self.metrics.pulls.labels(self._label(job.sandbox), "cancelled").inc()
        self._announce(job)
        self._pump()
        return job

    def status(self) -> dict[str, Any]:
        return {
            "accepting": self._accepting,
            "running": len(self._running),
            "queued": len(self._queue),
            "jobs": self.store.counts(),
            "sandboxes": sorted(self.config.sandboxes),
        }

    # -- dispatch ---------------------------------------------------------

    def _label(self, sandbox: str) -> str:
        return sandbox if sandbox in self.config.sandboxes else "adhoc"

    def _announce(self, job: Job) -> None:
        self.events.publish("job", job.to_json())

    def _pump(self) -> None:
        """Start queued jobs while global and per-sandbox limits allow."""
        self._threads = [t for t in self._threads if t.is_alive()]
        if not self._accepting:
            self.metrics.queued.set(len(self._queue))
            return
        per_box: dict[str, int] = {}
        for run in self._running.values():
            per_box[run.sandbox] = per_box.get(run.sandbox, 0) + 1
        for job_id in list(self._queue):
            if len(self._running) >= self.config.limits.max_concurrent:
                break
            job = self.store.get(job_id)
            # "running" in the store, queued here: the last daemon's run, requeued by
            # start() with that record refused (it runs); anything else ended meanwhile
            if job is None or job.state not in ("queued", "running"):
                self._queue.remove(job_id)
                continue
            if per_box.get(job.sandbox, 0) >= self.config.sandbox_concurrency(job.sandbox):
                continue
            self._queue.remove(job_id)
            per_box[job.sandbox] = per_box.get(job.sandbox, 0) + 1
            task = asyncio.get_running_loop().create_task(self._run(job), name=f"job {job.id}")
            self._running[job.id] = _Running(
                job=job, task=task, sandbox=job.sandbox, started=time.time()
            )
        self.metrics.queued.set(len(self._queue))
        self.metrics.in_flight.set(len(self._running))

    async def _run(self, job: Job) -> None:
        run = self._running[job.id]
        box: SandboxConfig | None = self.config.sandboxes.get(job.sandbox)
        label = self._label(job.sandbox)
        structlog.contextvars.bind_contextvars(job_id=job.id, sandbox=job.sandbox, snapshot="")
        job.state, job.started_at, job.attempts = "running", time.time(), job.attempts + 1
        job.finished_at = job.result = job.error = job.error_kind = job.exit_code = None
        self._save(job)  # if refused, the store says queued until the job's end is recorded
        self._announce(job)
        log.info("pull.start", uri=job.uri, dest=job.dest, attempt=job.attempts)
        state = "failed"
        summary: dict[str, Any]
        try:
            thread = self._start_thread(job, run, box)
            result = await asyncio.shield(thread.done)
            summary = result.to_json()
            state = "succeeded" if result.ok else "failed"
            if not result.ok:
                job.error, job.error_kind = result.error, result.error_kind
                job.exit_code = result.exit_code
            else:
                job.exit_code = 0
        except (asyncio.CancelledError, PullCancelled):
            # CancelledError: shutdown gave up waiting for the pull's thread
            state, summary = self._interrupted(job, run)
        except WsyncError as err:
            if run.cancel_requested or self._shutting_down:
                # the engine failed *because* it was cancelled: report the cancel
                state, summary = self._interrupted(job, run)
            else:
                summary = self._failure(job, err)
        except Exception as err:  # a bug: keep the daemon alive, report exit 1
            log.exception("pull.crashed")
            summary = self._failure(job, InternalError(f"{type(err).__name__}: {err}"))
        finally:
            self._running.pop(job.id, None)
        elapsed = time.time() - run.started
        job.state = state
        job.result = summary
        if state == "queued":
            job.result = None
            self._queue.insert(0, job.id)
        else:
            job.finished_at = time.time()
        if not self._save(job):
            # the pull is over whatever the store says: the queue goes on, and the record
            # is written again until it lands
            self._keep_unsaved(job)
        if state != "queued":
            self.metrics.observe_pull(label, state, elapsed, summary)
        log.info(
            "pull.end",
            state=state,
            elapsed_s=round(elapsed, 3),
            snapshot=summary.get("snapshot") or run.snapshot,
            resumed_chunks=summary.get("resumed_chunks", 0),
            retries=summary.get("retries", 0),
            faults=summary.get("faults", {}),
            error=job.error,
        )
        self._announce(job)
        self._pump()

    def _save(self, job: Job) -> bool:
        """Record ``job``; False (logged) when the store refused."""
        try:
            self.store.save(job)
        except WsyncError as err:
            log.warning("job.save_failed", job_id=job.id, state=job.state, error=str(err))
            return False
        self._unsaved.pop(job.id, None)  # a later record of the job replaces the one kept
        return True

    def _keep_unsaved(self, job: Job) -> None:
        """Keep ``job``'s record, which the store refused, to write it again later."""
        self._unsaved[job.id] = job
        if self._resaving is None or self._resaving.done():
            self._resaving = asyncio.get_running_loop().create_task(
                self._resave(), name="resave jobs"
            )

    async def _resave(self) -> None:
        """Write the records the store refused again, backing off to 30 s, until none is
        left (the fleet's job records retry the same way)."""
        delay = 1.0
        while self._unsaved:
            await asyncio.sleep(delay)
            saved = False
            for job in list(self._unsaved.values()):
                if self._save(job):
                    saved = True
                    log.info("job.saved", job_id=job.id, state=job.state)
            delay = 1.0 if saved else min(delay * 2, 30.0)

    def _start_thread(
        self, job: Job, run: _Running, box: SandboxConfig | None
    ) -> PullThread[PullResult]:
        """Start the job's pull on its own thread, confined by the config of this moment."""
        config = self.config
        options = config.pull_options(box)
        transport_options = resolve_transport_options(box)
        dest = Path(job.dest)
        puller = self._puller

        def progress(p: Any) -> None:  # on the pull's thread: copy now, record on this loop
            thread.to_main(self._on_progress, job, run, dataclasses.asdict(p))

        async def work() -> PullResult:
            structlog.contextvars.bind_contextvars(job_id=job.id, sandbox=job.sandbox, snapshot="")
            source = _check_source(job, config)
            root = _make_parent(dest, config.dest_roots)
            confined = dataclasses.replace(options, dest_root=root)
            return await puller(job.uri, dest, confined, {**transport_options, **source}, progress)

        thread: PullThread[PullResult] = PullThread(f"wsync-pull-{job.id}", work)
        # an outcome nobody awaits any more (shutdown gave up on it) is not an error
        thread.done.add_done_callback(lambda f: f.cancelled() or f.exception())
        run.thread = thread
        self._threads.append(thread)
        thread.start()
        if run.cancel_requested:  # DELETE arrived between dispatch and now
            thread.cancel()
        return thread

    def _interrupted(self, job: Job, run: _Running) -> tuple[str, dict[str, Any]]:
        """A cancel by request ends the job; a shutdown puts it back in the queue."""
        state = "cancelled" if run.cancel_requested or not self._shutting_down else "queued"
        summary = self._failure(job, None)
        job.error = (
            "cancelled by request"
            if state == "cancelled"
            else "interrupted by daemon shutdown; resumes on restart"
        )
        job.error_kind, job.exit_code = "interrupted", 130
        summary.update(error=job.error, error_kind="interrupted", exit_code=130)
        return state, summary

    def _failure(self, job: Job, err: WsyncError | None) -> dict[str, Any]:
        return failure_summary(job, err)

    def _on_progress(self, job: Job, run: _Running, progress: dict[str, Any]) -> None:
        """Engine progress (often, relayed from the pull's thread): keep the latest
        numbers, rate-limit events and writes."""
        if job.state != "running" or self._running.get(job.id) is not run:
            return  # a late relay after the job was recorded
        job.progress = progress
        snapshot = str(progress.get("snapshot") or "")
        if snapshot and snapshot != run.snapshot:
            run.snapshot = snapshot
            log.info("pull.snapshot", snapshot=snapshot)
        now = time.monotonic()
        if now - run.last_event >= PROGRESS_EVENT_INTERVAL:
            run.last_event = now
            self.events.publish(
                "progress", {"id": job.id, "sandbox": job.sandbox, "progress": job.progress}
            )
        if now - run.last_save >= PROGRESS_SAVE_INTERVAL:
            run.last_save = now
            with contextlib.suppress(WsyncError):
                self.store.save(job)

    # -- schedules --------------------------------------------------------

    def _start_schedulers(self) -> None:
        loop = asyncio.get_running_loop()
        for name in set(self._next_fire) - set(self.config.sandboxes):
            del self._next_fire[name]
        for name, box in self.config.sandboxes.items():
            if box.interval is not None:
                self._schedulers[name] = loop.create_task(
                    self._schedule(name, box.interval, box.jitter), name=f"schedule {name}"
                )

    async def _schedule(self, name: str, interval: float, jitter: float) -> None:
        """Submit a pull of ``name`` now-ish and then every ``interval`` +/- jitter; after a
        reload, when the schedule before it was due (at most an interval away)."""
        due = self._next_fire.get(name)
        if due is None:
            delay = random.uniform(0, interval * jitter)  # noqa: S311 - spreading load
        else:
            delay = min(max(due - time.monotonic(), 0.0), interval * (1 + jitter))
        while True:
            self._next_fire[name] = time.monotonic() + delay
            await asyncio.sleep(delay)
            try:
                job, reconciled = self.submit(name, None, trigger="schedule")
                if not reconciled:
                    log.info("schedule.fired", sandbox=name, job_id=job.id)
            except WsyncError as err:
                log.warning("schedule.refused", sandbox=name, error=str(err))
            delay = interval * (1 + random.uniform(-jitter, jitter))  # noqa: S311
