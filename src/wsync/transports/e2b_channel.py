"""An envd process kept open: the guest helper's pipe on E2B (:meth:`E2BTransport.open_channel`).

envd runs a command with a stdin pipe when its ``Start`` request says ``"stdin": true``,
streams the command's output as ``data`` events on that request's response for as long
as it runs, and takes stdin through two unary calls of its own: ``SendInput`` (base64 in
JSON) and ``CloseStdin``.  A helper is such a command: its requests go down as
``SendInput`` calls, its answers come back as ``data`` events on the one ``Start`` stream
that stays open, and ``CloseStdin`` ends its loop.

Why a channel pays on E2B: every exec is an HTTP request that starts a process, streams
its events and waits for its ``end``; a helper answers a call with one ``SendInput`` and a
few events on a stream that is already open.  And the field's stream faults (a body cut
without its end-stream message, ``start`` then silence) cost one helper, not a guess.

Nothing here is trusted more than an exec's output: the caller parses envelopes out of
what :meth:`receive` returns, and a dropped or doubled ``data`` event only damages an
answer, which then fails its hash.  What ends the channel, with a reason for the next
receive: the command's ``end`` event, the end-stream message, a body that stops, a
message that does not decode, a ``SendInput`` that failed or was given up (a later one
might overtake it), and silence: no event at all (keepalives included, which the request
asks for every few seconds) for the transport's stall timeout.  A wedged fan-out that
still sends keepalives (infra#3292) is caught by the call's own deadline instead.

envd keeps a process running after its stream is gone, and a helper whose stdin never
ends would wait for it for ever.  So a close sends ``CloseStdin`` and kills the command
with ``SendSignal`` if that did not get through, an abort (a call that failed) kills it at
once (by its pid, or by the tag its ``Start`` carried if no pid came yet), both in tasks
of the transport's own (a close returns at once, and a cancel cannot skip them; the
transport's close waits for them), and the ``Start`` request carries
``Connect-Timeout-Ms`` of :data:`LIFETIME`: envd kills what a host that died left behind.
A channel says it has :attr:`~E2BChannel.ended` long before that (after :data:`RETIRE`),
so the helper pool closes it while it is idle and opens another rather than lose a call
to envd's deadline (any call whose deadline is under ``LIFETIME - RETIRE``, 50 minutes).
envd's ``SendSignal`` signals the pid, not its process group: a call that a killed helper
was running ends on its own, as an aborted call does on the WebSocket backends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from wsync.errors import ProtocolError, TransportError
from wsync.protocol.records import printable
from wsync.transports.base import PumpedChannel, error_message
from wsync.transports.e2b_protocol import (
    SEND_INPUT_PATH,
    STDIN_CHUNK,
    Data,
    End,
    EnvelopeDecoder,
    Keepalive,
    Start,
    decode_end_stream,
    decode_event,
    send_input_body,
)

#: the process deadline a helper's ``Start`` asks envd for (its backstop: a host that
#: went away leaves a helper waiting on a stdin nobody will close)
LIFETIME = 3600.0
#: a channel this old says it has ended, so the pool lets it go between calls, long
#: before envd's deadline could take a call with it
RETIRE = 600.0
#: bound on one SendInput (envd answers once the pipe took the bytes, which a helper
#: busy with a call may not read for a while; the caller's deadline is the real bound)
SEND_S = 300.0

#: ``unary(path, body, timeout)``: one Connect unary call, (HTTP status, body)
Unary = Callable[[str, bytes, float], Awaitable[tuple[int, bytes]]]
#: bound on closing the stream's response
CLOSE_S = 5.0
#: ``stop(pid, tag, now)``: start ending the process in a task of the transport's own:
#: ``CloseStdin``, then a kill if that did not get through; with ``now`` (or without a
#: pid) only the kill
Stop = Callable[[int | None, str, bool], None]


async def send_input(unary: Unary, pid: int, data: bytes, deadline: float) -> tuple[int, bytes]:
    """``data`` to ``pid``'s stdin in SendInput calls of :data:`STDIN_CHUNK` raw bytes, in
    order, each bounded by ``deadline`` (loop time): ``(200, b"")`` once every piece went,
    else the first answer that was not 200.  An exec's stdin and a helper's requests."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    for at in range(0, len(view), STDIN_CHUNK):
        body = send_input_body(pid, bytes(view[at : at + STDIN_CHUNK]))
        status, answer = await unary(SEND_INPUT_PATH, body, deadline - loop.time())
        if status != 200:
            return status, answer
    return 200, b""


