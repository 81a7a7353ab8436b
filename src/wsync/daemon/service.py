"""What the HTTP API and the process need from a job backend, whichever store holds the jobs.

Why an interface here and not in the store: the SQLite store is a synchronous
DAO owned by one daemon, whose :class:`~wsync.daemon.jobs.JobManager` keeps the
queue in memory; a fleet on PostgreSQL keeps the queue, the leases and the
schedule in the database (:class:`~wsync.daemon.fleet.FleetManager`).  The
routes and the server only ever talk to this small async surface, so neither
knows which one runs, and a user without ``store = …`` runs exactly the code
they ran before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from wsync.daemon.config import DaemonConfig
from wsync.daemon.jobs import EventBroker, JobManager
from wsync.daemon.store import Job


class JobService(Protocol):
    """Jobs in, jobs out: the surface the API routes and :class:`Daemon` use."""

    events: EventBroker

    @property
    def accepting(self) -> bool: ...

    def store_ok(self) -> bool:
        """False while the job store cannot be reached (``/readyz`` then says 503)."""
        ...

    async def start(self) -> int: ...

    async def shutdown(self, grace: float) -> None: ...

    async def close(self) -> None: ...

    def busy_threads(self) -> int: ...

    def reload(self, config: DaemonConfig) -> None: ...

    def running_jobs(self) -> list[Job]:
        """The jobs this daemon's own pulls run right now."""
        ...

    async def submit(
        self, sandbox: str, dest: str | None, trigger: str = "api"
    ) -> tuple[Job, bool]: ...

    async def get(self, job_id: str) -> Job: ...

    async def list_jobs(
        self, *, states: Iterable[str] | None = None, sandbox: str | None = None, limit: int = 100
    ) -> list[Job]: ...

    async def cancel(self, job_id: str) -> Job: ...

    async def status(self) -> dict[str, Any]: ...


class LocalJobs:
    """The single-daemon service: :class:`JobManager` on SQLite, unchanged, behind async calls."""

    def __init__(self, manager: JobManager) -> None:
        self.manager = manager
        self.events = manager.events

    @property
    def accepting(self) -> bool:
        return self.manager.accepting

    def store_ok(self) -> bool:
        return True

    async def start(self) -> int:
        return await self.manager.start()

    async def shutdown(self, grace: float) -> None:
        await self.manager.shutdown(grace)

    async def close(self) -> None:
        self.manager.store.close()

    def busy_threads(self) -> int:
        return self.manager.busy_threads()

    def reload(self, config: DaemonConfig) -> None:
        self.manager.reload(config)

    def running_jobs(self) -> list[Job]:
        return self.manager.running_jobs()

    async def submit(
        self, sandbox: str, dest: str | None, trigger: str = "api"
    ) -> tuple[Job, bool]:
        return self.manager.submit(sandbox, dest, trigger)

    async def get(self, job_id: str) -> Job:
        return self.manager.get(job_id)

    async def list_jobs(
        self, *, states: Iterable[str] | None = None, sandbox: str | None = None, limit: int = 100
    ) -> list[Job]:
        return self.manager.list_jobs(states=states, sandbox=sandbox, limit=limit)

    async def cancel(self, job_id: str) -> Job:
        return self.manager.cancel(job_id)

    async def status(self) -> dict[str, Any]:
        return self.manager.status()
