"""The daemon's HTTP connections: each must send a whole request head in time.

uvicorn closes an idle keep-alive connection after a response, but not one that never
sends a request, nor one that trickles a request head a byte at a time (any byte cancels
its keep-alive timer).  Without a token a client could so hold connections open until
the daemon ran out of file descriptors: ``/healthz`` and the API stopped answering,
scheduled pulls failed to start, and asyncio logged every refused accept (found by a
review, 505 sockets against a limit of 512).  So a connection gets
:data:`HEAD_DEADLINE` seconds from when it is made, and again from each response, to
complete its next request head; one that does not is closed.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger("wsync.daemon")

#: seconds a connection has to send a whole request head
HEAD_DEADLINE = 10.0


class DeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not None and self.cycle is not before:
            self._disarm()  # a whole request head came: the app has it now

    def on_response_complete(self) -> None:
        before = self.cycle
        super().on_response_complete()  # it starts a pipelined request whose head is in
        if self.cycle is before and not self.transport.is_closing():
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(HEAD_DEADLINE, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.info("http.head_timeout", client=self.client)
            self.transport.close()


def raise_fd_limit() -> None:
    """The soft limit on open files up to the hard one: a daemon holds a socket per
    client, a journal and a tree walk per pull, and a soft 1,024 is soon reached."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.info("fd_limit.unchanged", soft=soft, hard=hard, error=str(exc))
