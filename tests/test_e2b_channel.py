"""The envd process kept open for a guest helper (``E2BChannel``), against the envd
emulator: requests as SendInput calls and answers as data events in lockstep, what ends
the channel (the command's end, a cut stream, silence), and what stops the command: its
stdin's end on a close, a kill on an abort, on an open given up before the ``start``
event, and envd's own deadline behind a host that went away."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from helpers import ECHO, echo_in_lockstep_then_close, echo_until_its_end, receive_line
from wsync.emulators.e2b import E2BFaults, EmulatorThread
from wsync.engine.helpers import HelperPool
from wsync.errors import SandboxUnreachable, TransportError, TransportTimeout
from wsync.protocol import helper
from wsync.transports import e2b, e2b_channel
from wsync.transports.e2b import E2BTransport
from wsync.uri import parse

#: sleeps as many seconds as each line says, then answers
SLEEPER = ["sh", "-c", 'while read -r x; do sleep "$x"; echo slept; done']


@pytest.fixture(scope="module")
def envd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorThread]:
    with EmulatorThread(tmp_path_factory.mktemp("e2b")) as emu:
        emu.create_sandbox("sb")
        yield emu


def _run(emu: EmulatorThread, body: Callable[[E2BTransport], Awaitable[None]]) -> None:
    async def go() -> None:
        transport = E2BTransport.from_uri(parse("e2b://sb/work"), emu.transport_options())
        try:
            await body(transport)
        finally:
            await transport.aclose()  # (it waits for the kills it started)

    asyncio.run(go())


def _gone(emu: EmulatorThread, within: float = 10.0) -> bool:
    """No process of the emulator's runs any more (polled: it exits on its own time)."""
    deadline = time.monotonic() + within
    while emu.emulator.procs and time.monotonic() < deadline:
        time.sleep(0.05)
    return not emu.emulator.procs


def test_requests_and_answers_in_lockstep_then_a_close_ends_its_stdin(
    envd: EmulatorThread,
) -> None:
    envd.set_faults(E2BFaults.off())
    signals = envd.stats["signals"]

    async def body(transport: E2BTransport) -> None:
        channel = await transport.open_channel(ECHO, timeout=20)
        # the last: a request of several SendInput calls, an answer of many data events
        await echo_in_lockstep_then_close(channel, 600_000)

    _run(envd, body)
    assert _gone(envd)  # CloseStdin ended the loop...
    assert envd.stats["signals"] == signals  # ...without a kill


def test_the_command_ending_ends_the_channel_with_an_error(envd: EmulatorThread) -> None:
    envd.set_faults(E2BFaults.off())

    async def body(transport: E2BTransport) -> None:
        await echo_until_its_end(await transport.open_channel(ECHO, timeout=20))

    _run(envd, body)


def test_an_abort_kills_the_command_it_was_running(envd: EmulatorThread) -> None:
    envd.set_faults(E2BFaults.off())
    signals = envd.stats["signals"]

    async def body(transport: E2BTransport) -> None:
        channel = await transport.open_channel(SLEEPER, timeout=20)
        await channel.send(b"0\n")
        assert await receive_line(channel) == b"slept\n"
        await channel.send(b"60\n")  # a call that would run a minute
        with pytest.raises(TransportTimeout):
            await channel.receive(0.3)
        await channel.aclose(abort=True)

    _run(envd, body)
    assert envd.stats["signals"] == signals + 1
    assert _gone(envd)


def test_a_cut_stream_ends_the_channel_and_its_abort_stops_the_command(
    envd: EmulatorThread,
) -> None:
    """envd keeps a process whose stream broke: the helper would wait for its stdin for
    ever, so the call that failed aborts it (the pool does so for any failed call)."""
    envd.set_faults(E2BFaults(cut_stream=1.0, cut_max_bytes=300, cut_reset_share=0.5, seed=5))
    signals: list[int] = []

    async def body(transport: E2BTransport) -> None:
        # a cut before the start event fails the open itself: the emulator's draw depends
        # on how many calls the module made before (alone, the first one is cut so)
        for _ in range(50):
            with contextlib.suppress(TransportError):
                channel = await transport.open_channel(ECHO, timeout=20)
                break
        else:
            pytest.fail("every stream was cut before its start event")
        signals.append(envd.stats["signals"])
        with pytest.raises(TransportError):
            while True:
                await channel.send(b"y" * 100 + b"\n")
                await receive_line(channel)
        assert channel.ended
        await channel.aclose(abort=True)

    _run(envd, body)
    assert envd.stats["signals"] == signals[0] + 1
    assert _gone(envd)


