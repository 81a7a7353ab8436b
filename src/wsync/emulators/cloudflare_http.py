"""Just enough HTTP/1.1 server for the Cloudflare emulator, on raw asyncio streams.

Why not starlette/uvicorn: the faults live below the framework — a body cut
mid-event with the TCP connection reset, a chunked stream closed cleanly without
its ``exit`` event, a ``Content-Length`` body that stops short, a response that
never sends its headers.  Those need the socket.  Requests are small JSON bodies
with ``Content-Length``; connections are kept alive (the client reuses them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

MAX_HEAD = 64 * 1024
MAX_BODY = 1024 * 1024

REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Payload Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


class BadRequest(Exception):
    """The request could not be parsed; answer 400 and close."""


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    method: str
    #: the raw (still %-quoted) path, without the query
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request on the connection, or None at a clean EOF between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as err:
        if not err.partial.strip():
            return None
        raise BadRequest("truncated request head") from None
    except asyncio.LimitOverrunError:
        raise BadRequest("request head too large") from None
    if len(head) > MAX_HEAD:
        raise BadRequest("request head too large")
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise BadRequest("bad request line") from None
    if not version.startswith("HTTP/1."):
        raise BadRequest("HTTP/1.x only")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest("bad header line")
        headers[name.strip().lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise BadRequest("chunked request bodies are not supported")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise BadRequest("bad Content-Length") from None
    if not 0 <= length <= MAX_BODY:
        raise BadRequest("bad Content-Length")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise BadRequest("truncated body") from None
    path = target.partition("?")[0]
    return Request(method, path, headers, body)


def head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def send_json(
    writer: asyncio.StreamWriter, status: int, body: dict[str, Any], *, close: bool = False
) -> None:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(data))}
    if close:
        headers["Connection"] = "close"
    writer.write(head(status, headers) + data)
    await writer.drain()


def chunk(data: bytes) -> bytes:
    """One chunk of a ``Transfer-Encoding: chunked`` body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Transfer-Encoding": "chunked",
}