class E2BChannel(PumpedChannel):
    """One ``Start`` stream of a command with a stdin pipe, kept open.

    Built on the response of a ``Start`` whose status and content type were checked;
    :meth:`started` waits for the ``start`` event, which names the pid that ``SendInput``
    needs.
    """

    def __init__(
        self,
        response: httpx.Response,
        description: str,
        *,
        tag: str,
        unary: Unary,
        stop: Stop,
        stall_timeout: float,
        retire_after: float = RETIRE,
    ) -> None:
        super().__init__(description)
        self._response = response
        self._tag = tag
        self._unary = unary
        self._stop = stop
        self._broken = False  # a SendInput failed or was given up
        self._stall = stall_timeout
        self._loop = asyncio.get_running_loop()
        self._retire_at = self._loop.time() + retire_after
        self._pid: int | None = None
        self._started = asyncio.Event()  # the start event came, or the stream ended first
        self._sending = asyncio.Lock()
        # (an encoded body was refused before: see wsync.transports.httpbody)
        self._start_reading(self._read(response.aiter_raw()))

    @property
    def ended(self) -> bool:
        return self._loop.time() >= self._retire_at or self._refused

    @property
    def _refused(self) -> bool:
        """No more requests: the stream ended, a send broke, or the channel was closed."""
        return self._broken or super().ended

    async def started(self) -> int:
        """The command's pid, once its ``start`` event came; TransportError if the stream
        ended first."""
        await self._started.wait()
        if self._pid is None:
            raise TransportError(f"{self._description}: {self._inbox.error}")
        return self._pid

    def _deliver(self, decoder: EnvelopeDecoder, data: bytes) -> None:
        for envelope in decoder.feed(data):
            if envelope.end_stream:
                end = decode_end_stream(envelope.message)
                raise ProtocolError(f"stream ended ({end.error_code or 'no error'})")
            event = decode_event(envelope.message)
            if isinstance(event, Start):
                if self._started.is_set():
                    raise ProtocolError("start event out of place")
                self._pid = event.pid
                self._started.set()
            elif not self._started.is_set() and not isinstance(event, Keepalive):
                raise ProtocolError("output before the start event")
            elif isinstance(event, Data) and event.stream == "stdout":
                self._inbox.feed(event.data)
            elif isinstance(event, End):
                said = printable(event.status, 60) if event.status else "no status"
                raise ProtocolError(f"the command ended ({said})")

    async def _read(self, chunks: AsyncIterator[bytes]) -> None:
        """Events → the inbox until the stream ends, breaks or stalls."""
        decoder = EnvelopeDecoder()
        error = "the stream ended"
        try:
            while True:
                await self._flowing.wait()  # the caller's inbox is full: stop reading
                try:
                    async with asyncio.timeout(self._stall):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    decoder.eof()
                    error = "the stream ended without its end-stream message"
                    break
                except TimeoutError:
                    error = f"the stream stalled (no event for {self._stall:.0f}s)"
                    break
                self._deliver(decoder, chunk)
        except ProtocolError as err:
            error = str(err)
        except (httpx.HTTPError, httpx.StreamError, OSError) as err:
            # (StreamError is no HTTPError: said here, not lost in the task)
            error = f"{type(err).__name__}: {err}"
        finally:
            self._inbox.end(error)
            self._started.set()

    async def send(self, data: bytes) -> None:
        # (not refused by age: a helper the pool took just before it retired still works)
        if self._refused:
            raise TransportError(f"{self._description}: the channel is closed")
        pid = await self.started()
        async with self._sending:  # one request's pieces in order
            ok = False
            try:
                deadline = self._loop.time() + SEND_S
                try:
                    status, answer = await send_input(self._unary, pid, data, deadline)
                except httpx.HTTPError as err:
                    raise TransportError(f"{self._description}: SendInput: {err}") from None
                if status != 200:
                    raise TransportError(
                        f"{self._description}: SendInput refused "
                        f"(HTTP {status}: {error_message(answer)})"
                    )
                ok = True
            finally:
                # a SendInput given up (a cancel, the caller's deadline) may still be
                # applied after a later one: nothing more goes down this channel
                self._broken = self._broken or not ok

    async def aclose(self, *, abort: bool = False) -> None:
        # CloseStdin ends the helper's loop once the call it runs is over; closing the
        # stream does not stop the command (envd keeps it), so an abort kills it.  Both
        # go on in the transport's tasks (first: no await below can keep them from
        # starting), so that closing helpers on a dead link does not wait for each
        if not self._open:
            return
        self._open = False
        self._stop(self._pid, self._tag, abort)
        try:
            await self._stop_reading()
        finally:
            with contextlib.suppress(httpx.HTTPError, OSError, TimeoutError):
                async with asyncio.timeout(CLOSE_S):
                    await self._response.aclose()