@pytest.mark.parametrize("keepalive", [False, True], ids=["silent", "keepalives"])
def test_a_wedged_stream_ends_the_channel_only_when_even_keepalives_stop(
    envd: EmulatorThread, keepalive: bool
) -> None:
    """infra#3292: ``start`` and then nothing.  Without keepalives the channel ends after
    the stall timeout (the emulator's options: 2.5 s); with them it stands and only the
    call's own deadline says the answer did not come."""
    envd.set_faults(E2BFaults(silence=1.0, silence_keepalive=keepalive))

    async def body(transport: E2BTransport) -> None:
        channel = await transport.open_channel(ECHO, timeout=20)
        await channel.send(b"hello\n")
        if keepalive:
            with pytest.raises(TransportTimeout):
                await channel.receive(4.0)
            assert not channel.ended
        else:
            with pytest.raises(TransportError, match="stalled"):
                await channel.receive(20.0)
            assert channel.ended
        await channel.aclose(abort=True)

    _run(envd, body)
    assert _gone(envd)


def test_an_open_given_up_before_the_start_event_kills_by_tag(envd: EmulatorThread) -> None:
    """The process exists before envd's first frame: an open that times out in between has
    no pid, only the tag its Start carried, and kills by that."""
    envd.set_faults(E2BFaults(start_delay=3.0))
    signals = envd.stats["signals"]

    async def body(transport: E2BTransport) -> None:
        with pytest.raises(TransportTimeout):
            await transport.open_channel(ECHO, timeout=1.0)

    _run(envd, body)
    assert envd.stats["signals"] == signals + 1
    assert _gone(envd)


