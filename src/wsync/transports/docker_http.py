"""HTTP/1.1 to the Docker daemon over a unix socket or TCP: h11 on asyncio streams.

Why not httpx (the other HTTP backends' client): ``POST /exec/{id}/start`` *hijacks* the
connection: after the ``101 UPGRADED`` (or ``200 OK``) head the socket carries raw
multiplexed frames one way and raw stdin the other, ended by a TCP half-close.  httpx
offers no way to take the socket over after a response head, nor to half-close it.  h11
parses the head exactly (including a 101 arriving with the first frames in the same
read, kept in ``trailing_data``), and the socket is ours from there.  The few plain calls
(create, inspect) use the same code so there is one connection path to get right.

Each call opens its own connection (``Connection: close``): a unix socket connect costs
microseconds, and a hijacked connection can never be reused anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import h11

from wsync.errors import ProtocolError
from wsync.transports.docker_protocol import Endpoint, check_start_answer

#: the largest plain answer read (create and inspect answers are a few hundred bytes)
MAX_ANSWER = 256 * 1024
READ_SIZE = 256 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """A complete (non-hijacked) answer."""

    status: int
    headers: dict[str, str]
    body: bytes


@dataclasses.dataclass(slots=True)
class Hijacked:
    """A connection taken over after the start answer's head."""

    status: int
    headers: dict[str, str]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    #: stream bytes that arrived in the same read as the head
    leftover: bytes


async def connect(endpoint: Endpoint) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a connection (OSError when nothing listens or access is refused)."""
    if endpoint.unix_path is not None:
        return await asyncio.open_unix_connection(endpoint.unix_path, limit=READ_SIZE)
    assert endpoint.host is not None
    return await asyncio.open_connection(endpoint.host, endpoint.port, limit=READ_SIZE)


def _host_header(endpoint: Endpoint) -> str:
    if endpoint.unix_path is not None:
        return "docker"  # what the docker CLI sends over a unix socket
    host = f"[{endpoint.host}]" if endpoint.host and ":" in endpoint.host else endpoint.host
    return f"{host}:{endpoint.port}"


def _headers(event: h11.Response | h11.InformationalResponse) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}


async def _send_request(
    conn: h11.Connection,
    writer: asyncio.StreamWriter,
    endpoint: Endpoint,
    method: str,
    path: str,
    body: bytes | None,
    upgrade: bool,
) -> None:
    headers = [("Host", _host_header(endpoint)), ("User-Agent", "wsync")]
    if body is not None:
        headers += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    if upgrade:
        headers += [("Connection", "Upgrade"), ("Upgrade", "tcp")]
    else:
        headers.append(("Connection", "close"))
    data = conn.send(h11.Request(method=method, target=path, headers=headers))
    if body:
        data = (data or b"") + (conn.send(h11.Data(data=body)) or b"")
    data = (data or b"") + (conn.send(h11.EndOfMessage()) or b"")
    writer.write(data)
    await writer.drain()


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> object:
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as err:
            raise ProtocolError(f"bad HTTP from the docker daemon: {err}") from None
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(READ_SIZE))


async def _read_body(conn: h11.Connection, reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        event = await _next_event(conn, reader)
        if isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_ANSWER:
                raise ProtocolError(f"docker daemon answer over {MAX_ANSWER} bytes")
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return bytes(body)


async def request(endpoint: Endpoint, method: str, path: str, body: bytes | None = None) -> Answer:
    """One plain call on a fresh connection; the caller applies the deadline."""
    reader, writer = await connect(endpoint)
    try:
        conn = h11.Connection(h11.CLIENT)
        await _send_request(conn, writer, endpoint, method, path, body, upgrade=False)
        while True:
            event = await _next_event(conn, reader)
            if isinstance(event, h11.Response):
                break
            if isinstance(event, h11.ConnectionClosed):
                raise ProtocolError("the docker daemon closed the connection without answering")
        return Answer(event.status_code, _headers(event), await _read_body(conn, reader))
    finally:
        await close(writer)


async def hijack(endpoint: Endpoint, path: str, body: bytes) -> Hijacked | Answer:
    """``POST path`` asking for ``Upgrade: tcp``: the connection taken over (101 or a
    bare 200), or the complete error answer."""
    reader, writer = await connect(endpoint)
    try:
        conn = h11.Connection(h11.CLIENT)
        await _send_request(conn, writer, endpoint, "POST", path, body, upgrade=True)
        while True:
            event = await _next_event(conn, reader)
            if isinstance(event, h11.InformationalResponse) and event.status_code != 101:
                continue  # a 100 Continue: not the answer yet
            if isinstance(event, h11.InformationalResponse | h11.Response):
                break
            if isinstance(event, h11.ConnectionClosed):
                raise ProtocolError("the docker daemon closed the connection without answering")
        headers = _headers(event)
        if event.status_code in (101, 200):
            check_start_answer(event.status_code, headers)
            leftover, _closed = conn.trailing_data
            return Hijacked(event.status_code, headers, reader, writer, bytes(leftover))
        answer = Answer(event.status_code, headers, await _read_body(conn, reader))
    except BaseException:
        writer.close()  # no await here: this may be a cancellation
        raise
    await close(writer)
    return answer


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(2.0):
            await writer.wait_closed()
