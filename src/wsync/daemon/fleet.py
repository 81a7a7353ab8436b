"""One daemon of a fleet: jobs, leases and schedules shared in PostgreSQL.

Several ``wsync daemon`` processes configured with the same ``store =
"postgresql://…"`` share one queue.  Each daemon runs a few loops on its own
event loop, and each pull on its own thread, as a single daemon does:

* the **dispatcher** claims jobs (:meth:`PgStore.claim`) while this daemon is
  under ``limits.max_concurrent``; placement (DEST under this daemon's roots,
  and a sandbox it has configured, or an ad-hoc URI if it allows URIs), dedupe
  and the per-sandbox and fleet-wide limits are decided by the claim's SQL, not here;
* the **renewer** extends every lease it holds every ``lease_seconds / 4`` (at
  most :data:`RENEW_EVERY` seconds apart, so that ``GET`` on any daemon shows
  fresh progress), saving progress with it; a renewal that finds the fence changed means
  another daemon owns the job now, so the local pull is stopped and nothing of
  it is written; a renewal that finds ``cancel_requested`` stops it as a
  cancel (the ``DELETE`` may have reached any daemon);
* the **fence** (:attr:`PullOptions.fence`) is the last check before DEST is
  swapped, on the pull's thread, by this daemon's monotonic clock: if the
  lease was last confirmed longer ago than it lasts (the process was frozen,
  or the store unreachable), the swap is refused and the job left to whoever
  owns it now;
* the **scheduler** asks the store which periodic sandboxes are due; the one
  daemon whose ``UPDATE`` wins inserts the job;
* the **listener** ``LISTEN``\\s for events from every daemon and hands them to
  this daemon's SSE clients, wakes the dispatcher, and stops a local pull at
  once when a cancel for it was requested elsewhere.

When the store is unreachable, pulls already held keep running, every loop
retries with backoff, ``/readyz`` says 503, and a finished job's record waits
in memory until the store is back (it is written only if the fence is still
ours).  Takeover after ``kill -9`` resumes the pull from the shared
``engine_dir`` journal (and the guest's staged snapshot), since the engine's
state lives there and not in one daemon's ``state_dir``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import time
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import structlog

from wsync.daemon.config import DaemonConfig, SandboxConfig, resolve_transport_options
from wsync.daemon.jobs import (
    PROGRESS_EVENT_INTERVAL,
    EventBroker,
    JobFinished,
    NotAccepting,
    Puller,
    UnknownJob,
    _check_source,
    _make_parent,
    engine_pull,
    failure_summary,
    resolve_request,
)
from wsync.daemon.metrics import Metrics
from wsync.daemon.pgstore import (
    CHANNEL,
    Claimed,
    PgStore,
    StoreDown,
    new_owner_id,
    session_options,
)
from wsync.daemon.pullthread import PullCancelled, PullThread
from wsync.daemon.store import FINAL_STATES, Job, StoreUnavailable, new_job_id
from wsync.engine.api import PullResult
from wsync.errors import Busy, Fenced, InternalError, WsyncError

log = structlog.get_logger("wsync.daemon")
T = TypeVar("T")

#: seconds a job whose journal or DEST lock was busy waits before it is claimed again
BUSY_BACKOFF = 2.0
#: the dispatcher looks for claimable jobs at least this often (expired leases, back-offs)
POLL_INTERVAL = 1.0
#: the longest a schedule this daemon refused waits before it is tried again (a daily
#: sandbox whose DEST was mended need not wait a day)
REFUSED_RETRY_MAX = 60.0
#: longest gap between lease renewals, which also carry the progress other daemons read
RENEW_EVERY = 2.0
#: backoff bounds while the store is unreachable
BACKOFF_MIN, BACKOFF_MAX = 0.2, 5.0
#: how long start-up waits for the store before the daemon gives up
START_TIMEOUT = 60.0


@dataclasses.dataclass(slots=True)
class _Run:
    job: Job
    fence: int
    task: asyncio.Task[None] | None = None
    thread: PullThread[PullResult] | None = None
    started: float = dataclasses.field(default_factory=time.time)
    #: monotonic time just before the last renewal the store accepted
    confirmed: float = dataclasses.field(default_factory=time.monotonic)
    cancel_requested: bool = False
    lost: bool = False
    last_event: float = 0.0
    snapshot: str = ""

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.cancel()


class FleetManager:
    """The :class:`~wsync.daemon.service.JobService` of a daemon in a fleet."""

    def __init__(self, config: DaemonConfig, metrics: Metrics, puller: Puller = engine_pull):
        assert config.store is not None
        self.config = config
        self.metrics = metrics
        self.events = EventBroker()
        self.owner = new_owner_id()
        self.store = PgStore(config.store, self.owner, config.lease_seconds)
        self._puller = puller
        self._running: dict[str, _Run] = {}
        self._threads: list[PullThread[PullResult]] = []
        self._loops: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._accepting = False
        self._shutting_down = False
        self._store_ok = False
        self._pending: set[asyncio.Task[Any]] = set()
        #: schedules refused here (DEST no longer allowed, say), by name: not tried again
        #: before this monotonic time (one refusal an interval, not one a poll)
        self._refused: dict[str, float] = {}
        #: monotonic time the ``wsync_jobs_queued`` gauge was last read from the store
        self._queued_at = -POLL_INTERVAL

    # -- lifecycle --------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self._accepting

    def store_ok(self) -> bool:
        return self._store_ok

    async def start(self) -> int:
        """Open the store (creating or migrating its schema), then start the loops."""
        deadline = time.monotonic() + START_TIMEOUT
        delay = BACKOFF_MIN
        while True:
            try:
                await self.store.open()
                break
            except StoreDown as err:
                self.metrics.store_errors.inc()
                if time.monotonic() > deadline:
                    raise StoreUnavailable(
                        f"unreachable at start-up, gave up after {START_TIMEOUT:.0f} s "
                        f"(check store / WSYNC_STORE and that PostgreSQL is up): {err.args[0]}"
                    ) from None
                log.warning("store.unreachable", error=str(err), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
        self._store_ok = True
        log.info("fleet.joined", owner=self.owner, lease_seconds=self.config.lease_seconds)
        self._accepting = True
        loop = asyncio.get_running_loop()
        for name, coro in (
            ("listen", self._listen()),
            ("dispatch", self._dispatch()),
            ("renew", self._renew()),
            ("schedule", self._schedule()),
        ):
            self._loops.append(loop.create_task(coro, name=f"fleet {name}"))
        return 0

    async def shutdown(self, grace: float) -> None:
        """Stop claiming, stop held pulls and hand their jobs back at once (journals stay)."""
        self._accepting = False
        self._shutting_down = True
        for task in self._loops:
            if task.get_name() != "fleet renew":  # keep our leases alive while pulls stop
                task.cancel()
        runs = list(self._running.values())
        for run in runs:
            run.stop()
        tasks = [run.task for run in runs if run.task is not None]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, *self._pending, return_exceptions=True)
        self._loops.clear()
        self.events.close()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.store.close()

    def busy_threads(self) -> int:
        return sum(1 for t in self._threads if t.is_alive())

    def reload(self, config: DaemonConfig) -> None:
        self.config = config
        self._refused.clear()  # the new config may have mended what was refused
        self._wake.set()

    def running_jobs(self) -> list[Job]:
        return [run.job for run in self._running.values()]

    # -- submission and queries --------------------------------------------

    async def submit(
        self, sandbox: str, dest: str | None, trigger: str = "api"
    ) -> tuple[Job, bool]:
        if not self._accepting:
            raise NotAccepting("the daemon is shutting down and takes no new jobs")
        name, uri, real_dest = resolve_request(self.config, sandbox, dest)
        job = Job(id=new_job_id(), sandbox=name, uri=uri, dest=real_dest, trigger=trigger)
        found, reconciled = await self._store(self.store.submit(job))
        if not reconciled:
            log.info("job.queued", job_id=job.id, sandbox=name, dest=real_dest, trigger=trigger)
            self._notify("job", job.id)
            self._spawn(self._prune())
        return found, reconciled

    async def get(self, job_id: str) -> Job:
        job: Job | None = await self._store(self.store.get(job_id))
        if job is None:
            raise UnknownJob(f"no job {job_id!r}")
        return self._live(job)

    def _live(self, job: Job) -> Job:
        run = self._running.get(job.id)
        if run is not None and job.state == "running":
            job.progress = run.job.progress
        return job

    async def list_jobs(
        self, *, states: Iterable[str] | None = None, sandbox: str | None = None, limit: int = 100
    ) -> list[Job]:
        jobs = await self._store(self.store.list_jobs(states=states, sandbox=sandbox, limit=limit))
        return [self._live(job) for job in jobs]

    async def cancel(self, job_id: str) -> Job:
        job = await self.get(job_id)
        if job.state in FINAL_STATES:
            raise JobFinished(f"job {job_id} already {job.state}")
        run = self._running.get(job_id)
        if run is not None:
            # in the store first: should this daemon die before its pull stops, the daemon
            # that takes the job over must cancel it, not pull it (the caller got a 202)
            await self._store(self.store.request_cancel(job_id))
            run.cancel_requested = True
            run.stop()
            return job
        done = await self._store(self.store.cancel_queued(job_id))
        if done is not None:
            self.metrics.pulls.labels(self._label(done.sandbox), "cancelled").inc()
            self._notify("job", job_id)
            return done
        owner = await self._store(self.store.request_cancel(job_id))
        if owner is None:  # it ended (or was handed back) meanwhile: look again
            job = await self.get(job_id)
            if job.state in FINAL_STATES:
                raise JobFinished(f"job {job_id} already {job.state}")
            return await self.cancel(job_id)
        self._notify("cancel", job_id)  # the owner stops at once; its renewal is the fallback
        return job

    async def status(self) -> dict[str, Any]:
        counts: dict[str, int] | None = None
        with contextlib.suppress(StoreDown):
            counts = await self.store.counts()
        return {
            "accepting": self._accepting,
            "running": len(self._running),
            "queued": (counts or {}).get("queued", 0),
            "jobs": counts,
            "sandboxes": sorted(self.config.sandboxes),
            "fleet": {"owner": self.owner, "store_ok": self._store_ok},
        }

    # -- the store, with its health ------------------------------------------

    async def _store(self, call: Awaitable[T]) -> T:
        """Await one store call, keeping ``/readyz`` and the error counter honest."""
        try:
            value = await call
        except StoreDown:
            self._down()
            raise
        self._store_ok = True
        return value

    def _down(self) -> None:
        self.metrics.store_errors.inc()
        if self._store_ok:
            log.warning("store.unreachable")
        self._store_ok = False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _notify(self, event: str, job_id: str, data: dict[str, Any] | None = None) -> None:
        async def send() -> None:
            with contextlib.suppress(StoreDown):
                await self.store.notify(event, job_id, data)

        self._spawn(send())

    async def _prune(self) -> None:
        with contextlib.suppress(StoreDown):
            await self.store.prune(self.config.limits.keep_finished_jobs)

    def _label(self, sandbox: str) -> str:
        return sandbox if sandbox in self.config.sandboxes else "adhoc"

    # -- loops ------------------------------------------------------------

    async def _dispatch(self) -> None:
        delay = BACKOFF_MIN
        while self._accepting:
            # cleared before the claim, not after it: a wake-up that comes while the claim
            # (or the gauge's count below) waits for the store is then not lost, and the
            # job it announces is claimed at once, not a poll later
            self._wake.clear()
            claimed: Claimed | None = None
            # the lease runs from the claim's transaction, which may have waited for the
            # claim lock: its fence check must count from before the ask, not after
            asked = time.monotonic()
            if len(self._running) < self.config.limits.max_concurrent:
                try:
                    claimed = await self._store(self._claim())
                    delay = BACKOFF_MIN
                except StoreDown as err:
                    log.warning("store.claim_failed", error=str(err), retry_in=delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, BACKOFF_MAX)
                    continue
            if claimed is not None:
                self._begin(claimed, asked)
                continue  # maybe more
            if time.monotonic() >= self._queued_at + POLL_INTERVAL:
                # the queue is the fleet's, in the store: the gauge reads it from there
                # (it was never set here, and said 0 whatever waited)
                self._queued_at = time.monotonic()
                with contextlib.suppress(StoreDown):
                    self.metrics.queued.set(await self._store(self.store.queued()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_INTERVAL)

    async def _claim(self) -> Claimed | None:
        config = self.config
        limits = {
            name: box.max_concurrent
            for name, box in config.sandboxes.items()
            if box.max_concurrent is not None
        }
        # DESTs are stored resolved (check_dest), so the roots must be too: a root that
        # is or passes through a symlink would otherwise never match, its jobs never run
        return await self.store.claim(
            [str(root.resolve(strict=False)) for root in config.dest_roots],
            sorted(config.sandboxes),
            config.api.allow_uris,
            limits,
            config.limits.per_sandbox,
            config.limits.fleet_max_concurrent,
        )

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(min(self.config.lease_seconds / 4, RENEW_EVERY))
            for run in list(self._running.values()):
                if run.lost:
                    continue
                asked = time.monotonic()
                try:
                    answer = await self._store(
                        self.store.renew(run.job.id, run.fence, run.job.progress or None)
                    )
                except StoreDown:
                    continue
                except WsyncError as err:
                    # the store refused a value, and the progress is the only one not
                    # wsync's own: the lease is renewed without it (else it would run out
                    # under the pull, fenced at its swap), and the loop goes on whatever
                    log.warning("lease.renew_refused", job_id=run.job.id, error=str(err))
                    try:
                        answer = await self._store(self.store.renew(run.job.id, run.fence, None))
                    except WsyncError:  # StoreDown too: the next round tries again
                        continue
                if answer is None:
                    run.lost = True
                    self.metrics.renewals.labels("lost").inc()
                    log.warning("lease.lost", job_id=run.job.id, fence=run.fence)
                    run.stop()
                    continue
                run.confirmed = asked
                self.metrics.renewals.labels("ok").inc()
                if answer and not run.cancel_requested:
                    run.cancel_requested = True
                    run.stop()

    async def _schedule(self) -> None:
        while self._accepting:
            await asyncio.sleep(min(POLL_INTERVAL, self._shortest_interval() / 4))
            boxes = {n: b for n, b in self.config.sandboxes.items() if b.interval is not None}
            if not boxes:
                continue
            now = time.monotonic()
            tried = sorted(n for n in boxes if self._refused.get(n, 0.0) <= now)
            try:
                due = await self._store(self.store.due_schedules(tried))
            except StoreDown:
                continue
            except WsyncError as err:  # the store refused the query: the loop goes on
                log.warning("schedule.failed", error=str(err))
                continue
            for name in due:
                # one sandbox refused (its DEST made a symlink out of the root, say) must
                # not stop the schedules sorted after it (found by an independent review)
                try:
                    await self._fire(name, boxes[name])
                except StoreDown:
                    break
                except WsyncError as err:
                    wait = min(boxes[name].interval or POLL_INTERVAL, REFUSED_RETRY_MAX)
                    self._refused[name] = time.monotonic() + wait
                    log.warning("schedule.refused", sandbox=name, error=str(err))
                else:
                    self._refused.pop(name, None)

    def _shortest_interval(self) -> float:
        intervals = [b.interval for b in self.config.sandboxes.values() if b.interval]
        return min(intervals, default=4 * POLL_INTERVAL)

    async def _fire(self, name: str, box: SandboxConfig) -> None:
        assert box.interval is not None
        _name, uri, dest = resolve_request(self.config, name, None)
        job = Job(id=new_job_id(), sandbox=name, uri=uri, dest=dest, trigger="schedule")
        first = random.uniform(0, box.interval * box.jitter)  # noqa: S311 - spreading load
        nxt = box.interval * (1 + random.uniform(-box.jitter, box.jitter))  # noqa: S311
        fired = await self._store(self.store.schedule_due(name, first, nxt, job))
        if fired is not None:
            # counted even when reconciled: a fire that left no new job is still a fire,
            # and the sum over the fleet is how "once per interval" is checked
            self.metrics.schedule_fires.labels("reconciled" if fired[1] else "queued").inc()
        if fired is not None and not fired[1]:
            log.info("schedule.fired", sandbox=name, job_id=job.id)
            self._notify("job", job.id)
            self._wake.set()

    async def _listen(self) -> None:
        """Relay NOTIFY events to this daemon's SSE clients; reconnect with backoff."""
        assert self.config.store is not None
        delay = BACKOFF_MIN
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self.config.store,
                    autocommit=True,
                    # keepalives: a LISTEN on a path gone silent is found and redone
                    **session_options(),
                )
            except (psycopg.Error, OSError) as err:
                self.metrics.store_errors.inc()
                log.warning("store.listen_failed", error=type(err).__name__, retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            delay = BACKOFF_MIN
            try:
                await conn.execute(f"LISTEN {CHANNEL}")
                self._wake.set()
                async for note in conn.notifies():
                    await self._on_event(note.payload)
            except (psycopg.Error, OSError) as err:
                self.metrics.store_errors.inc()
                log.warning("store.listen_lost", error=type(err).__name__)
            finally:
                with contextlib.suppress(Exception):
                    await conn.close()

    async def _on_event(self, payload: str) -> None:
        try:
            event = json.loads(payload)
            kind, job_id = str(event["event"]), str(event["id"])
        except (ValueError, KeyError, TypeError):
            return
        if kind == "cancel":
            run = self._running.get(job_id)
            if run is not None:
                run.cancel_requested = True
                run.stop()
            return
        if kind == "progress":
            data = event.get("data") or {}
            self.events.publish("progress", {"id": job_id, **data})
            return
        self._wake.set()  # a job queued or ended somewhere: maybe something to claim
        with contextlib.suppress(StoreDown):
            job = await self.store.get(job_id)
            if job is not None:
                self.events.publish("job", job.to_json())

    # -- running one claimed job -------------------------------------------

    def _begin(self, claimed: Claimed, asked: float) -> None:
        job = claimed.job
        run = _Run(
            job=job,
            fence=claimed.fence,
            cancel_requested=claimed.cancel_requested,
            confirmed=asked,
        )
        self._running[job.id] = run
        self.metrics.claims.inc()
        if claimed.takeover:
            self.metrics.takeovers.inc()
            log.info("job.takeover", job_id=job.id, sandbox=job.sandbox, fence=claimed.fence)
        run.task = asyncio.get_running_loop().create_task(self._run(run), name=f"job {job.id}")
        self.metrics.in_flight.set(len(self._running))

    async def _run(self, run: _Run) -> None:
        job = run.job
        structlog.contextvars.bind_contextvars(job_id=job.id, sandbox=job.sandbox, snapshot="")
        log.info("pull.start", uri=job.uri, dest=job.dest, attempt=job.attempts, fence=run.fence)
        self._notify("job", job.id)
        outcome, backoff = await self._pull(run)
        elapsed = time.time() - run.started
        if job.state != "queued":
            job.finished_at = time.time()
        self._running.pop(job.id, None)
        self.metrics.in_flight.set(len(self._running))
        recorded = await self._record(run, outcome, backoff)
        if recorded and job.state != "queued":
            self.metrics.observe_pull(
                self._label(job.sandbox), job.state, elapsed, job.result or {}
            )
        log.info(
            "pull.end",
            state=job.state if recorded else "fenced",
            elapsed_s=round(elapsed, 3),
            snapshot=(job.result or {}).get("snapshot") or run.snapshot,
            resumed_chunks=(job.result or {}).get("resumed_chunks", 0),
            reconciled=(job.result or {}).get("reconciled", False),
            fence=run.fence,
            error=job.error,
        )
        if recorded:
            self._notify("job", job.id)
        self._wake.set()

    async def _pull(self, run: _Run) -> tuple[str, float]:
        """Run the engine; set the job's final fields.  Returns (attempt outcome, back-off)."""
        job = run.job
        try:
            thread = self._start_thread(run)
            result = await asyncio.shield(thread.done)
            job.result = result.to_json()
            if result.ok:
                job.state, job.exit_code = "succeeded", 0
            else:
                job.state = "failed"
                job.error, job.error_kind, job.exit_code = (
                    result.error,
                    result.error_kind,
                    result.exit_code,
                )
            return job.state, 0.0
        except (asyncio.CancelledError, PullCancelled, Fenced):
            pass
        except Busy as err:
            if not (run.cancel_requested or self._shutting_down or run.lost):
                # the journal or DEST is locked by a pull we cannot see: a daemon that
                # froze past its lease.  Hand the job back and try again in a moment
                log.warning("pull.busy", error=str(err), retry_in=BUSY_BACKOFF)
                self._back_to_queue(job, str(err))
                return "busy", BUSY_BACKOFF
        except WsyncError as err:
            if not (run.cancel_requested or self._shutting_down or run.lost):
                job.result = failure_summary(job, err)
                job.state = "failed"
                return "failed", 0.0
        except Exception as err:  # a bug: keep the daemon alive, report exit 1
            log.exception("pull.crashed")
            job.result = failure_summary(job, InternalError(f"{type(err).__name__}: {err}"))
            job.state = "failed"
            return "failed", 0.0
        if run.cancel_requested and not run.lost:
            job.result = failure_summary(job, None)
            job.state, job.error, job.error_kind, job.exit_code = (
                "cancelled",
                "cancelled by request",
                "interrupted",
                130,
            )
            job.result.update(error=job.error, error_kind="interrupted", exit_code=130)
            return "cancelled", 0.0
        self._back_to_queue(job, "interrupted by daemon shutdown; another daemon resumes it")
        return "released", 0.0

    @staticmethod
    def _back_to_queue(job: Job, error: str) -> None:
        job.state, job.result, job.finished_at = "queued", None, None
        job.error, job.error_kind, job.exit_code = error, "interrupted", 130

    async def _record(self, run: _Run, outcome: str, backoff: float) -> bool:
        """Write the job's end if the fence is still ours; retry while the store is down."""
        # even after a lost renewal the write is tried: the fence in the store is the
        # authority, and its refusal is what the audit trail and /metrics record
        delay = BACKOFF_MIN
        give_up = time.monotonic() + (self.config.shutdown_grace if self._shutting_down else 1e9)
        ok: bool | None = None
        while ok is None:
            try:
                ok = await self._store(self.store.finish(run.job, run.fence, outcome, backoff))
            except StoreDown as err:
                if time.monotonic() > give_up:
                    log.error("store.record_lost", error=str(err), note="the lease expires")
                    return False
                log.warning("store.record_retry", error=str(err), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
            except WsyncError as err:
                # the store refused a value of the record (not an outage): the same write
                # would be refused for good, so the job's end goes once more without its
                # words (and is lost, the lease left to expire, if even that is refused)
                log.error("store.record_refused", job_id=run.job.id, error=str(err))
                if run.job.result is None and not run.job.progress:
                    return False
                run.job.progress, run.job.result = {}, None
                if run.job.error:
                    run.job.error = "the job store refused this job's error; see the daemon's log"
        if not ok:
            self.metrics.fenced.inc()
            log.warning("fence.refused", job_id=run.job.id, fence=run.fence)
        return ok

    def _start_thread(self, run: _Run) -> PullThread[PullResult]:
        job = run.job
        config = self.config
        box = config.sandboxes.get(job.sandbox)
        options = config.pull_options(box)
        transport_options = resolve_transport_options(box)
        dest = Path(job.dest)
        puller = self._puller
        lease = config.lease_seconds
        margin = min(1.0, lease / 10)

        def fence() -> None:  # on the pull's thread, just before DEST is swapped
            if run.lost or time.monotonic() > run.confirmed + lease - margin:
                raise Fenced(f"the lease on job {job.id} ran out before the swap; DEST untouched")

        def progress(p: Any) -> None:
            thread.to_main(self._on_progress, run, dataclasses.asdict(p))

        async def work() -> PullResult:
            structlog.contextvars.bind_contextvars(job_id=job.id, sandbox=job.sandbox, snapshot="")
            source = _check_source(job, config)
            root = _make_parent(dest, config.dest_roots)
            confined = dataclasses.replace(options, dest_root=root, fence=fence)
            return await puller(job.uri, dest, confined, {**transport_options, **source}, progress)

        thread: PullThread[PullResult] = PullThread(f"wsync-pull-{job.id}", work)
        thread.done.add_done_callback(lambda f: f.cancelled() or f.exception())
        run.thread = thread
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()
        if run.cancel_requested or self._shutting_down:
            thread.cancel()
        return thread

    def _on_progress(self, run: _Run, progress: dict[str, Any]) -> None:
        if self._running.get(run.job.id) is not run:
            return
        run.job.progress = progress
        snapshot = str(progress.get("snapshot") or "")
        if snapshot and snapshot != run.snapshot:
            run.snapshot = snapshot
            log.info("pull.snapshot", snapshot=snapshot)
        now = time.monotonic()
        if now - run.last_event >= PROGRESS_EVENT_INTERVAL:
            run.last_event = now
            self._notify("progress", run.job.id, {"sandbox": run.job.sandbox, "progress": progress})
