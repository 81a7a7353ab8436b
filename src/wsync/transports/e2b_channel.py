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
message that does not decode, and silence: no event at all (keepalives included, which
the request asks for every few seconds) for the transport's stall timeout, the wedged
fan-out of infra#3292.

envd keeps a process running after its stream is gone, and a helper whose stdin never
ends would wait for it for ever.  So an abort (a call that failed) kills the command with
``SendSignal`` (by its pid, or by the tag its ``Start`` carried if no pid came yet), a
close whose ``CloseStdin`` is refused does too, and the ``Start`` request carries
``Connect-Timeout-Ms`` of :data:`LIFETIME`: envd kills what a host that died left behind.
A channel says it has :attr:`~E2BChannel.ended` well before that (after :data:`RETIRE`),
so the helper pool closes it while it is idle and opens another instead of losing a call
to envd's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from wsync.errors import ProtocolError, TransportError
from wsync.transports.base import PumpedChannel
from wsync.transports.e2b_protocol import (
    CLOSE_STDIN_PATH,
    SEND_INPUT_PATH,
    Data,
    End,
    EnvelopeDecoder,
    Keepalive,
    Start,
    decode_end_stream,
    decode_event,
    pid_body,
    send_input_body,
)

#: the process deadline a helper's ``Start`` asks envd for (its backstop: a host that
#: went away leaves a helper waiting on a stdin nobody will close)
LIFETIME = 900.0
#: a channel this old says it has ended, so the pool lets it go between calls, long
#: before envd's deadline could take a call with it
RETIRE = 600.0
#: raw stdin bytes per SendInput call (the exec path's size)
STDIN_CHUNK = 256 * 1024
#: bound on the CloseStdin of a close
CLOSE_S = 5.0

#: ``unary(path, body, timeout)``: one Connect unary call, (HTTP status, body)
Unary = Callable[[str, bytes, float], Awaitable[tuple[int, bytes]]]
#: ``kill(pid, tag)``: start the kill of the process (in a task of the transport's own,
#: which its close waits for: a cancel of the caller cannot skip it)
Kill = Callable[[int | None, str], None]


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
        kill: Kill,
        stall_timeout: float,
        retire_after: float = RETIRE,
    ) -> None:
        super().__init__(description)
        self._response = response
        self._tag = tag
        self._unary = unary
        self._kill = kill
        self._stall = stall_timeout
        self._loop = asyncio.get_running_loop()
        self._retire_at = self._loop.time() + retire_after
        self._pid: int | None = None
        self._started = asyncio.Event()  # the start event came, or the stream ended first
        self._sending = asyncio.Lock()
        self._start_reading(self._read(response.aiter_bytes()))

    @property
    def ended(self) -> bool:
        return self._loop.time() >= self._retire_at or super().ended

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
                raise ProtocolError(f"the command ended ({event.status or 'no status'})")

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
        except httpx.HTTPError as err:
            error = f"{type(err).__name__}: {err}"
        finally:
            self._inbox.end(error)
            self._started.set()

    async def send(self, data: bytes) -> None:
        if self.ended:
            raise TransportError(f"{self._description}: the channel is closed")
        pid = await self.started()
        async with self._sending:  # one request's pieces in order
            view = memoryview(data)
            for at in range(0, len(view), STDIN_CHUNK):
                body = send_input_body(pid, bytes(view[at : at + STDIN_CHUNK]))
                try:
                    # (bounded by the caller's deadline; envd answers at once)
                    status, answer = await self._unary(SEND_INPUT_PATH, body, 60.0)
                except httpx.HTTPError as err:
                    raise TransportError(f"{self._description}: SendInput: {err}") from None
                if status != 200:
                    text = answer[:200].decode("utf-8", "replace").strip()
                    raise TransportError(
                        f"{self._description}: SendInput refused (HTTP {status}: {text})"
                    )

    async def aclose(self, *, abort: bool = False) -> None:
        # CloseStdin ends the helper's loop once the call it runs is over; closing the
        # stream does not stop the command (envd keeps it), so an abort kills it, and
        # so does a close whose CloseStdin did not get through
        if not self._open:
            return
        self._open = False
        pid = self._pid
        try:
            if abort or pid is None:
                self._kill(pid, self._tag)
            else:
                closed = False
                try:
                    async with asyncio.timeout(CLOSE_S):
                        status, _ = await self._unary(CLOSE_STDIN_PATH, pid_body(pid), CLOSE_S)
                    closed = status in (200, 404)  # 404: it has exited already
                except (TimeoutError, httpx.HTTPError, TransportError):
                    pass
                finally:
                    if not closed:  # a cancel too: the kill starts before it goes on
                        self._kill(pid, self._tag)
            await self._stop_reading()
        finally:
            with contextlib.suppress(httpx.HTTPError, OSError, TimeoutError):
                async with asyncio.timeout(CLOSE_S):
                    await self._response.aclose()
