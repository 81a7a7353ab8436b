"""Durable job records in SQLite (WAL mode) inside the daemon's state directory.

Why SQLite: it is in the standard library, survives ``kill -9`` (every state
change is a committed transaction, ``synchronous=FULL``), and lets the API list
and filter jobs without loading them all.  WAL mode keeps readers (a second
daemon instance refused by the lock, a ``sqlite3`` shell used by an operator)
from blocking the writer.

Only job *records* live here.  The chunk journals that make a pull resumable
belong to the engine and live under ``state_dir/engine``; a queued or running
job found here at start-up is simply pulled again with the same options, and
the engine resumes it from its journal.

Jobs are ordered (listed, requeued at start-up, pruned) by ``rowid``, the order they
were inserted in, not by ``created_at``: the wall clock steps back (NTP, a VM restored
from a snapshot), and a job created after such a step would sort before every older
one, be requeued after them and be the first finished job pruned, the moment it ended.

A partial unique index on ``(uri, dest)`` over active jobs enforces the dedupe
rule (one queued-or-running job per sandbox and destination) in the database
itself, not only in memory.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from wsync.errors import HostIOError


class StoreUnavailable(HostIOError):
    """The shared job store cannot be reached right now (HTTP 503; the daemon retries)."""

    kind = "store-unavailable"
    template = "job store: {}"


ACTIVE_STATES = ("queued", "running")
FINAL_STATES = ("succeeded", "failed", "cancelled")
STATES = ACTIVE_STATES + FINAL_STATES

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id          TEXT PRIMARY KEY,
    sandbox     TEXT NOT NULL,
    uri         TEXT NOT NULL,
    dest        TEXT NOT NULL,
    state       TEXT NOT NULL,
    trigger     TEXT NOT NULL,
    created_at  REAL NOT NULL,
    started_at  REAL,
    finished_at REAL,
    attempts    INTEGER NOT NULL DEFAULT 0,
    progress    TEXT NOT NULL DEFAULT '{}',
    result      TEXT,
    error       TEXT,
    error_kind  TEXT,
    exit_code   INTEGER,
    cancel_requested INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_active ON jobs(uri, dest)
    WHERE state IN ('queued', 'running');
CREATE INDEX IF NOT EXISTS jobs_created ON jobs(created_at);
"""


def new_job_id() -> str:
    """Time-ordered, unguessable enough, URL-safe: ``j-<ms hex>-<random hex>``."""
    return f"j-{int(time.time() * 1000):x}-{secrets.token_hex(4)}"


@dataclasses.dataclass(slots=True)
class Job:
    """One pull request and everything known about its outcome."""

    id: str
    sandbox: str
    uri: str
    dest: str
    state: str = "queued"
    trigger: str = "api"
    created_at: float = dataclasses.field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    progress: dict[str, Any] = dataclasses.field(default_factory=dict)
    result: dict[str, Any] | None = None
    error: str | None = None
    error_kind: str | None = None
    exit_code: int | None = None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def to_json(self, *, reconciled: bool = False) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["reconciled"] = reconciled
        return data


_COLUMNS = [f.name for f in dataclasses.fields(Job)]
_JSON_COLUMNS = ("progress", "result")
#: the columns that may quote a guest's or server's words (see :func:`storable`); the
#: others (ids, URI, DEST) were checked on the way in and are kept exactly
_FREE_TEXT = ("error", *_JSON_COLUMNS)


#: how long a write waits for another connection's lock (an operator's ``sqlite3`` shell
#: in a transaction): the store runs on the event loop, which answers nothing meanwhile
#: (``/healthz`` included: at 5 s a wait, a liveness probe killed the daemon).  A write
#: refused then is best effort (progress), written again later (a job's end) or the
#: request's error (a submit)
BUSY_TIMEOUT = 0.25


def storable(value: Any) -> Any:
    """``value`` as a store can hold it: without NUL, and without the surrogates a name
    that is not UTF-8 decodes to, each shown escaped (PostgreSQL's text and jsonb hold
    neither, SQLite's text no surrogate).  A job's error and result may quote what a guest
    or server said; a value the store refuses would have its final write retried for good,
    and both stores give the same job back alike."""
    if isinstance(value, str):
        return value.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode()
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


