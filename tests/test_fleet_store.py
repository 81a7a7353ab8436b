""":class:`PgStore` on a real PostgreSQL, in-process: races the daemon tests cannot time.

In a running fleet a duplicate fire of the schedule needs two daemons to read the
schedule as due within the same few milliseconds, which the daemon tests cannot
arrange; here several stores (each its own pool and owner, as daemons are) call
:meth:`PgStore.schedule_due` at the same instant, round after round.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import psycopg
import pytest

from test_daemon_fleet import pg_dsn  # noqa: F401 - the fixture
from wsync.daemon import fleet
from wsync.daemon.config import load_config
from wsync.daemon.metrics import Metrics
from wsync.daemon.pgstore import PgStore, StoreDown, new_owner_id
from wsync.daemon.store import Job, new_job_id
from wsync.errors import InternalError

RACERS = 6
ROUNDS = 5


def test_a_due_schedule_is_won_by_exactly_one_of_many_racing_daemons(
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    async def race() -> list[int]:
        stores = [PgStore(pg_dsn, new_owner_id(), 10.0) for _ in range(RACERS)]
        await asyncio.gather(*(s.open() for s in stores))
        winners = []
        try:
            for _ in range(ROUNDS):
                # due for everyone: next_at in the past (on the first round, no row yet)
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    conn.execute("UPDATE wsync_schedule SET next_at = now() - interval '1 s'")
                fired = await asyncio.gather(
                    *(
                        s.schedule_due(
                            "tick",
                            0.0,
                            3600.0,
                            Job(
                                id=new_job_id(),
                                sandbox="tick",
                                uri="local:/ws",
                                dest="/roots/tick",
                                trigger="schedule",
                            ),
                        )
                        for s in stores
                    )
                )
                winners.append(sum(1 for f in fired if f is not None))
        finally:
            await asyncio.gather(*(s.close() for s in stores))
        return winners

    winners = asyncio.run(race())
    assert winners == [1] * ROUNDS, winners
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        jobs = conn.execute("SELECT count(*) FROM wsync_jobs").fetchone()
    # the first winner queued the job; the later ones reconciled into it (still queued)
    assert jobs == (1,)


def test_a_value_the_store_refuses_is_an_error_of_the_query_not_an_outage(
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    """PostgreSQL's text holds no NUL: such a value in a query is refused with a DataError,
    which the store had reported as ``StoreDown`` (a fleet daemon answered 503 and turned
    ``/readyz`` to 503 for any caller's ``/v1/pulls/%00``; found by an independent review)."""

    async def ask() -> None:
        store = PgStore(pg_dsn, new_owner_id(), 10.0)
        await store.open()
        try:
            with pytest.raises(InternalError, match="refused a value") as refused:
                await store.get("j-\x00")
            assert not isinstance(refused.value, StoreDown)
            assert await store.get("j-0") is None  # the store itself is fine
        finally:
            await store.close()

    asyncio.run(ask())


def test_a_cancel_that_came_while_the_job_was_handed_back_reaches_the_next_owner(
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    """Found by a red-team review: a DELETE answered 202 while the owner was handing the
    job back (its shutdown, a busy DEST) was lost, the release clearing the flag, and
    the next daemon ran the job to the end.  The flag now stays for the next claim."""

    async def run() -> bool:
        a, b = (PgStore(pg_dsn, new_owner_id(), 10.0) for _ in range(2))
        await a.open()
        await b.open()
        try:
            job = Job(id=new_job_id(), sandbox="box", uri="local:/ws", dest="/roots/box")
            await a.submit(job)
            args = (["/roots"], ["box"], False, {}, 1, 0)
            claimed = await a.claim(*args)
            assert claimed is not None and not claimed.cancel_requested
            assert await b.request_cancel(job.id) == a.owner
            released = claimed.job
            released.state = "queued"
            assert await a.finish(released, claimed.fence, "released")
            again = await b.claim(*args)
            assert again is not None and again.job.id == job.id
            return again.cancel_requested
        finally:
            await a.close()
            await b.close()

    assert asyncio.run(run())


def idle_manager(tmp_path: Path, dsn: str) -> fleet.FleetManager:
    """A fleet daemon's manager, not started (its store is replaced by a test's stub)."""
    config = load_config(
        None,
        {
            "state_dir": str(tmp_path / "state"),
            "engine_dir": str(tmp_path / "engine"),
            "dest_roots": [str(tmp_path / "roots")],
            "store": dsn,
        },
    )
    return fleet.FleetManager(config, Metrics())


def test_a_renewal_the_store_refuses_does_not_end_the_renewals(
    tmp_path: Path,
    pg_dsn: str,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A renewal refused as a query error (not an outage; the progress is the only value
    not wsync's own): the lease is renewed without the progress, and the renewer goes on.
    Before, the error ended the renew loop, and every lease the daemon held ran out under
    its running pulls, each then fenced at its swap."""
    monkeypatch.setattr(fleet, "RENEW_EVERY", 0.05)
    manager = idle_manager(tmp_path, pg_dsn)
    asks: list[object] = []

    class Refusing:
        async def renew(self, job_id: str, fence: int, progress: object) -> bool | None:
            asks.append(progress)
            if progress is not None:
                raise InternalError("job store refused a value: test")
            return False

    manager.store = Refusing()  # type: ignore[assignment]
    job = Job(id=new_job_id(), sandbox="s", uri="local:/ws", dest="/roots/s", trigger="api")
    job.progress = {"phase": "pull"}
    run = fleet._Run(job=job, fence=1, confirmed=0.0)
    manager._running[job.id] = run

    async def renewals() -> None:
        task = asyncio.create_task(manager._renew())
        try:
            for _ in range(400):
                await asyncio.sleep(0.05)
                if len(asks) >= 3 or task.done():
                    break
        finally:
            task.cancel()
        assert not task.done() or task.cancelled(), task

    asyncio.run(renewals())
    assert len(asks) >= 3 and asks[:2] == [{"phase": "pull"}, None], asks
    assert run.confirmed > 0.0 and not run.lost


async def ended_job(dsn: str, end: Callable[[Job], object]) -> Job | None:
    """A job submitted, claimed, given its end by ``end`` and finished in the store at
    ``dsn``; the job as the store gives it back."""
    store = PgStore(dsn, new_owner_id(), 10.0)
    await store.open()
    try:
        await store.submit(Job(id=new_job_id(), sandbox="box", uri="local:/ws", dest="/r/box"))
        claimed = await store.claim(["/r"], ["box"], False, {}, 1, 0)
        assert claimed is not None
        end(claimed.job)
        assert await store.finish(claimed.job, claimed.fence, claimed.job.state)
        return await store.get(claimed.job.id)
    finally:
        await store.close()


def test_a_job_end_quoting_a_nul_or_a_name_not_utf8_is_recorded(
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    """PostgreSQL's text and jsonb hold no NUL and no lone surrogate, and a job's error may
    quote a hostile sshd's words or a file name that is not UTF-8: the final write was
    refused as an outage, retried for good, and the job's lease ran out (found by review)."""

    def end(job: Job) -> None:
        job.state, job.error_kind, job.exit_code = "failed", "transport", 3
        job.error = "ssh handshake failed: a\x00b"
        job.result = {"warnings": ["kept \udcff.txt"], "k\x00": 1}
        job.progress = {"phase": "pull\x00"}

    stored = asyncio.run(ended_job(pg_dsn, end))
    assert stored is not None and stored.state == "failed"
    assert stored.error == "ssh handshake failed: a\\x00b"
    assert stored.result == {"warnings": ["kept \\udcff.txt"], "k\\x00": 1}
    assert stored.progress == {"phase": "pull\\x00"}


def test_a_job_end_the_store_refuses_is_written_once_more_without_its_words(
    tmp_path: Path,
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    """A refused value is not an outage: the same write would be refused for good, so the
    end goes once more without the job's own words, and is given up after that."""
    manager = idle_manager(tmp_path, pg_dsn)
    writes: list[tuple[str | None, object]] = []

    class Refusing:
        def __init__(self, refusals: int) -> None:
            self.refusals = refusals

        async def finish(self, job: Job, fence: int, outcome: str, backoff: float) -> bool:
            writes.append((job.error, job.result))
            if len(writes) <= self.refusals:
                raise InternalError("job store refused a value: test")
            return True

    def end(refusals: int) -> bool:
        writes.clear()
        manager.store = Refusing(refusals)  # type: ignore[assignment]
        job = Job(id=new_job_id(), sandbox="s", uri="local:/ws", dest="/roots/s", trigger="api")
        job.state, job.error, job.result = "failed", "words", {"error": "words"}
        return asyncio.run(manager._record(fleet._Run(job=job, fence=1), "failed", 0.0))

    assert end(1) is True
    assert writes[0] == ("words", {"error": "words"}) and writes[1][1] is None
    assert writes[1][0] is not None and "refused" in writes[1][0]
    assert end(5) is False and len(writes) == 2


def test_both_stores_give_a_job_with_odd_text_back_alike(
    tmp_path: Path,
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    """The single daemon's SQLite store kept a NUL raw and could not save a lone surrogate
    in a job's error (the job's task died, its row left running); the fleet's escapes
    both.  Both escape now, alike (found by review)."""
    from wsync.daemon.store import JobStore

    def odd(job: Job) -> Job:
        job.state, job.error_kind, job.exit_code = "failed", "transport", 3
        job.error = "a\x00b \udcff"
        job.result = {"warnings": ["kept \udcff.txt"]}
        return job

    single = JobStore(tmp_path / "jobs.sqlite")
    try:
        job = Job(id=new_job_id(), sandbox="box", uri="local:/ws", dest="/r/box")
        single.insert(job)
        single.save(odd(job))
        from_single = single.get(job.id)
    finally:
        single.close()

    from_fleet = asyncio.run(ended_job(pg_dsn, odd))
    assert from_single is not None and from_fleet is not None
    assert from_single.error == from_fleet.error == "a\\x00b \\udcff"
    assert from_single.result == from_fleet.result == {"warnings": ["kept \\udcff.txt"]}


def test_a_job_end_that_is_no_json_is_a_refused_value_not_an_outage(
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    """A TypeError of ``json.dumps`` was taken for an outage: retried for good."""

    def end(job: Job) -> None:
        job.state, job.result = "succeeded", {"raw": b"bytes"}

    with pytest.raises(InternalError) as info:
        asyncio.run(ended_job(pg_dsn, end))
    assert not isinstance(info.value, StoreDown)


def fleet_attempts(dsn: str) -> list[tuple[int, str | None, bool]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT fence, outcome, ended_at IS NOT NULL FROM wsync_attempts ORDER BY fence"
        ).fetchall()
    return [(int(f), o, bool(e)) for f, o, e in rows]


class _AnswerLost:
    """The real store, but its first ``finish`` commits and then loses its answer;
    ``between`` runs in that moment (another daemon at work)."""

    def __init__(
        self, store: PgStore, between: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self.store = store
        self.between = between
        self.calls = 0

    async def finish(self, job: Job, fence: int, outcome: str, backoff: float) -> bool:
        self.calls += 1
        ok = await self.store.finish(job, fence, outcome, backoff)
        if self.calls == 1:
            assert ok
            if self.between is not None:
                await self.between()
            raise StoreDown("OperationalError: server closed the connection unexpectedly")
        return ok


async def _end_with_its_answer_lost(
    manager: fleet.FleetManager,
    store: PgStore,
    between: Callable[[], Awaitable[None]] | None = None,
) -> tuple[bool, Job | None]:
    """A claimed job's successful end recorded through :class:`_AnswerLost` (which must
    have retried): what the manager's record said, and the job as the store holds it."""
    await store.open()
    try:
        await store.submit(Job(id=new_job_id(), sandbox="s", uri="local:/ws", dest="/r/s"))
        claimed = await store.claim(["/r"], ["s"], False, {}, 1, 0)
        assert claimed is not None
        claimed.job.state, claimed.job.exit_code = "succeeded", 0
        lossy = _AnswerLost(store, between)
        manager.store = lossy  # type: ignore[assignment]
        recorded = await manager._record(
            fleet._Run(job=claimed.job, fence=claimed.fence), "succeeded", 0.0
        )
        assert lossy.calls == 2  # the retry did happen
        return recorded, await store.get(claimed.job.id)
    finally:
        await store.close()


def test_a_job_end_whose_commit_answer_was_lost_is_not_taken_for_a_fenced_write(
    tmp_path: Path,
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    """Found by a red-team review: the connection dropped after PostgreSQL committed a job's
    end but before its answer came; the retry found the job no longer running, took that
    for a fencing refusal, rewrote the attempt's ``succeeded`` to ``fenced``, counted a
    fenced write and neither the pull nor its NOTIFY.  The retry is now a success."""
    manager = idle_manager(tmp_path, pg_dsn)
    store = PgStore(pg_dsn, new_owner_id(), 10.0)
    recorded, stored = asyncio.run(_end_with_its_answer_lost(manager, store))
    assert recorded is True
    assert stored is not None and stored.state == "succeeded"
    assert manager.metrics.fenced._value.get() == 0
    assert fleet_attempts(pg_dsn) == [(1, "succeeded", True)]


def test_a_refused_job_end_marks_an_expired_attempt_fenced_and_never_a_recorded_one(
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    """Fencing holds with the idempotent end: a write of an old fence is still refused."""

    async def run() -> None:
        a, b = (PgStore(pg_dsn, new_owner_id(), 1.0) for _ in range(2))
        await a.open()
        await b.open()
        try:
            await a.submit(Job(id=new_job_id(), sandbox="s", uri="local:/ws", dest="/r/s"))
            args = (["/r"], ["s"], False, {}, 1, 0)
            first = await a.claim(*args)
            assert first is not None
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("UPDATE wsync_jobs SET lease_until = now() - interval '1 s'")
            second = await b.claim(*args)  # a takeover: the first attempt is 'expired'
            assert second is not None and second.fence == first.fence + 1
            second.job.state, second.job.exit_code = "succeeded", 0
            assert await b.finish(second.job, second.fence, "succeeded")
            first.job.state, first.job.exit_code = "succeeded", 0
            assert not await a.finish(first.job, first.fence, "succeeded")
            assert not await a.finish(first.job, first.fence, "succeeded")  # a retry too
            # the new owner's retry of its own end, and an old write under its fence
            assert await b.finish(second.job, second.fence, "succeeded")
            assert not await a.finish(second.job, second.fence, "failed")
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())
    assert fleet_attempts(pg_dsn) == [(1, "fenced", True), (2, "succeeded", True)]


def test_a_pruned_jobs_attempts_go_with_it(
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    """``wsync_attempts`` (the audit: one row per claim) was never pruned: a fleet that
    pulls every few minutes grew it by hundreds of rows a day for ever, long after the
    jobs they describe were pruned.  A pruned job's attempts now go with it; the kept
    jobs keep theirs, and so does a running claim."""

    async def run() -> tuple[set[str], set[str], str]:
        store = PgStore(pg_dsn, new_owner_id(), 10.0)
        await store.open()
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:  # (a scratch database)
                # an attempt whose job an earlier prune took (before this fix)
                conn.execute(
                    "INSERT INTO wsync_attempts (job_id, fence, owner, sandbox, dest, "
                    "takeover, ended_at, outcome) VALUES ('j-long-gone', 1, 'o', 'box', "
                    "'/roots/box', false, now(), 'succeeded')"
                )
            args = (["/roots"], ["box"], False, {}, 1, 0)
            for _ in range(12):
                job = Job(id=new_job_id(), sandbox="box", uri="local:/ws", dest="/roots/box")
                await store.submit(job)
                claimed = await store.claim(*args)
                assert claimed is not None and claimed.job.id == job.id
                done = claimed.job
                done.state = "succeeded"
                assert await store.finish(done, claimed.fence, "succeeded")
                await asyncio.sleep(0.002)  # (created_at orders them)
            running = Job(id=new_job_id(), sandbox="box", uri="local:/ws", dest="/roots/box")
            await store.submit(running)
            assert await store.claim(*args) is not None
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                # (a pruned job's audit rows outlive it for a day: see the next test)
                conn.execute(
                    "UPDATE wsync_attempts SET started_at = started_at - interval '2 days', "
                    "ended_at = ended_at - interval '2 days'"
                )
            await store.prune(10)
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                jobs = {r[0] for r in conn.execute("SELECT id FROM wsync_jobs")}
                audited = {r[0] for r in conn.execute("SELECT job_id FROM wsync_attempts")}
            return jobs, audited, running.id
        finally:
            await store.close()

    jobs, audited, running = asyncio.run(run())
    assert len(jobs) == 11 and running in jobs  # the 10 newest finished, and the running
    assert audited == jobs, audited ^ jobs


def test_a_job_end_whose_answer_was_lost_is_not_fenced_when_a_prune_came_between(
    tmp_path: Path,
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    """Found by a review: the idempotent retry of a job's end (its commit's answer lost)
    tells its own committed write from a takeover's refusal by the attempt's recorded
    outcome.  ``prune`` (run at every submit, by any daemon of the fleet) deleted the
    attempts of a pruned job at once: a long job, older than ``keep_finished_jobs``
    newer finished ones, pruned between the commit and the retry, was logged as a fenced
    write, counted in ``fenced`` and never announced.  Recent audit rows now stay."""
    manager = idle_manager(tmp_path, pg_dsn)
    store = PgStore(pg_dsn, new_owner_id(), 10.0)

    async def newer_jobs_then_prune() -> None:  # (another daemon's submit, in between)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for i in range(10):  # newer finished jobs: the long one is pruned
                conn.execute(
                    "INSERT INTO wsync_jobs (id, sandbox, uri, dest, state, trigger, "
                    "created_at) VALUES (%s, 's', 'local:/ws', '/r/s', 'succeeded', "
                    "'api', extract(epoch FROM now()) + %s)",
                    (f"newer-{i}", i + 1),
                )
        await store.prune(10)

    recorded, stored = asyncio.run(
        _end_with_its_answer_lost(manager, store, between=newer_jobs_then_prune)
    )
    assert recorded is True
    assert stored is None  # (pruned, as it should be)
    assert manager.metrics.fenced._value.get() == 0
