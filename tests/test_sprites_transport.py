"""The ``sprites://`` client transport against the emulator on a loopback port.

Each test runs a real websockets server and the real client in one event loop
(``asyncio.run``).  They prove the honesty rules of the transport contract on
this backend: no exit frame is ``None`` (never 0), late data is kept, the
drain deadline bounds a lingering server, auth/404/refused map to wsync's
errors, deadlines raise ``TransportTimeout``, and the token never leaks.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from conftest import ProcessWatch
from wsync.emulators.sprites import SpritesEmulator, SpritesFaults
from wsync.errors import (
    AuthFailed,
    SandboxUnreachable,
    TransportError,
    TransportTimeout,
    UsageError,
)
from wsync.transports.registry import open_transport
from wsync.transports.sprites import SpritesTransport
from wsync.uri import parse

T = TypeVar("T")
KiB = 1024
TOKEN = "s3cr3t-token-value"


def with_emulator(
    root: Path,
    body: Callable[[SpritesEmulator, SpritesTransport], Awaitable[T]],
    faults: SpritesFaults | None = None,
    **options: Any,
) -> T:
    async def main() -> T:
        async with SpritesEmulator(root / "sprites", token=TOKEN, faults=faults) as emu:
            emu.create_sprite("box")
            opts = {**emu.transport_options(), **options}
            _, transport = open_transport("sprites://box/work", opts)
            assert isinstance(transport, SpritesTransport)
            async with transport:
                return await body(emu, transport)

    return asyncio.run(main())


def test_binary_stdout_stderr_exit_status_and_stdin(tmp_path: Path) -> None:
    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value

    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        r = await t.exec(["sh", "-c", "printf out; printf err >&2; exit 7"], timeout=20)
        assert (r.stdout, r.stderr, r.exit_status, r.truncated) == (b"out", b"err", 7, False)
        r = await t.exec(["cat"], stdin=blob, timeout=20)
        assert r.stdout == blob
        assert r.exit_status == 0
        r = await t.exec(["cat"], stdin=b"", timeout=20)
        assert (r.stdout, r.exit_status) == (b"", 0)
        r = await t.exec(["cat"], timeout=20)  # stdin=None: /dev/null, not a hang
        assert (r.stdout, r.exit_status) == (b"", 0)
        r = await t.exec(["no-such-command-wsync"], timeout=20)
        assert r.exit_status == 127
        r = await t.exec(
            ["sh", "-c", 'printf "%s|" "$@"', "sh", "a b", "'q'", "$X", ""], timeout=20
        )
        assert r.stdout == b"a b|'q'|$X||"

    with_emulator(tmp_path, body)


def test_max_output_truncates_and_says_so(tmp_path: Path) -> None:
    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        r = await t.exec(["head", "-c", "100000", "/dev/zero"], timeout=20, max_output=1000)
        assert r.stdout == b"\0" * 1000
        assert r.truncated
        assert r.exit_status == 0

    with_emulator(tmp_path, body)


def test_concurrent_execs_each_get_their_own_socket(tmp_path: Path) -> None:
    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        results = await asyncio.gather(
            *(t.exec(["sh", "-c", f"sleep 0.1; echo {i}"], timeout=30) for i in range(8))
        )
        assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]
        assert emu.stats["execs"] == 8

    with_emulator(tmp_path, body)


def test_no_exit_frame_is_none_never_zero(tmp_path: Path) -> None:
    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        r = await t.exec(["sh", "-c", "echo hi; exit 0"], timeout=20)
        assert r.stdout == b"hi\n"
        assert r.exit_status is None
        assert any("closed without exit frame" in n for n in r.notes)

    with_emulator(tmp_path, body, SpritesFaults(no_exit_frame=1.0))


def test_zero_frames_is_empty_with_no_status(tmp_path: Path) -> None:
    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        r = await t.exec(["echo", "hi"], timeout=20)
        assert (r.stdout, r.exit_status) == (b"", None)
        assert emu.stats["zero_frames"] == 1

    with_emulator(tmp_path, body, SpritesFaults(zero_frames=1.0))


def test_data_after_exit_frame_is_collected(tmp_path: Path) -> None:
    data = os.urandom(300 * KiB)

    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        (emu.root / "box" / "f").write_bytes(data)
        for _ in range(3):
            r = await t.exec(["cat", "f"], timeout=20)
            assert r.stdout == data
            assert r.exit_status == 0
            assert "data after exit frame" in r.notes
        assert emu.stats["data_after_exit"] == 3

    with_emulator(tmp_path, body, SpritesFaults(data_after_exit=1.0, split_frames=1.0, seed=5))


def test_json_exit_message_is_an_exit_status(tmp_path: Path) -> None:
    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        r = await t.exec(["sh", "-c", "exit 4"], timeout=20)
        assert r.exit_status == 4

    with_emulator(tmp_path, body, SpritesFaults(json_exit=1.0))


def test_drain_deadline_bounds_a_server_that_holds_the_socket(tmp_path: Path) -> None:
    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        r = await t.exec(["echo", "x"], timeout=20)
        assert (r.stdout, r.exit_status) == (b"x\n", 0)
        assert "drain deadline passed before close" in r.notes

    with_emulator(tmp_path, body, SpritesFaults(linger=30.0), drain_timeout=0.3)


def test_severed_connection_is_a_transport_error(tmp_path: Path) -> None:
    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        with pytest.raises(TransportError, match="connection dropped"):
            await t.exec(["head", "-c", "600000", "/dev/zero"], timeout=20)
        assert emu.stats["severed"] == 1

    with_emulator(tmp_path, body, SpritesFaults(sever=1.0, sever_max_bytes=100 * KiB))


def test_deadline_raises_transport_timeout_and_the_exec_is_killed(tmp_path: Path) -> None:
    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        with pytest.raises(TransportTimeout):
            await t.exec(["sleep", "30"], timeout=0.5)
        for _ in range(200):  # the emulator notices the close and kills the process
            if not emu.procs:
                break
            await asyncio.sleep(0.05)
        assert not emu.procs

    with_emulator(tmp_path, body)


def test_stdin_gate_beats_the_ring_and_an_ungated_read_loses_its_head(tmp_path: Path) -> None:
    data = os.urandom(1024 * KiB)

    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        (emu.root / "box" / "f").write_bytes(data)
        naive = await t.exec(["cat", "f"], timeout=20)
        assert naive.exit_status == 0
        assert naive.stdout == data[-64 * KiB :]  # the report's key row
        gated = await t.exec(["sh", "-c", "head -c1 >/dev/null; cat f"], stdin=b"g", timeout=20)
        assert gated.stdout == data

    with_emulator(tmp_path, body, SpritesFaults.report_table())


def test_wrong_token_is_auth_failed_and_never_leaks(tmp_path: Path) -> None:
    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        _, bad = open_transport(
            "sprites://box/work", {"sprites_url": emu.url, "token": "wrong-token-xyz"}
        )
        with pytest.raises(AuthFailed) as info:
            await bad.exec(["true"], timeout=10)
        assert "wrong-token-xyz" not in str(info.value)
        assert "401" in str(info.value)
        assert TOKEN not in repr(t)
        assert TOKEN not in t.description
        assert t.description == "sprites://box"

    with_emulator(tmp_path, body)


def test_unknown_sprite_is_sandbox_unreachable(tmp_path: Path) -> None:
    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        _, other = open_transport("sprites://ghost/work", emu.transport_options())
        with pytest.raises(SandboxUnreachable, match="sprite ghost not found"):
            await other.exec(["true"], timeout=10)

    with_emulator(tmp_path, body)


def test_refused_connection_is_sandbox_unreachable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _, t = open_transport(
        "sprites://box/w", {"sprites_url": f"http://127.0.0.1:{port}", "token": "x"}
    )
    with pytest.raises(SandboxUnreachable, match="cannot connect"):
        asyncio.run(t.exec(["true"], timeout=10))


def test_options_and_environment_resolution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = parse("sprites://box/home/sprite/work")
    for var in ("SPRITES_TOKEN", "SPRITES_API_TOKEN", "SPRITES_API_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(AuthFailed, match="SPRITES_TOKEN"):
        SpritesTransport.from_uri(uri, {})
    monkeypatch.setenv("SPRITES_API_TOKEN", "from-env")
    t = SpritesTransport.from_uri(uri, {})
    assert t.base_url == "https://api.sprites.dev"
    assert t.workspace == "/home/sprite/work"
    assert t._token == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    t = SpritesTransport.from_uri(uri, {"token_file": str(token_file)})
    assert t._token == "from-file"
    monkeypatch.setenv("SPRITES_API_URL", "http://127.0.0.1:9")
    assert SpritesTransport.from_uri(uri, {}).base_url == "http://127.0.0.1:9"
    with pytest.raises(UsageError):
        SpritesTransport.from_uri(uri, {"sprites_url": "ftp://nope"})
    with pytest.raises(UsageError):
        SpritesTransport.from_uri(uri, {"token_file": str(tmp_path / "missing")})
    assert SpritesTransport.capabilities.separate_stderr is False
    assert SpritesTransport.capabilities.stdin is True


def test_a_child_holding_the_pipes_does_not_pin_the_exec(
    tmp_path: Path, procs: ProcessWatch
) -> None:
    """An un-redirected background child keeps stdout open; the exec still ends after
    the command exits (within the emulator's pipe grace), with its output intact."""

    async def body(emu: SpritesEmulator, t: SpritesTransport) -> None:
        script = f"head -c 200000 /dev/zero; sleep {procs.sleep_arg()} & echo started"
        r = await t.exec(["sh", "-c", script], timeout=15)
        assert r.stdout == b"\0" * 200000 + b"started\n"
        assert r.exit_status == 0
        assert emu.stats["pipes_abandoned"] >= 1

    with_emulator(tmp_path, body)


@pytest.mark.parametrize(
    "location", ["https://login.example.com/sso", "/v1/sprites/other/exec?cmd=true"]
)
def test_a_redirected_exec_is_not_followed_nor_blamed_on_the_url(location: str) -> None:
    """websockets followed the upgrade's redirects: one to an https:// page (an SSO proxy
    in front of the API) became a usage error saying the user's URL was bad (exit 2), and
    one on the same host was followed, token and all, to another sprite's exec."""
    seen: list[bytes] = []

    async def main() -> BaseException | None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append((await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")[0])
            writer.write(
                b"HTTP/1.1 302 Found\r\nLocation: " + location.encode() + b"\r\n"
                b"Content-Length: 0\r\n\r\n"
            )
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, t = open_transport(
            "sprites://box/w", {"sprites_url": f"http://127.0.0.1:{port}", "token": TOKEN}
        )
        try:
            await t.exec(["true"], timeout=10)
        except Exception as err:  # what came out is the result
            return err
        finally:
            server.close()
        return None

    err = asyncio.run(main())
    assert isinstance(err, SandboxUnreachable) and "redirect" in str(err), repr(err)
    assert not isinstance(err, UsageError)
    assert len(seen) == 1 and b"/v1/sprites/box/exec" in seen[0]
    assert TOKEN not in str(err)


@pytest.mark.parametrize("url", ["https://alice:hunter2@api.example", "wss://alice@api.example"])
def test_a_base_url_with_credentials_is_refused_without_echoing_them(url: str) -> None:
    """As for the other HTTP backends: credentials in the API URL showed in the transport's
    repr and in every connection error (and a daemon job's record); the token has its own
    option."""
    with pytest.raises(UsageError) as info:
        open_transport("sprites://box/w", {"sprites_url": url, "token": TOKEN})
    assert "hunter2" not in str(info.value) and "alice" not in str(info.value)


@pytest.mark.parametrize("host", ["a..b", "a" * 64 + ".example"])
def test_an_api_host_dns_cannot_spell_is_a_usage_error(host: str) -> None:
    """The resolver's UnicodeError (IDNA: an empty or over-long label) came out of every
    exec as an internal error (exit 1, "report this")."""
    with pytest.raises(UsageError, match="host"):
        _, t = open_transport("sprites://box/w", {"sprites_url": f"http://{host}:1", "token": "x"})
        asyncio.run(t.exec(["true"], timeout=5))
