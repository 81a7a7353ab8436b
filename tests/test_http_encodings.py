"""The HTTP backends read bodies as sent: no content encoding is asked for or undone.

httpx undoes any ``Content-Encoding`` a server names before a caller's bound sees a byte;
a zstd frame of run-length blocks decodes to ~30,000 times its size, so a hostile toolbox
(Daytona's runs inside the sandbox) or proxy could make a 4 KiB read a gigabyte.  Here a
raw server answers every request with such a frame (8 MiB decoded: enough to tell, too
little to hurt a test worker) and records what each client asked for.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from wsync.errors import AuthFailed, TransportError, WsyncError
from wsync.transports.base import Transport
from wsync.transports.cloudflare import CloudflareTransport
from wsync.transports.daytona import DaytonaTransport
from wsync.transports.e2b import E2BTransport


def rle_bomb(blocks: int) -> bytes:
    """A valid zstd frame of ``blocks`` run-length blocks of 128 KiB: 4 bytes each."""
    out = bytearray(b"\x28\xb5\x2f\xfd\x00" + bytes([7 << 3]))  # no size, 128 KiB window
    for i in range(blocks):
        header = (128 * 1024 << 3) | (1 << 1) | (i == blocks - 1)
        out += struct.pack("<I", header)[:3] + b"0"
    return bytes(out)


BOMB = rle_bomb(64)
CONTENT_TYPES = {
    "cloudflare": "text/event-stream",
    "daytona": "application/json",
    "e2b": "application/connect+json",
}


def _transport(kind: str, url: str) -> Transport:
    if kind == "cloudflare":
        return CloudflareTransport("sb", token="t" * 20, base_url=url)
    if kind == "daytona":
        return DaytonaTransport("sb", token="t" * 20, base_url=url)
    return E2BTransport("sb", token="t" * 20, base_url=url)


def _serve(
    kind: str, status: int, seen: list[dict[str, str]]
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in head[1:] if ":" in line)
            }
            await reader.readexactly(int(headers.get("content-length", "0")))
            seen.append(headers)
            writer.write(
                f"HTTP/1.1 {status} X\r\nContent-Type: {CONTENT_TYPES[kind]}\r\n"
                f"Content-Encoding: zstd\r\nContent-Length: {len(BOMB)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + BOMB
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    return serve


def _run(kind: str, status: int, call: Callable[[Transport], Awaitable[Any]]) -> Any:
    seen: list[dict[str, str]] = []

    async def main() -> Any:
        server = await asyncio.start_server(_serve(kind, status, seen), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport = _transport(kind, f"http://127.0.0.1:{port}")
        try:
            return await call(transport)
        finally:
            await transport.aclose()
            server.close()
            await server.wait_closed()

    try:
        return asyncio.run(main())
    finally:
        assert seen, "the server heard no request"
        assert all(h.get("accept-encoding") == "identity" for h in seen), seen


@pytest.mark.parametrize("kind", ["cloudflare", "daytona", "e2b"])
def test_an_encoded_exec_answer_is_refused_unread(kind: str) -> None:
    with pytest.raises(TransportError, match="encoded as 'zstd'"):
        _run(kind, 200, lambda t: t.exec(["true"], timeout=10, max_output=4096))


@pytest.mark.parametrize("kind", ["cloudflare", "daytona", "e2b"])
def test_an_encoded_file_read_is_refused_unread(kind: str) -> None:
    with pytest.raises(TransportError, match="encoded as 'zstd'"):
        _run(kind, 200, lambda t: t.read_file("/workspace/f", 0, 4096, timeout=10))


@pytest.mark.parametrize("kind", ["cloudflare", "daytona", "e2b"])
def test_an_encoded_error_body_leaves_the_status_to_speak(kind: str) -> None:
    """A 500 whose body names an encoding: its status decides (the body is not read)."""
    with pytest.raises(WsyncError) as info:
        _run(kind, 500, lambda t: t.read_file("/workspace/f", 0, 4096, timeout=10))
    assert "500" in str(info.value)
    assert "encoded" not in str(info.value)


@pytest.mark.parametrize("kind", ["cloudflare", "daytona", "e2b"])
def test_an_error_body_cut_short_leaves_the_status_to_speak(kind: str) -> None:
    """A 401 whose body ends with the connection, long before its length: the error is the
    refused key, not a lost connection to retry (Cloudflare and Daytona had read the body
    without E2B's guard, and called it a transport error)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
                b"Content-Length: 4000\r\n\r\n" + b'{"message": "bad'
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport = _transport(kind, f"http://127.0.0.1:{port}")
        try:
            await transport.exec(["true"], timeout=10, max_output=4096)
        finally:
            await transport.aclose()
            server.close()
            await server.wait_closed()

    with pytest.raises(AuthFailed) as info:
        asyncio.run(main())
    assert "401" in str(info.value) or "auth" in str(info.value).lower(), info.value