class JobStore:
    """A small synchronous DAO used only from the daemon's event-loop thread."""

    def __init__(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
            if "cancel_requested" not in columns:  # a jobs.db of an older wsync
                self._db.execute(
                    "ALTER TABLE jobs ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0"
                )
        except (OSError, sqlite3.Error) as err:
            raise HostIOError(f"job store {path}: {err}") from None
        self.path = path

    def close(self) -> None:
        self._db.close()

    def _row(self, row: Iterable[Any]) -> Job:
        values = dict(zip(_COLUMNS, row, strict=True))
        for key in _JSON_COLUMNS:
            raw = values[key]
            values[key] = json.loads(raw) if raw is not None else None
        if values["progress"] is None:
            values["progress"] = {}
        return Job(**values)

    def _params(self, job: Job) -> list[Any]:
        out: list[Any] = []
        for name in _COLUMNS:
            value = getattr(job, name)
            if name in _FREE_TEXT:
                value = storable(value)
            if name in _JSON_COLUMNS and value is not None:
                value = json.dumps(value, sort_keys=True)
            out.append(value)
        return out

    def _exec(self, sql: str, params: Iterable[Any] = ()) -> sqlite3.Cursor:
        try:
            return self._db.execute(sql, tuple(params))
        except sqlite3.IntegrityError:
            raise
        except sqlite3.Error as err:
            raise HostIOError(f"job store {self.path}: {err}") from None

    def insert(self, job: Job) -> None:
        """Insert a new job; raises sqlite3.IntegrityError if an active duplicate exists."""
        marks = ", ".join("?" for _ in _COLUMNS)
        self._exec(f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({marks})", self._params(job))  # noqa: S608

    def save(self, job: Job) -> None:
        sets = ", ".join(f"{name} = ?" for name in _COLUMNS[1:])
        params = self._params(job)
        self._exec(f"UPDATE jobs SET {sets} WHERE id = ?", [*params[1:], params[0]])  # noqa: S608

    def request_cancel(self, job_id: str) -> None:
        """Record that a ``DELETE`` asked the running job ``job_id`` to stop: a daemon
        killed before the pull stopped ends it ``cancelled`` at its next start instead of
        pulling it again (the cancel was acknowledged to the client)."""
        self._exec("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", [job_id])

    def cancel_requested(self, job_id: str) -> bool:
        cur = self._exec("SELECT cancel_requested FROM jobs WHERE id = ?", [job_id])
        row = cur.fetchone()
        return bool(row and row[0])

    def get(self, job_id: str) -> Job | None:
        cur = self._exec(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id = ?", [job_id])  # noqa: S608
        row = cur.fetchone()
        return self._row(row) if row else None

    def find_active(self, uri: str, dest: str) -> Job | None:
        cur = self._exec(
            f"SELECT {', '.join(_COLUMNS)} FROM jobs "  # noqa: S608
            "WHERE uri = ? AND dest = ? AND state IN ('queued', 'running')",
            [uri, dest],
        )
        row = cur.fetchone()
        return self._row(row) if row else None

    def list(
        self,
        *,
        states: Iterable[str] | None = None,
        sandbox: str | None = None,
        limit: int = 100,
        newest_first: bool = True,
    ) -> list[Job]:
        where: list[str] = []
        params: list[Any] = []
        state_list = list(states or [])
        if state_list:
            where.append(f"state IN ({', '.join('?' for _ in state_list)})")
            params.extend(state_list)
        if sandbox is not None:
            where.append("sandbox = ?")
            params.append(sandbox)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        order = "DESC" if newest_first else "ASC"
        cur = self._exec(
            f"SELECT {', '.join(_COLUMNS)} FROM jobs {clause} "  # noqa: S608
            f"ORDER BY rowid {order} LIMIT ?",
            [*params, limit],
        )
        return [self._row(row) for row in cur.fetchall()]

    def counts(self) -> dict[str, int]:
        cur = self._exec("SELECT state, COUNT(*) FROM jobs GROUP BY state")
        counts = dict.fromkeys(STATES, 0)
        counts.update({state: int(n) for state, n in cur.fetchall()})
        return counts

    def prune(self, keep_finished: int) -> int:
        """Drop the oldest finished jobs beyond ``keep_finished``; returns how many."""
        cur = self._exec(
            "DELETE FROM jobs WHERE id IN (SELECT id FROM jobs "
            "WHERE state IN ('succeeded', 'failed', 'cancelled') "
            "ORDER BY rowid DESC LIMIT -1 OFFSET ?)",
            [keep_finished],
        )
        return cur.rowcount
