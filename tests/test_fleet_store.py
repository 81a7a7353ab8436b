""":class:`PgStore` on a real PostgreSQL, in-process: races the daemon tests cannot time.

In a running fleet a duplicate fire of the schedule needs two daemons to read the
schedule as due within the same few milliseconds, which the daemon tests cannot
arrange; here several stores (each its own pool and owner, as daemons are) call
:meth:`PgStore.schedule_due` at the same instant, round after round.
"""

from __future__ import annotations

import asyncio

import psycopg

from test_daemon_fleet import pg_dsn  # noqa: F401 - the fixture
from wsync.daemon.pgstore import PgStore, new_owner_id
from wsync.daemon.store import Job, new_job_id

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