def test_envd_ends_a_helper_at_its_lifetime_and_the_pool_retires_it_before(
    envd: EmulatorThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper's Start asks envd to kill it after LIFETIME (a host that died leaves it
    waiting for stdin); the channel says it ended after RETIRE, so the pool lets it go
    between calls and opens another rather than lose a call to that deadline."""
    envd.set_faults(E2BFaults.off())
    kills = envd.stats["deadline_kills"]
    monkeypatch.setattr(e2b, "LIFETIME", 1.0)

    async def lifetime(transport: E2BTransport) -> None:
        channel = await transport.open_channel(ECHO, timeout=20)
        with pytest.raises(TransportError, match="ended"):
            await channel.receive(10.0)
        await channel.aclose()

    _run(envd, lifetime)
    assert envd.stats["deadline_kills"] == kills + 1

    monkeypatch.setattr(e2b, "LIFETIME", e2b_channel.LIFETIME)
    monkeypatch.setattr(e2b, "RETIRE", 0.5)

    async def retired(transport: E2BTransport) -> None:
        pool = HelperPool(transport, 2)
        try:
            for nonce in ("a1", "b2"):
                out = await pool.run(["echo", "hi"], nonce, gate=False, timeout=20, limit=4096)
                assert out == b"hi\n"
                await asyncio.sleep(0.6)
            assert pool.opened == 2  # the first was retired while idle
        finally:
            await pool.aclose()

    signals = envd.stats["signals"]
    _run(envd, retired)
    assert envd.stats["signals"] == signals + 1  # the retired one, killed while idle
    assert _gone(envd)


def test_helper_requests_through_the_channel_are_exactly_an_execs_output(
    envd: EmulatorThread, tmp_path: Path
) -> None:
    """The real helper script behind the channel: a binary answer (every byte value) comes
    back byte for byte, and the next call goes through the same process."""
    envd.set_faults(E2BFaults.off())
    blob = bytes(range(256)) * 1000
    (tmp_path / "blob").write_bytes(blob)

    async def body(transport: E2BTransport) -> None:
        channel = await transport.open_channel(helper.ARGV, timeout=20)
        try:
            for nonce in ("c3", "d4"):
                await channel.send(
                    helper.request(["cat", str(tmp_path / "blob")], nonce, gate=False)
                )
                splitter = helper.ResponseSplitter(nonce, 1 << 20)
                while not splitter.done:
                    splitter.receive_data(await channel.receive(10.0))
                assert bytes(splitter.response) == blob
                assert not splitter.leftover
        finally:
            await channel.aclose()

    execs = envd.stats["execs"]
    _run(envd, body)
    assert envd.stats["execs"] == execs + 1


def test_an_open_asks_again_while_the_edge_says_the_sandbox_is_not_found(
    envd: EmulatorThread,
) -> None:
    """As an exec does: a resuming sandbox is "not found" at the edge for a moment, so
    the open asks three times before that means exit 3."""
    envd.set_faults(E2BFaults(bad_gateway=1.0, not_found_share=1.0))
    gateways = envd.stats["bad_gateway"]

    async def body(transport: E2BTransport) -> None:
        with pytest.raises(SandboxUnreachable, match="sandbox not found") as info:
            await transport.open_channel(ECHO, timeout=20)
        assert not isinstance(info.value, TransportError)

    _run(envd, body)
    assert envd.stats["bad_gateway"] == gateways + 3


def test_closing_helpers_on_a_link_that_stopped_answering_does_not_wait_for_each(
    envd: EmulatorThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close's CloseStdin (and the kill behind it) go on in the transport's tasks: the
    pool lets go of five helpers at once, where waiting for each CloseStdin's bound in
    turn took 25 s, and the transport's close waits for those tasks within its own bound."""
    envd.set_faults(E2BFaults.off())

    async def body(transport: E2BTransport) -> None:
        pool = HelperPool(transport, 5)
        calls = (
            pool.run(["sleep", "0.3"], f"{i:02x}", gate=False, timeout=20, limit=4096)
            for i in range(5)
        )
        await asyncio.gather(*calls)
        assert pool.opened == 5

        async def black_hole(path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
            await asyncio.sleep(3600)  # the link stops answering
            raise AssertionError("unreachable")

        monkeypatch.setattr(transport, "_unary", black_hole)
        async with asyncio.timeout(10):  # five CloseStdin bounds in turn would be 25 s
            await pool.aclose()

    _run(envd, body)
    for entry in list(envd.emulator.procs.values()):  # nobody could end them
        entry.kill()
    assert _gone(envd)


def test_a_send_given_up_ends_the_channel_and_age_alone_refuses_no_send(
    envd: EmulatorThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SendInput given up (the call's deadline) may still be applied after a later one,
    so the channel takes no more; a channel past its retirement age that the pool took a
    moment before still carries the call it was taken for."""
    envd.set_faults(E2BFaults.off())
    monkeypatch.setattr(e2b, "RETIRE", 0.3)

    async def body(transport: E2BTransport) -> None:
        channel = await transport.open_channel(ECHO, timeout=20)
        await asyncio.sleep(0.5)
        assert channel.ended  # the pool would not take it now...
        await channel.send(b"late\n")  # ...but one it took still works
        assert await receive_line(channel) == b"got late\n"
        await channel.aclose()

        monkeypatch.setattr(e2b, "RETIRE", e2b_channel.RETIRE)
        channel = await transport.open_channel(ECHO, timeout=20)

        async def stalled(path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        monkeypatch.setattr(channel, "_unary", stalled)  # its SendInput hook
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await channel.send(b"lost\n")
        assert channel.ended
        with pytest.raises(TransportError, match="closed"):
            await channel.send(b"next\n")
        await channel.aclose(abort=True)

    _run(envd, body)
    assert _gone(envd)


def test_a_stream_error_that_is_no_http_error_is_the_channels_said_reason() -> None:
    """httpx's StreamError is no HTTPError: it escaped the reader task (lost there), and
    the channel said only that "the stream ended"."""
    import httpx

    class Cut(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            raise httpx.StreamClosed()
            yield b""  # an async generator

    async def main() -> str:
        async def never(*_: object) -> tuple[int, bytes]:
            raise AssertionError("no request goes out")

        stopped: list[int | None] = []
        response = httpx.Response(200, stream=Cut())
        channel = e2b_channel.E2BChannel(
            response,
            "e2b://sb",
            tag="t",
            unary=never,
            stop=lambda pid, tag, abort: stopped.append(pid),
            stall_timeout=10,
        )
        try:
            await channel.started()
        except TransportError as err:
            return str(err)
        finally:
            await channel.aclose()
        return ""

    assert "StreamClosed" in asyncio.run(main())


def test_envds_end_status_reaches_the_channels_reason_printable() -> None:
    """envd runs in the sandbox: the status of its ``end`` event reached the channel's
    reason (and logs) with terminal escapes (found by review)."""
    import httpx

    from wsync.transports import e2b_protocol as ep

    evil = "\x1b]0;owned\x07\x1b[2J\rfake: ok"

    class Ends(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield ep.encode_event(ep.Start(pid=7))
            yield ep.encode_event(ep.End(exit_code=0, exited=True, status=evil))

    async def main() -> str:
        async def never(*_: object) -> tuple[int, bytes]:
            raise AssertionError("no request goes out")

        channel = e2b_channel.E2BChannel(
            httpx.Response(200, stream=Ends()),
            "e2b://sb",
            tag="t",
            unary=never,
            stop=lambda pid, tag, abort: None,
            stall_timeout=10,
        )
        try:
            await channel.started()
            while await channel.receive(10):
                pass
        except TransportError as err:
            return str(err)
        finally:
            await channel.aclose()
        return ""

    said = asyncio.run(main())
    assert "the command ended" in said and "owned" in said, said
    assert not any(c in said for c in "\x1b\x07\r"), repr(said)
