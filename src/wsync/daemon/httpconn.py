"""The daemon's HTTP connections: each must send a whole request head in time, and read
its answers in time.

uvicorn closes an idle keep-alive connection after a response, but not one that never
sends a request, nor one that trickles a request head a byte at a time (any byte cancels
its keep-alive timer).  Without a token a client could so hold connections open until
the daemon ran out of file descriptors: ``/healthz`` and the API stopped answering,
scheduled pulls failed to start, and asyncio logged every refused accept (found by a
review, 505 sockets against a limit of 512).  So a connection gets
:data:`HEAD_DEADLINE` seconds from when it is made, and again from each response, to
complete its next request head; one that does not is closed.

The same attack works from the other side (found by a red-team review): a client that
pipelines requests (``GET /openapi.json`` needs no token) and never reads the answers.
The answer it does not read fills the socket's buffers, uvicorn waits for them to drain
before it finishes the response, and the head deadline, off while a request is being
answered, never comes back.  So a connection whose writes stay paused (the transport's
buffer over its high-water mark) for :data:`WRITE_STALL_DEADLINE` seconds is dropped, and
so is one closed with an answer still unread in its buffer that does not drain within as
long (a ``close`` waits for that buffer to drain, for good if the peer never reads: such
connections are *aborted*, with an RST).  On top of that, connections beyond half the
open-file limit are dropped at once (:func:`connection_cap`): what any client can open
must never take the descriptors a pull needs for its journal and files.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import resource
import socket
import struct
import termios
import time
from typing import Any

import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger("wsync.daemon")

#: seconds a connection has to send a whole request head
HEAD_DEADLINE = 10.0
#: seconds a connection may leave the daemon's answer unread (its writes paused) without
#: reading :data:`MIN_PROGRESS` of it: a slow reader that keeps reading is never dropped
#: (the time between two reads is what is bounded, as nginx's send_timeout does)
WRITE_STALL_DEADLINE = 30.0
#: bytes a paused answer must move by within a stall deadline (or all of what is left):
#: less is a trickle that only holds the connection (see ``_stalled``).  The kernel tells
#: the move in steps: on loopback TCP as the reader's window reopens (up to 64 KiB at a
#: time), on a unix socket a whole buffer (about 36 KiB) at a time, so there a reader
#: needs somewhat more than this per deadline: 36 KiB in 30 s, far below any real client
MIN_PROGRESS = 16 * 1024
#: at least this many connections are allowed, whatever the open-file limit
MIN_CONNECTIONS = 64
#: seconds between two log lines about dropped connections (with a count between them)
_SAY_EVERY = 10.0


class _Throttle:
    """One log line per :data:`_SAY_EVERY` seconds for an event an attacker can repeat."""

    def __init__(self) -> None:
        self.last = -_SAY_EVERY
        self.quiet = 0

    def due(self) -> int | None:
        """How many went unsaid before this one, if this one is to be said; else None."""
        now = time.monotonic()
        if now - self.last < _SAY_EVERY:
            self.quiet += 1
            return None
        self.last, quiet, self.quiet = now, self.quiet, 0
        return quiet


_over_cap = _Throttle()


def connection_cap() -> int:
    """Most HTTP connections open at once: half the open-file limit (at least
    :data:`MIN_CONNECTIONS`), the other half kept for pulls, the job store and logs."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(MIN_CONNECTIONS, soft // 2)


class DeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head and for each stall of
    its answers, and a cap on connections (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        #: bytes unsent when the stall deadline was last armed
        self._unsent = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # every close (uvicorn's for "Connection: close" in the middle of its send, on an
        # error, a 400) waits for the buffer to drain, for good if the peer never reads,
        # and an answer left under the high-water mark paused nothing: bounded like any
        # other stall (found by a review; the head deadline's close was the only one)
        close = transport.close

        def closing() -> None:
            close()
            if transport.get_write_buffer_size() and self._stall is None:
                self._watch_stall()

        transport.close = closing  # type: ignore[method-assign]
        if len(self.connections) > connection_cap():
            quiet = _over_cap.due()
            if quiet is not None:
                log.warning(
                    "http.too_many_connections", open=len(self.connections), dropped_quietly=quiet
                )
            self._drop()
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unstall()
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

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._watch_stall()

    def resume_writing(self) -> None:
        self._unstall()
        super().resume_writing()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(HEAD_DEADLINE, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _unstall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.info("http.head_timeout", client=self.client)
            self.transport.close()  # (its wait for the buffer to drain is bounded)

    def _watch_stall(self) -> None:
        """(Re)arm the stall deadline from now, remembering what is unsent.  While the
        writes are paused (or the connection closes) nothing is added to the buffers, so
        less unsent later means the peer read some of it."""
        self._unstall()
        self._unsent = self._unsent_now()
        self._stall = self.loop.call_later(WRITE_STALL_DEADLINE, self._stalled)

    def _unsent_now(self) -> int:
        """The answer's bytes the peer has not taken yet: the transport's buffer and the
        socket's send queue (``SIOCOUTQ``).  The transport's buffer alone moves only when
        the kernel's queue has room for a third of it again: with a send buffer the kernel
        grew to 4 MB, a client reading 850 KB/s in small reads left it unmoved for seconds
        and was dropped while it read (found by a CI run, at a 1.5 s deadline)."""
        unsent = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                unsent += struct.unpack("i", raw)[0]
        return unsent

    def _stalled(self) -> None:
        self._stall = None
        unsent = self._unsent_now()
        # read, slowly (a large answer takes long at 300 KB/s), but not a trickle: the send
        # queue moves with every ACK, so one segment a deadline would hold a connection
        if self._unsent - unsent >= min(MIN_PROGRESS, self._unsent):
            if unsent:
                self._watch_stall()
            return
        log.info(
            "http.write_stall",
            client=self.client,
            unread=self.transport.get_write_buffer_size(),
            seconds=WRITE_STALL_DEADLINE,
        )
        self._drop()

    def _drop(self) -> None:
        """Close at once, unsent data discarded (an RST), the descriptor freed now."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()


class _AcceptErrors(logging.Filter):
    """asyncio logs every accept refused for want of descriptors (with a traceback, about
    once a second while it lasts): one line per :data:`_SAY_EVERY` seconds is enough."""

    def __init__(self) -> None:
        super().__init__()
        self.throttle = _Throttle()

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("socket.accept() out of system resource"):
            return True
        quiet = self.throttle.due()
        if quiet is None:
            return False
        record.msg = f"{record.msg} ({quiet} more since the last such line)"
        return True


def quiet_accept_errors() -> None:
    """Throttle asyncio's log line for each accept refused (:class:`_AcceptErrors`)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _AcceptErrors) for f in logger.filters):
        logger.addFilter(_AcceptErrors())


def raise_fd_limit() -> None:
    """The soft limit on open files up to the hard one: a daemon holds a socket per
    client, a journal and a tree walk per pull, and a soft 1,024 is soon reached."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.info("fd_limit.unchanged", soft=soft, hard=hard, error=str(exc))
