"""Jobs, leases and schedules of a daemon fleet in PostgreSQL (psycopg 3, async, pooled).

Why plain SQL on psycopg instead of a queue library: the rules that matter here
are wsync's own (one active job per sandbox and DEST, per-sandbox and fleet
limits, placement by ``dest_roots``, a fencing token checked on every write of
a running job), and each of them is one ``WHERE`` clause in a claim or an
update.  A queue library would own the job table and its states, and these
rules would have to be rebuilt around it.  procrastinate, the PostgreSQL task
queue for Python we weighed, has locks and queueing locks (one running / one
waiting job per key) that match the dedupe rule, but no per-sandbox or fleet-wide
concurrency counts, placement by path prefix or a fencing token checked on a
running job's writes: those would be SQL of our own beside its tables anyway.

How the rules hold with several daemons writing at once:

* **Claim**: one transaction tries a transaction-scoped advisory lock (claims
  are serialised fleet-wide, so the running counts it reads cannot change
  under it; a daemon that does not get it at once skips the round instead of
  waiting behind it), picks the oldest claimable job with ``FOR UPDATE SKIP LOCKED``
  and turns it into a lease: ``owner``, ``lease_until`` (the *database's*
  clock, the only clock the fleet shares) and ``fence`` + 1.  A job whose
  lease ran out while ``running`` is claimable again: that is a takeover.
* **Every later write** of a running job (progress, renewal, the final state,
  handing it back) carries ``WHERE fence = %s``: a daemon that was frozen or
  cut off and wakes up after a takeover changes nothing.
* **Dedupe**: a partial unique index over active jobs, as in SQLite.
* **Order**: a job's ``created_at`` is the database's clock at its insert, not the
  submitting daemon's: the claims' first-in first-out and the prune of the oldest
  finished jobs compare jobs that daemons on hosts with different clocks created (a
  host an hour behind had its jobs claimed first and its finished ones pruned at once).
* **Schedule**: ``UPDATE … WHERE next_at <= now() RETURNING`` is won by
  exactly one daemon per interval, and the job is inserted in the same
  transaction.
* **Audit**: every claim opens a row in ``wsync_attempts`` that its end closes
  (``succeeded``/``failed``/``cancelled``/``released``/``fenced``), so
  "exactly once" and "never two at once" can be checked after the fact.

**A member frozen or cut off inside a transaction** (SIGSTOP, a paused VM, a
partition) would keep its locks for as long as it stays so (the server sees
only an idle session, for hours if the host is gone): the claim lock, and with
it every other daemon's claims, takeovers included.  So every transaction
starts with server-side limits of its own (:func:`_bounded`, ``SET LOCAL``):
``idle_in_transaction_session_timeout`` ends such a session (and its
transaction, which never commits) after :func:`hold_limit` seconds, well under
the lease, and ``lock_timeout`` bounds any wait behind a lock the same way.
(Set per transaction, not as connection ``options``: a pooler such as PgBouncer
refuses startup parameters it does not know, and takes ``SET LOCAL`` in any
pooling mode.)  TCP keepalives and ``tcp_user_timeout`` on every connection
(:func:`session_options`) find a vanished server.  The
woken member's next statement fails, which is a store error (retried), never
a success: nothing of the aborted transaction was written, and its fence was
not renewed, so its pull is fenced as after any other lapse.

Events cross daemons by ``NOTIFY wsync_events`` (payload: the event name, the
job id, and for progress the numbers); each daemon ``LISTEN``\\s on its own
connection and fans out to its SSE clients.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool
from psycopg_pool.base import AttemptWithBackoff

from wsync.daemon.store import STATES, Job, StoreUnavailable, storable
from wsync.errors import InternalError

SCHEMA_VERSION = 1
CHANNEL = "wsync_events"
#: NOTIFY payloads must stay under 8000 bytes
_MAX_PAYLOAD = 7000
#: serialises claims fleet-wide (a constant key in the advisory lock space)
_CLAIM_LOCK = 0x77_73_79_6E  # "wsyn"
#: how long a pruned job's audit rows outlive it (see :meth:`PgStore.prune`), in seconds
_AUDIT_GRACE_S = 86_400.0
#: bounds of :func:`hold_limit`, in seconds
_HOLD_MIN, _HOLD_MAX = 1.0, 10.0

_MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE wsync_jobs (
    id               TEXT PRIMARY KEY,
    sandbox          TEXT NOT NULL,
    uri              TEXT NOT NULL,
    dest             TEXT NOT NULL,
    state            TEXT NOT NULL,
    trigger          TEXT NOT NULL,
    created_at       DOUBLE PRECISION NOT NULL,
    started_at       DOUBLE PRECISION,
    finished_at      DOUBLE PRECISION,
    attempts         INTEGER NOT NULL DEFAULT 0,
    progress         JSONB NOT NULL DEFAULT '{}',
    result           JSONB,
    error            TEXT,
    error_kind       TEXT,
    exit_code        INTEGER,
    owner            TEXT,
    lease_until      TIMESTAMPTZ,
    fence            BIGINT NOT NULL DEFAULT 0,
    cancel_requested BOOLEAN NOT NULL DEFAULT false,
    not_before       TIMESTAMPTZ
);
CREATE UNIQUE INDEX wsync_jobs_active ON wsync_jobs(uri, dest)
    WHERE state IN ('queued', 'running');
CREATE INDEX wsync_jobs_created ON wsync_jobs(created_at);
CREATE INDEX wsync_jobs_state ON wsync_jobs(state);
CREATE TABLE wsync_attempts (
    job_id     TEXT NOT NULL,
    fence      BIGINT NOT NULL,
    owner      TEXT NOT NULL,
    sandbox    TEXT NOT NULL,
    dest       TEXT NOT NULL,
    takeover   BOOLEAN NOT NULL,
    started_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    ended_at   TIMESTAMPTZ,
    outcome    TEXT,
    PRIMARY KEY (job_id, fence)
);
CREATE TABLE wsync_schedule (
    sandbox TEXT PRIMARY KEY,
    next_at TIMESTAMPTZ NOT NULL
);
""",
}

