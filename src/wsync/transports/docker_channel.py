"""A Docker exec kept open: the guest helper's pipe (:meth:`DockerTransport.open_channel`).

The exec is created with stdin attached and started with the connection hijack, as a
call's exec is; then the connection stays open.  Requests go down the hijacked socket as
raw stdin, answers come back as multiplexed frames, demultiplexed as they arrive
(:class:`~wsync.transports.docker_protocol.FrameDecoder`): stdout (and type-0 frames, as
moby's ``stdcopy`` counts them) go to the caller, stderr is dropped.

Why a channel pays on Docker: every exec is three requests to the daemon (create,
start, inspect until the exit code is set, moby#19607) and a process; a helper answers
each call with a few bytes on a socket that is already open.  And the field's worst
Docker fault, the final frame lost when the process exits (moby#27289), cannot touch an
answer the helper sends while it goes on running: it waits for the next request.

Nothing here is trusted more than an exec's output: the caller parses envelopes out of
what :meth:`receive` returns.  A stream cut inside a frame, a frame header out of step
or a daemon's system-error frame ends the channel with a :class:`TransportError` at the
next receive; an abort (a call that timed out) kills the command by its token, as an
abandoned exec is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from wsync.errors import ProtocolError, TransportError
from wsync.protocol.records import printable
from wsync.transports import docker_http
from wsync.transports.base import PumpedChannel
from wsync.transports.docker_protocol import (
    STDERR,
    SYSTEMERR,
    SYSTEMERR_KEEP,
    FrameDecoder,
)


class DockerChannel(PumpedChannel):
    """One started exec with stdin attached, its connection kept open.

    ``kill(mark)`` starts the stop of the exec's processes (the transport's killer, by
    the exec's token, in a task of the transport's own that its close waits for: a
    cancel of the caller cannot skip it); ``mark`` when no output came yet, so a process
    that has not started by then refuses to (moby answers the start before the process
    exists).
    """

    def __init__(
        self,
        started: docker_http.Hijacked,
        description: str,
        kill: Callable[[bool], None],
    ) -> None:
        super().__init__(description)
        self._reader = started.reader
        self._writer = started.writer
        self._kill = kill
        self._decoder = FrameDecoder()
        self._systemerr = bytearray()
        self._heard = False
        self._start_reading(self._read(started.reader, started.leftover))

    def _deliver(self, data: bytes) -> None:
        if data:
            self._heard = True
        for stream, piece in self._decoder.feed(data):
            if stream == SYSTEMERR:
                self._systemerr += piece[: max(SYSTEMERR_KEEP - len(self._systemerr), 0)]
            elif stream != STDERR:
                self._inbox.feed(piece)

    async def _read(self, reader: asyncio.StreamReader, leftover: bytes) -> None:
        """Frames → the inbox until the daemon ends the stream (or the channel closes)."""
        error: str | None = None
        try:
            self._deliver(leftover)
            while not self._systemerr:
                await self._flowing.wait()  # the caller's inbox is full: stop reading
                data = await reader.read(docker_http.READ_SIZE)
                if not data:
                    self._decoder.eof()
                    break
                self._deliver(data)
        except ProtocolError as err:
            error = str(err)
        except OSError as err:
            error = f"{type(err).__name__}: {err}"
        finally:
            if self._systemerr:
                text = printable(bytes(self._systemerr).strip(), 499)
                error = f"daemon error: {text or '(empty)'}"
            self._inbox.end(error)

    async def send(self, data: bytes) -> None:
        # (a write after the daemon's EOF fails in the transport, which then throws away
        # output not read yet: refused here while it can be told)
        closed = self._inbox.ended or not self._open or self._writer.is_closing()
        if closed or self._reader.at_eof():
            raise TransportError(f"{self._description}: the channel is closed")
        # queued in the socket's transport, as an ssh channel's write is: a request is
        # small, and the caller's deadline bounds the wait for its answer
        self._writer.write(data)

    async def aclose(self, *, abort: bool = False) -> None:
        # stdin's end (the half-close, the only EOF the Engine API has) ends the helper's
        # loop once the call it runs is over; closing the connection does not stop the
        # command, so an abort then kills it by its token, as an abandoned exec's is
        if not self._open:
            return
        self._open = False
        if abort:
            self._kill(not self._heard)  # first: nothing below may keep it from starting
        try:
            with contextlib.suppress(OSError, RuntimeError):
                if self._writer.can_write_eof() and not self._writer.is_closing():
                    self._writer.write_eof()
            await self._stop_reading()
        finally:
            await docker_http.close(self._writer)
