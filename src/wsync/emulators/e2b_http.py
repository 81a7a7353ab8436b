"""A minimal HTTP/1.1 server on raw asyncio + h11, for the E2B emulator's wire-level faults.

A framework server (starlette + uvicorn) cannot end a chunked body cleanly in the middle
of a Connect envelope, or promise a ``Content-Length`` and then drop the connection, on
purpose.  The envd emulator needs exactly that, so it speaks HTTP itself: one
:class:`Exchange` per request, keep-alive between them, and a watcher that notices the
client going away while a response streams (envd keeps the process; only the subscriber
is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import h11

log = logging.getLogger(__name__)

MAX_REQUEST_BODY = 64 * 1024 * 1024


class ClientGone(Exception):
    """The client closed the connection (or it was aborted) while we answered."""


class Exchange:
    """One request and the means to answer it (plain, streamed, cut or aborted)."""

    def __init__(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        request: h11.Request,
        body: bytes,
        gone: asyncio.Event,
    ) -> None:
        self._conn = conn
        self._writer = writer
        self.method = request.method.decode("ascii", "replace")
        target = request.target.decode("ascii", "replace")
        split = urllib.parse.urlsplit(target)
        self.path = split.path
        self.query = dict(urllib.parse.parse_qsl(split.query, keep_blank_values=True))
        self.headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers
        }
        self.body = body
        self.gone = gone
        self.aborted = False
        self.started = False

    async def _send(self, event: Any) -> None:
        if self.gone.is_set() or self.aborted:
            raise ClientGone
        data = self._conn.send(event)
        if data:
            self._writer.write(data)
            try:
                await self._writer.drain()
            except (ConnectionError, OSError):
                self.gone.set()
                raise ClientGone from None

    async def start(self, status: int, headers: dict[str, str]) -> None:
        self.started = True
        pairs = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        await self._send(h11.Response(status_code=status, headers=pairs))

    async def write(self, data: bytes) -> None:
        if data:
            await self._send(h11.Data(data=data))

    async def end(self) -> None:
        await self._send(h11.EndOfMessage())

    async def reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
        await self.start(status, headers)
        await self.write(body)
        await self.end()

    async def reply_json(self, status: int, obj: Any) -> None:
        await self.reply(status, json.dumps(obj, separators=(",", ":")).encode())

    def abort(self) -> None:
        """Drop the TCP connection now (RST-like): the body is cut wherever it was."""
        self.aborted = True
        transport = self._writer.transport
        transport.abort()


Handler = Callable[[Exchange], Awaitable[None]]


class H11Server:
    """Serves ``handler`` on ``host:port`` (0: ephemeral) until :meth:`stop`."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connect, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, OSError, h11.ProtocolError, ClientGone) as err:
            log.debug("e2b emulator: connection ended: %r", err)
        except asyncio.CancelledError:
            # only stop() cancels these; asyncio's stream callback would report a
            # cancelled connection task as an error
            pass
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        while True:
            request: h11.Request | None = None
            body = bytearray()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(256 * 1024)
                    conn.receive_data(data)
                    if not data and conn.their_state is not h11.DONE:
                        if request is None:
                            return
                        raise ClientGone
                    continue
                if isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > MAX_REQUEST_BODY:
                        return
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    return
            assert request is not None
            gone = asyncio.Event()
            watcher = asyncio.create_task(_watch(reader, gone))
            exchange = Exchange(conn, writer, request, bytes(body), gone)
            try:
                await self.handler(exchange)
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            if exchange.aborted or gone.is_set() or conn.our_state is not h11.DONE:
                return
            if conn.their_state is not h11.DONE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return


async def _watch(reader: asyncio.StreamReader, gone: asyncio.Event) -> None:
    """While a response streams, an EOF from the client means it went away.

    httpx neither pipelines nor sends a body after the request, so any bytes here would be
    a protocol violation; they are dropped with the connection.
    """
    with contextlib.suppress(ConnectionError, OSError):
        data = await reader.read(1)
        if data:
            log.debug("e2b emulator: unexpected bytes from client mid-response")
    gone.set()
