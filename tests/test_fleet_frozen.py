"""A fleet member frozen (SIGSTOP, a paused VM) or cut off *inside* a store transaction.

Found by a red-team review: a member frozen while it held the fleet-wide claim lock
kept it for as long as it stayed frozen (the server sees an idle session, for hours
when the host is gone), and every other member's dispatcher waited behind it: no
expired lease was taken over and no new job claimed, with ``/readyz`` still 200.

Here a member's store call is frozen in-process, at a chosen statement, by holding
its coroutine (its session on the server is then idle in its transaction, exactly as
for a stopped process); the other member must get on within a bounded time, and the
frozen one, once thawed, must see a store error, never a success.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import pytest

from test_daemon_fleet import pg_dsn  # noqa: F401 - the fixture
from wsync.daemon import pgstore
from wsync.daemon.pgstore import PgStore, StoreDown, new_owner_id
from wsync.daemon.store import Job, new_job_id

T = TypeVar("T")

LEASE = 3.0
#: how long the other member may take to get on (generous: a loaded 2-core machine)
BOUND = 45.0
CLAIM_ARGS = (["/roots"], ["box"], False, {}, 1, 0)


class _Gate:
    """Freezes a connection before the first statement after one containing ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.passed = False
        self.frozen = asyncio.Event()
        self.thaw = asyncio.Event()

    async def __call__(self, sql: object) -> None:
        if self.passed and not self.frozen.is_set():
            self.frozen.set()
            await self.thaw.wait()
        if self.marker in str(sql):
            self.passed = True


class _Cursor:
    def __init__(self, cur: Any, gate: _Gate) -> None:
        self._cur, self._gate = cur, gate

    async def execute(self, sql: object, *args: Any, **kwargs: Any) -> Any:
        await self._gate(sql)
        await self._cur.execute(sql, *args, **kwargs)
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class _Conn:
    def __init__(self, conn: Any, gate: _Gate) -> None:
        self._conn, self._gate = conn, gate

    async def execute(self, sql: object, *args: Any, **kwargs: Any) -> Any:
        await self._gate(sql)
        return await self._conn.execute(sql, *args, **kwargs)

    def cursor(self, *args: Any, **kwargs: Any) -> _Cursor:
        return _Cursor(self._conn.cursor(*args, **kwargs), self._gate)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def freeze_after(store: PgStore, marker: str) -> _Gate:
    """Make ``store``'s next transaction stop (until ``gate.thaw``) after ``marker``."""
    gate = _Gate(marker)
    real = store.pool.connection

    @contextlib.asynccontextmanager
    async def connection(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async with real(*args, **kwargs) as conn:
            yield _Conn(conn, gate)

    store.pool.connection = connection  # type: ignore[method-assign]
    return gate


async def until(what: str, ask: Callable[[], Awaitable[T | None]]) -> T:
    """Ask again (each ask itself bounded) until an answer, within :data:`BOUND` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND
    while True:
        left = deadline - loop.time()
        if left <= 0:
            pytest.fail(f"{what}: nothing within {BOUND:.0f} s")
        try:
            answer = await asyncio.wait_for(ask(), left)
        except TimeoutError:
            pytest.fail(f"{what}: still waiting after {BOUND:.0f} s (blocked behind the lock)")
        if answer is not None:
            return answer
        await asyncio.sleep(0.2)


def job(name: str = "box") -> Job:
    return Job(id=new_job_id(), sandbox=name, uri=f"local:/ws/{name}", dest=f"/roots/{name}")


def test_a_member_frozen_inside_its_claim_does_not_stop_the_others_claiming(
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    async def run() -> tuple[str, str]:
        a, b = (PgStore(pg_dsn, new_owner_id(), LEASE) for _ in range(2))
        await a.open()
        await b.open()
        try:
            queued = job()
            await b.submit(queued)
            gate = freeze_after(a, "advisory_xact_lock")
            frozen = asyncio.create_task(a.claim(*CLAIM_ARGS))
            await asyncio.wait_for(gate.frozen.wait(), BOUND)  # A holds the claim lock now
            claimed = await until("the other member's claim", lambda: b.claim(*CLAIM_ARGS))
            assert claimed.job.id == queued.id
            gate.thaw.set()
            # the frozen member's transaction was ended by the server: its claim is a
            # store error (retried later), never a lease on the job B now holds
            with pytest.raises(StoreDown):
                await asyncio.wait_for(frozen, BOUND)
            return claimed.job.id, b.owner
        finally:
            await a.close()
            await b.close()

    job_id, owner = asyncio.run(run())
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        attempts = conn.execute("SELECT job_id, owner FROM wsync_attempts").fetchall()
    assert attempts == [(job_id, owner)]


def test_a_member_frozen_while_firing_a_schedule_does_not_stop_it_firing(
    pg_dsn: str,  # noqa: F811 - the fixture
) -> None:
    """``schedule_due`` holds the schedule's row lock the same way as a claim its lock."""

    async def run() -> None:
        a, b = (PgStore(pg_dsn, new_owner_id(), LEASE) for _ in range(2))
        await a.open()
        await b.open()
        try:
            assert await b.schedule_due("tick", 0.0, 3600.0, job("tick")) is not None
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("UPDATE wsync_schedule SET next_at = now() - interval '1 s'")
                conn.execute("DELETE FROM wsync_jobs")
            gate = freeze_after(a, "UPDATE wsync_schedule")
            frozen = asyncio.create_task(a.schedule_due("tick", 0.0, 3600.0, job("tick")))
            await asyncio.wait_for(gate.frozen.wait(), BOUND)  # A holds the row now
            fired = await until(
                "the other member's fire",
                lambda: b.schedule_due("tick", 0.0, 3600.0, job("tick")),
            )
            assert fired[1] is False  # queued anew: A's insert never landed
            gate.thaw.set()
            with pytest.raises(StoreDown):
                await asyncio.wait_for(frozen, BOUND)
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM wsync_jobs").fetchone() == (1,)


def test_the_limits_are_the_transactions_own_and_no_startup_option(pg_dsn: str) -> None:  # noqa: F811
    """The limits travel as ``SET LOCAL`` in each transaction, not as a connection's
    startup ``options``: a pooler such as PgBouncer refuses startup parameters it does
    not know, and the fleet could not connect through one (found by a review)."""
    options = pgstore.session_options()
    assert "options" not in options and options["keepalives"] == 1

    async def run() -> tuple[str, str, str]:
        conn = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True, **options)
        try:
            async with conn.transaction():
                await pgstore._bounded(conn, 30.0)
                inside = await (await conn.execute("SHOW lock_timeout")).fetchone()
                idle = await (
                    await conn.execute("SHOW idle_in_transaction_session_timeout")
                ).fetchone()
            after = await (await conn.execute("SHOW lock_timeout")).fetchone()
        finally:
            await conn.close()
        assert inside and idle and after
        return str(inside[0]), str(idle[0]), str(after[0])

    inside, idle, after = asyncio.run(run())
    assert inside == idle == "10s"  # a third of the lease, at most 10 s
    assert after == "0"  # the connection's own setting again: nothing leaks out
