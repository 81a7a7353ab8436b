"""The Docker exec kept open for a guest helper (``DockerChannel``), over a socket pair
whose far end plays the daemon: frames in any split, what ends the channel, the
half-close that is stdin's only EOF, and the kill an abort sends."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from wsync.errors import TransportError
from wsync.transports import docker_http
from wsync.transports.docker_channel import DockerChannel
from wsync.transports.docker_protocol import STDERR, STDIN, STDOUT, SYSTEMERR, encode_frame


async def _pair(
    leftover: bytes = b"",
) -> tuple[DockerChannel, socket.socket, list[bool]]:
    """A channel on one end of a socket pair (the daemon's end is returned, blocking
    off), and the list its abort's kills are noted in (``mark`` of each)."""
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    started = docker_http.Hijacked(101, {}, reader, writer, leftover)
    kills: list[bool] = []
    return DockerChannel(started, "docker://test", kills.append), theirs, kills


async def _all(channel: DockerChannel) -> bytes:
    out = b""
    while data := await channel.receive(5.0):
        out += data
    return out


def _run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [None, 1, 5])
def test_stdout_arrives_in_order_in_any_split_and_stderr_is_dropped(step: int | None) -> None:
    stream = (
        encode_frame(STDOUT, b"hello ")
        + encode_frame(STDERR, b"noise")
        + encode_frame(STDOUT, b"")
        + encode_frame(STDIN, b"world")  # type 0 counts as stdout, as moby's stdcopy says
        + encode_frame(STDOUT, b"\n")
    )

    async def go() -> None:
        head, rest = stream[:3], stream[3:]
        channel, daemon, _ = await _pair(leftover=head)
        loop = asyncio.get_running_loop()
        for at in range(0, len(rest), step or len(rest)):
            await loop.sock_sendall(daemon, rest[at : at + (step or len(rest))])
            await asyncio.sleep(0)
        daemon.close()
        assert await _all(channel) == b"hello world\n"
        assert channel.ended
        await channel.aclose()

    _run(go)


@pytest.mark.parametrize(
    ("tail", "says"),
    [
        (encode_frame(STDOUT, b"cut here")[:-3], "cut inside a frame"),
        (encode_frame(STDOUT, b"x")[:5], "cut inside a frame header"),
        (b"\x07\0\0\0\0\0\0\x01x", "unknown stream type"),
        (encode_frame(SYSTEMERR, b"oci runtime error"), "daemon error: oci runtime error"),
    ],
)
def test_what_is_not_a_whole_stream_ends_the_channel_with_an_error(tail: bytes, says: str) -> None:
    async def go() -> None:
        channel, daemon, _ = await _pair()
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(daemon, encode_frame(STDOUT, b"before "))
        assert await channel.receive(5.0) == b"before "
        await loop.sock_sendall(daemon, tail)
        daemon.close()
        with pytest.raises(TransportError, match=says):
            while await channel.receive(5.0):
                pass
        assert channel.ended
        with pytest.raises(TransportError, match="closed"):
            await channel.send(b"more")
        await channel.aclose()

    _run(go)


def test_requests_reach_the_daemon_and_a_close_ends_its_stdin() -> None:
    """The daemon reads each request as sent, then EOF (moby closes the command's stdin
    on it: the helper's loop ends after the call it runs); no kill for a plain close."""

    async def go() -> None:
        channel, daemon, kills = await _pair()
        loop = asyncio.get_running_loop()
        await channel.send(b"request one\n")
        await channel.send(b"request two\n")
        got = b""
        while len(got) < 24:
            got += await asyncio.wait_for(loop.sock_recv(daemon, 100), 5.0)
        assert got == b"request one\nrequest two\n"
        await channel.aclose()
        assert await asyncio.wait_for(loop.sock_recv(daemon, 100), 5.0) == b""
        assert kills == []  # a plain close lets the helper end by itself
        await channel.aclose()  # idempotent
        daemon.close()

    _run(go)


@pytest.mark.parametrize("heard", [False, True])
def test_an_abort_kills_by_token_and_marks_only_a_command_never_heard_from(heard: bool) -> None:
    """moby answers the start before the process exists: a helper that never sent a byte
    may not have started yet, and the killer's mark keeps it from starting later."""

    async def go() -> None:
        channel, daemon, kills = await _pair()
        if heard:
            await asyncio.get_running_loop().sock_sendall(daemon, encode_frame(STDOUT, b"x"))
            assert await channel.receive(5.0) == b"x"
        await channel.aclose(abort=True)
        assert kills == [not heard]
        daemon.close()

    _run(go)


def test_a_full_inbox_stops_reading_until_the_caller_takes() -> None:
    """Past the inbox's bound the channel stops reading the socket (a guest that floods
    costs bounded memory), and goes on once the caller takes what came."""
    from wsync.transports.base import CHANNEL_BUFFER

    async def go() -> None:
        channel, daemon, _ = await _pair()
        loop = asyncio.get_running_loop()
        piece = encode_frame(STDOUT, b"y" * 65536)
        total = CHANNEL_BUFFER + 4 * 1024 * 1024
        sent = 0

        async def flood() -> None:
            nonlocal sent
            while sent < total:
                await loop.sock_sendall(daemon, piece)
                sent += 65536

        flooding = asyncio.create_task(flood())
        # until the flood stops moving: paused, it is stuck in the socket buffers short of
        # its end (without the pause the channel would read it all, and it would end)
        deadline = loop.time() + 30
        while not flooding.done() and loop.time() < deadline:
            before = sent
            await asyncio.sleep(0.3)
            if sent == before:
                break
        assert not flooding.done() and sent < total
        assert sent <= CHANNEL_BUFFER + 2 * 1024 * 1024  # the bound, a read and the buffers
        got = 0
        while got < total:
            got += len(await channel.receive(5.0))
        await asyncio.wait_for(flooding, 5.0)
        assert got == total
        daemon.close()
        await channel.aclose()

    _run(go)


def test_a_cancel_of_the_close_reaches_its_caller_and_the_connection_still_goes() -> None:
    """A cancel that lands while the close waits for its reader is the caller's (a pull's
    deadline, the pool's bound): it must not be taken for the reader's own and swallowed.
    The connection goes all the same."""

    async def go() -> None:
        channel, daemon, _ = await _pair()
        loop = asyncio.get_running_loop()
        closing = asyncio.create_task(channel.aclose())
        await asyncio.sleep(0)  # the close is at its first wait: the reader's end
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert channel.ended
        assert await asyncio.wait_for(loop.sock_recv(daemon, 100), 5.0) == b""
        daemon.close()

    _run(go)