_JOB_COLUMNS = (
    "id, sandbox, uri, dest, state, trigger, created_at, started_at, finished_at, attempts, "
    "progress, result, error, error_kind, exit_code"
)


def new_owner_id() -> str:
    """Unique per process start: a restarted daemon never inherits its old leases."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def _job(row: Mapping[str, Any]) -> Job:
    return Job(
        id=row["id"],
        sandbox=row["sandbox"],
        uri=row["uri"],
        dest=row["dest"],
        state=row["state"],
        trigger=row["trigger"],
        created_at=row["created_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        attempts=row["attempts"],
        progress=dict(row["progress"] or {}),
        result=row["result"],
        error=row["error"],
        error_kind=row["error_kind"],
        exit_code=row["exit_code"],
    )


def _jsonb(value: Any) -> str | None:
    return None if value is None else json.dumps(storable(value), sort_keys=True)


def hold_limit(lease_seconds: float) -> float:
    """Seconds a session may sit idle inside a transaction, or wait for a lock.

    A third of the lease, so that a member frozen while it holds the claim lock
    (or a schedule's row) releases it well before the leases it held run out
    and the others must take them over; at least a second, so that a healthy
    daemon whose event loop is slow for a moment between two statements of one
    transaction is not cut off; at most ten, because the claim lock is
    fleet-wide: no job is claimed anywhere while it is held.
    """
    return min(max(lease_seconds / 3, _HOLD_MIN), _HOLD_MAX)


def session_options() -> dict[str, Any]:
    """libpq connection parameters of every store connection: client-side only (no
    startup ``options``, which poolers refuse; the server-side limits are set per
    transaction by :func:`_bounded`).  A server or path gone silent ends the call
    instead of hanging it."""
    return {
        "connect_timeout": 5,
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": 30_000,
    }


async def _bounded(conn: Any, lease_seconds: float) -> None:
    """The first statement of every transaction: its own limits on sitting idle and on
    waiting for a lock (module docstring), as ``SET LOCAL`` does, in one round trip."""
    hold_ms = str(int(hold_limit(lease_seconds) * 1000))
    await conn.execute(
        "SELECT set_config('idle_in_transaction_session_timeout', %s, true), "
        "set_config('lock_timeout', %s, true)",
        (hold_ms, hold_ms),
    )


class StoreDown(StoreUnavailable):
    """PostgreSQL is unreachable or refused a statement; the caller retries with backoff."""


# psycopg_pool retries a lost connection with a delay that doubles without a cap, so
# after an outage of some minutes the pool would stay empty for as long again after
# PostgreSQL is back.  A steady retry about once a second bounds that to a second.
AttemptWithBackoff.DELAY_BACKOFF = 1.0


class Claimed:
    """A lease this daemon holds on a job: the job, its fence, and whether it was a takeover."""

    __slots__ = ("cancel_requested", "fence", "job", "takeover")

    def __init__(self, job: Job, fence: int, takeover: bool) -> None:
        self.job, self.fence, self.takeover = job, fence, takeover
        self.cancel_requested = False


class PgStore:
    """All SQL of a fleet daemon; every method is one short transaction on the pool."""

    def __init__(self, dsn: str, owner: str, lease_seconds: float) -> None:
        self.dsn = dsn
        self.owner = owner
        self.lease_seconds = lease_seconds
        self.pool = self._new_pool()

    def _new_pool(self) -> AsyncConnectionPool:
        return AsyncConnectionPool(
            self.dsn,
            min_size=1,
            max_size=6,
            open=False,
            timeout=5.0,
            # an outage of any length ends when PostgreSQL is back, never in a dead pool
            reconnect_timeout=365 * 24 * 3600.0,
            kwargs={"autocommit": True, **session_options()},
            check=AsyncConnectionPool.check_connection,
            name="wsync-store",
        )

    async def open(self) -> None:
        """Open a pool and create or migrate the schema (under an advisory lock).

        Each call opens a new pool: psycopg_pool closes a pool whose first
        connection did not come within the wait, and a closed pool cannot be
        opened again, so retrying on the same one would fail at once for good
        (a database down longer than one wait at start-up was fatal).
        """
        await self.pool.close()  # the previous attempt's, if any (a no-op when never opened)
        self.pool = self._new_pool()
        try:
            await self.pool.open(wait=True, timeout=10.0)
        except Exception as err:
            raise StoreDown(f"cannot connect: {_say(err)}") from None
        await self.migrate()

    async def close(self) -> None:
        await self.pool.close()

    async def _run(
        self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()
    ) -> list[dict[str, Any]]:
        try:
            async with self.pool.connection() as conn:
                cur = conn.cursor(row_factory=dict_row)
                await cur.execute(sql, params)
                return await cur.fetchall() if cur.description else []
        except psycopg.errors.UniqueViolation:
            raise
        except psycopg.errors.DataError as err:
            # the store is up and refused a value (a NUL byte in text, a number out of
            # range): an error of this query, not of the store (readiness stays)
            raise InternalError(f"job store refused a value: {_say(err)}") from None
        except (psycopg.Error, OSError, TimeoutError) as err:
            raise StoreDown(_say(err)) from None
        except Exception as err:  # psycopg_pool.PoolTimeout and friends
            raise StoreDown(_say(err)) from None

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pool connection inside a transaction that starts with its own limits
        (:func:`_bounded`): every transaction of the store takes this, so none goes
        without them."""
        async with self.pool.connection() as conn, conn.transaction():
            await _bounded(conn, self.lease_seconds)
            yield conn

    async def migrate(self) -> int:
        """Apply the migrations this version knows beyond the database's; return the version."""
        try:
            async with self._transaction() as conn:
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_CLAIM_LOCK + 1,))
                await conn.execute(
                    "CREATE TABLE IF NOT EXISTS wsync_schema (version INTEGER NOT NULL)"
                )
                cur = await conn.execute("SELECT max(version) FROM wsync_schema")
                row = await cur.fetchone()
                have = int(row[0]) if row and row[0] is not None else 0
                if have > SCHEMA_VERSION:
                    raise StoreDown(
                        f"the database has schema version {have}, newer than this wsync's "
                        f"{SCHEMA_VERSION}; upgrade this daemon"
                    )
                for version in range(have + 1, SCHEMA_VERSION + 1):
                    await conn.execute(_MIGRATIONS[version])
                    await conn.execute("INSERT INTO wsync_schema VALUES (%s)", (version,))
                return SCHEMA_VERSION
        except psycopg.Error as err:
            raise StoreDown(_say(err)) from None

    # -- jobs: reads --------------------------------------------------------

    async def get(self, job_id: str) -> Job | None:
        rows = await self._run(f"SELECT {_JOB_COLUMNS} FROM wsync_jobs WHERE id = %s", (job_id,))  # noqa: S608
        return _job(rows[0]) if rows else None

    async def list_jobs(
        self, *, states: Iterable[str] | None = None, sandbox: str | None = None, limit: int = 100
    ) -> list[Job]:
        wanted = [s for s in (states or []) if s in STATES]
        rows = await self._run(
            f"SELECT {_JOB_COLUMNS} FROM wsync_jobs "  # noqa: S608
            "WHERE (cardinality(%(states)s::text[]) = 0 OR state = ANY(%(states)s)) "
            "AND (%(sandbox)s::text IS NULL OR sandbox = %(sandbox)s) "
            "ORDER BY created_at DESC, id DESC LIMIT %(limit)s",
            {"states": wanted, "sandbox": sandbox, "limit": limit},
        )
        return [_job(r) for r in rows]

    async def queued(self) -> int:
        """How many jobs wait in the fleet's queue (``wsync_jobs_queued``)."""
        rows = await self._run("SELECT count(*) AS n FROM wsync_jobs WHERE state = 'queued'")
        return int(rows[0]["n"]) if rows else 0

    async def counts(self) -> dict[str, int]:
        rows = await self._run("SELECT state, count(*) AS n FROM wsync_jobs GROUP BY state")
        counts = dict.fromkeys(STATES, 0)
        counts.update({r["state"]: int(r["n"]) for r in rows})
        return counts

    # -- jobs: submission and cancel ------------------------------------------

    async def submit(self, job: Job) -> tuple[Job, bool]:
        """Insert ``job``, or return the active one for the same (uri, dest) as reconciled."""
        for _ in range(5):
            rows = await self._run(
                f"INSERT INTO wsync_jobs ({_JOB_COLUMNS}) VALUES "  # noqa: S608
                "(%s, %s, %s, %s, 'queued', %s, extract(epoch FROM clock_timestamp()), "
                "NULL, NULL, 0, '{}', NULL, NULL, NULL, NULL) "
                "ON CONFLICT (uri, dest) WHERE state IN ('queued', 'running') DO NOTHING "
                "RETURNING id, created_at",
                (job.id, job.sandbox, job.uri, job.dest, job.trigger),
            )
            if rows:
                job.created_at = float(rows[0]["created_at"])
                return job, False
            found = await self._run(
                f"SELECT {_JOB_COLUMNS} FROM wsync_jobs "  # noqa: S608
                "WHERE uri = %s AND dest = %s AND state IN ('queued', 'running')",
                (job.uri, job.dest),
            )
            if found:
                return _job(found[0]), True
        raise StoreDown("the active job for this sandbox and DEST kept changing; try again")

    async def cancel_queued(self, job_id: str) -> Job | None:
        """Cancel a job that no daemon runs; None when it is running (or gone)."""
        rows = await self._run(
            "UPDATE wsync_jobs SET state = 'cancelled', finished_at = extract(epoch FROM now()), "  # noqa: S608
            "error = 'cancelled by request', error_kind = 'interrupted', exit_code = 130, "
            "owner = NULL, lease_until = NULL "
            f"WHERE id = %s AND state = 'queued' RETURNING {_JOB_COLUMNS}",
            (job_id,),
        )
        return _job(rows[0]) if rows else None

    async def request_cancel(self, job_id: str) -> str | None:
        """Flag a running job for its owner (who polls it with its renewals); its owner."""
        rows = await self._run(
            "UPDATE wsync_jobs SET cancel_requested = true "
            "WHERE id = %s AND state = 'running' RETURNING owner",
            (job_id,),
        )
        return str(rows[0]["owner"]) if rows else None

    # -- leases ---------------------------------------------------------------

    async def claim(
        self,
        roots: Sequence[str],
        sandboxes: Sequence[str],
        adhoc: bool,
        per_sandbox: Mapping[str, int],
        default_per_sandbox: int,
        fleet_max: int,
    ) -> Claimed | None:
        """Lease the oldest job this daemon may run now, or None.

        Claimable: ``queued`` (past any back-off), or ``running`` with a lease
        that ran out (a takeover).  DEST must lie under one of ``roots``; the
        job's sandbox must be one of ``sandboxes`` (the names this daemon has
        configured), or an ad-hoc URI (its ``sandbox`` is the URI, so it has a
        ``:``, which no configured name has) when ``adhoc`` (``api.allow_uris``).
        A job is pulled with the claiming daemon's excludes, options and secrets,
        so a daemon that does not know the sandbox must leave it to one that does.
        The sandbox must be under its limit and the fleet under ``fleet_max``
        (0: no cap), counting only running jobs with a live lease.

        None too when another daemon holds the claim lock: waiting behind it would
        hang this daemon's dispatcher for as long as that daemon stays frozen (its
        session ends after :func:`hold_limit` seconds), while the next round, a
        poll or a wake-up later, finds it free.
        """
        prefixes = [r.rstrip("/") + "/" for r in roots]
        try:
            async with self._transaction() as conn:
                cur = conn.cursor(row_factory=dict_row)
                await cur.execute("SELECT pg_try_advisory_xact_lock(%s) AS got", (_CLAIM_LOCK,))
                got = await cur.fetchone()
                if got is None or not got["got"]:
                    return None
                await cur.execute(
                    """
WITH live AS (
    SELECT sandbox, count(*) AS n FROM wsync_jobs
    WHERE state = 'running' AND lease_until > now() GROUP BY sandbox
), total AS (SELECT coalesce(sum(n), 0) AS n FROM live)
SELECT j.id, j.state AS was FROM wsync_jobs j LEFT JOIN live ON live.sandbox = j.sandbox
WHERE (j.state = 'queued' AND (j.not_before IS NULL OR j.not_before <= now())
       OR j.state = 'running' AND j.lease_until <= now())
  AND EXISTS (SELECT 1 FROM unnest(%(prefixes)s::text[]) p WHERE starts_with(j.dest, p))
  AND (j.sandbox = ANY(%(sandboxes)s::text[]) OR %(adhoc)s AND strpos(j.sandbox, ':') > 0)
  AND coalesce(live.n, 0) < coalesce((%(limits)s::jsonb ->> j.sandbox)::int, %(default)s)
  AND (%(fleet)s = 0 OR (SELECT n FROM total) < %(fleet)s)
ORDER BY j.created_at, j.id
LIMIT 1
FOR UPDATE OF j SKIP LOCKED
""",
                    {
                        "prefixes": prefixes,
                        "sandboxes": list(sandboxes),
                        "adhoc": adhoc,
                        "limits": json.dumps(dict(per_sandbox)),
                        "default": default_per_sandbox,
                        "fleet": fleet_max,
                    },
                )
                pick = await cur.fetchone()
                if pick is None:
                    return None
                await cur.execute(
                    "UPDATE wsync_jobs SET state = 'running', owner = %(owner)s, "  # noqa: S608
                    "lease_until = now() + make_interval(secs => %(ttl)s), fence = fence + 1, "
                    "attempts = attempts + 1, started_at = extract(epoch FROM now()), "
                    "finished_at = NULL, result = NULL, error = NULL, error_kind = NULL, "
                    "exit_code = NULL, not_before = NULL "
                    f"WHERE id = %(id)s RETURNING {_JOB_COLUMNS}, fence, cancel_requested",
                    {"owner": self.owner, "ttl": self.lease_seconds, "id": pick["id"]},
                )
                row = await cur.fetchone()
                assert row is not None  # the row is locked by this transaction
                takeover = pick["was"] == "running"
                if takeover:
                    # closed before the new attempt opens: the audit never shows two
                    # owners of one job at the same instant that the fence did not
                    await cur.execute(
                        "UPDATE wsync_attempts SET ended_at = clock_timestamp(), "
                        "outcome = 'expired' WHERE job_id = %s AND fence < %s AND ended_at IS NULL",
                        (row["id"], row["fence"]),
                    )
                await cur.execute(
                    "INSERT INTO wsync_attempts (job_id, fence, owner, sandbox, dest, takeover) "
                    "VALUES (%s, %s, %s, %s, %s, %s)",
                    (row["id"], row["fence"], self.owner, row["sandbox"], row["dest"], takeover),
                )
                claimed = Claimed(_job(row), int(row["fence"]), takeover)
                # a DELETE that reached a dead owner: the new owner stops at once
                claimed.cancel_requested = bool(row["cancel_requested"])
                return claimed
        except psycopg.errors.LockNotAvailable:
            # a row or index entry another transaction holds (a member frozen in it):
            # contention, not an outage; that transaction ends within hold_limit
            return None
        except psycopg.Error as err:
            raise StoreDown(_say(err)) from None
        except Exception as err:
            if isinstance(err, StoreDown):
                raise
            raise StoreDown(_say(err)) from None

    async def renew(self, job_id: str, fence: int, progress: dict[str, Any] | None) -> bool | None:
        """Extend the lease (and save progress); None if it is no longer ours, else
        whether a cancel was requested."""
        rows = await self._run(
            "UPDATE wsync_jobs SET lease_until = now() + make_interval(secs => %s), "
            "progress = coalesce(%s::jsonb, progress) "
            "WHERE id = %s AND fence = %s AND state = 'running' RETURNING cancel_requested",
            (self.lease_seconds, _jsonb(progress), job_id, fence),
        )
        return bool(rows[0]["cancel_requested"]) if rows else None

    async def finish(self, job: Job, fence: int, outcome: str, backoff: float = 0.0) -> bool:
        """Record the job's final state (or ``queued`` to hand it back) if the fence is
        still ours; False when another daemon owns it now (the write is refused).

        Idempotent for its own fence: a retry of a write that did commit (its answer
        lost with the connection) is True, not a refusal, so a pull that succeeded is
        neither rewritten ``fenced`` in the audit nor counted as a fenced write.  An
        attempt's recorded end is never overwritten, but for the takeover's
        ``expired``, which a refused write refines to ``fenced``.
        """
        release = job.state == "queued"
        try:
            async with self._transaction() as conn:
                cur = await conn.execute(
                    "UPDATE wsync_jobs SET state = %s, finished_at = %s, progress = %s::jsonb, "
                    "result = %s::jsonb, error = %s, error_kind = %s, exit_code = %s, "
                    "owner = CASE WHEN %s THEN NULL ELSE owner END, "
                    "lease_until = CASE WHEN %s THEN NULL ELSE lease_until END, "
                    "not_before = CASE WHEN %s THEN now() + make_interval(secs => %s) END, "
                    # a cancel that came while the job was handed back stays for the
                    # next owner, who stops at once (it answered 202 to the caller)
                    "cancel_requested = CASE WHEN %s THEN cancel_requested ELSE false END "
                    "WHERE id = %s AND fence = %s AND state = 'running' RETURNING id",
                    (
                        job.state,
                        job.finished_at,
                        _jsonb(job.progress) or "{}",
                        _jsonb(job.result),
                        storable(job.error),
                        job.error_kind,
                        job.exit_code,
                        release,
                        release,
                        release,
                        backoff,
                        release,
                        job.id,
                        fence,
                    ),
                )
                if await cur.fetchone() is not None:
                    await conn.execute(
                        "UPDATE wsync_attempts SET ended_at = clock_timestamp(), outcome = %s "
                        "WHERE job_id = %s AND fence = %s AND ended_at IS NULL",
                        (outcome, job.id, fence),
                    )
                    return True
                # no longer ours to write: either another daemon took the job over (a
                # refusal), or this very write committed before and only its answer was
                # lost (the connection dropped between COMMIT and its reply, and this is
                # the retry).  Only this fence's own end writes its outcome on its
                # attempt, so finding it there tells the two apart.
                dup = await conn.execute(
                    "SELECT 1 FROM wsync_attempts WHERE job_id = %s AND fence = %s "
                    "AND ended_at IS NOT NULL AND outcome = %s",
                    (job.id, fence, outcome),
                )
                if await dup.fetchone() is not None:
                    return True
                # a refusal: an attempt still open, or closed only by the takeover
                # ('expired'), is marked 'fenced'; an end already recorded stays as it is
                await conn.execute(
                    "UPDATE wsync_attempts SET ended_at = clock_timestamp(), outcome = 'fenced' "
                    "WHERE job_id = %s AND fence = %s "
                    "AND (ended_at IS NULL OR outcome = 'expired')",
                    (job.id, fence),
                )
                return False
        except (psycopg.errors.DataError, TypeError, ValueError) as err:
            # a value the store refused, or one that is not JSON (never up to the store):
            # retrying the same write cannot help
            raise InternalError(f"job store refused a value: {_say(err)}") from None
        except psycopg.Error as err:
            raise StoreDown(_say(err)) from None
        except Exception as err:
            raise StoreDown(_say(err)) from None

    async def prune(self, keep_finished: int) -> None:
        """Keep the newest ``keep_finished`` finished jobs, and the audit rows of the jobs
        kept.  A pruned job's attempts go once they are :data:`_AUDIT_GRACE_S` old: a
        job's end whose commit answer was lost is retried, and the retry tells its own
        committed write from a takeover's refusal by its attempt's recorded outcome (see
        :meth:`finish`); a prune in between must not take that row."""
        await self._run(
            "DELETE FROM wsync_jobs WHERE id IN (SELECT id FROM wsync_jobs "
            "WHERE state IN ('succeeded', 'failed', 'cancelled') "
            "ORDER BY created_at DESC OFFSET %s)",
            (keep_finished,),
        )
        await self._run(
            "DELETE FROM wsync_attempts a "
            "WHERE coalesce(a.ended_at, a.started_at) < now() - make_interval(secs => %s) "
            "AND NOT EXISTS (SELECT 1 FROM wsync_jobs j WHERE j.id = a.job_id)",
            (_AUDIT_GRACE_S,),
        )

    # -- schedule -------------------------------------------------------------

    async def due_schedules(self, names: Sequence[str]) -> list[str]:
        """Which of ``names`` are due now or have no schedule row yet (one cheap read)."""
        rows = await self._run(
            "SELECT n AS sandbox FROM unnest(%s::text[]) n "
            "LEFT JOIN wsync_schedule s ON s.sandbox = n "
            "WHERE s.next_at IS NULL OR s.next_at <= now()",
            (list(names),),
        )
        return [str(r["sandbox"]) for r in rows]

    async def schedule_due(
        self, name: str, first_delay: float, next_delay: float, job: Job
    ) -> tuple[Job, bool] | None:
        """If ``name`` is due, move its next run on and submit ``job`` in one transaction.

        Exactly one daemon's ``UPDATE`` matches per interval (the row lock makes
        the others re-check ``next_at`` and find it in the future).  Returns the
        job (and whether it reconciled with an active one), or None if not due.

        None too when the row stayed locked for ``lock_timeout`` (:func:`hold_limit`):
        a daemon froze while firing it.  Its transaction is ended by the server and
        never commits, so the schedule is still due and a later round fires it.
        """
        try:
            async with self._transaction() as conn:
                await conn.execute(
                    "INSERT INTO wsync_schedule (sandbox, next_at) "
                    "VALUES (%s, now() + make_interval(secs => %s)) ON CONFLICT DO NOTHING",
                    (name, first_delay),
                )
                cur = await conn.execute(
                    "UPDATE wsync_schedule SET next_at = now() + make_interval(secs => %s) "
                    "WHERE sandbox = %s AND next_at <= now() RETURNING sandbox",
                    (next_delay, name),
                )
                if await cur.fetchone() is None:
                    return None
                cur = await conn.execute(
                    "INSERT INTO wsync_jobs (id, sandbox, uri, dest, state, trigger, created_at) "
                    "VALUES (%s, %s, %s, %s, 'queued', %s, extract(epoch FROM clock_timestamp())) "
                    "ON CONFLICT (uri, dest) WHERE state IN ('queued', 'running') DO NOTHING "
                    "RETURNING created_at",
                    (job.id, job.sandbox, job.uri, job.dest, job.trigger),
                )
                inserted = await cur.fetchone()
                if inserted is not None:
                    job.created_at = float(inserted[0])
                    return job, False
                dict_cur = conn.cursor(row_factory=dict_row)
                await dict_cur.execute(
                    f"SELECT {_JOB_COLUMNS} FROM wsync_jobs "  # noqa: S608
                    "WHERE uri = %s AND dest = %s AND state IN ('queued', 'running')",
                    (job.uri, job.dest),
                )
                row = await dict_cur.fetchone()
                return (_job(row), True) if row else None
        except psycopg.errors.LockNotAvailable:
            return None
        except psycopg.Error as err:
            raise StoreDown(_say(err)) from None
        except Exception as err:
            raise StoreDown(_say(err)) from None

    # -- events ---------------------------------------------------------------

    async def notify(self, event: str, job_id: str, data: dict[str, Any] | None = None) -> None:
        payload = json.dumps({"event": event, "id": job_id, "data": data or {}})
        if len(payload) > _MAX_PAYLOAD:  # listeners read the job itself
            payload = json.dumps({"event": event, "id": job_id, "data": {}})
        await self._run("SELECT pg_notify(%s, %s)", (CHANNEL, payload))


def _say(err: BaseException) -> str:
    """One line about a store error, never the DSN (it may carry a password)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{type(err).__name__}: {text}"[:300]
