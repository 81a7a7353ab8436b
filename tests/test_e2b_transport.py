"""The ``e2b://`` client against the envd emulator on a loopback port, fault by fault.

Each test runs the emulator and the real client in one event loop (``asyncio.run``).
They prove the honesty rules on this backend: a stream cut before the end-stream message
is ``exit_status=None`` (or a TransportError when reset), start-then-silence gives up at
the stall bound, 502/401 map to exit-3 errors without leaking the token, and the /files
fast path returns exact, short-but-honest, or an error — never wrong bytes as whole.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from wsync.emulators.e2b import E2BEmulator, E2BFaults
from wsync.errors import (
    AuthFailed,
    SandboxUnreachable,
    TransportError,
    TransportTimeout,
    UsageError,
)
from wsync.transports.e2b import E2BTransport
from wsync.transports.e2b_protocol import CONNECT_JSON, START_PATH, StartCollector, encode_envelope
from wsync.transports.registry import open_transport
from wsync.uri import parse

T = TypeVar("T")
KiB = 1024
TOKEN = "e2b-s3cr3t-token-value"


def with_envd(
    root: Path,
    body: Callable[[E2BEmulator, E2BTransport], Awaitable[T]],
    faults: E2BFaults | None = None,
    **options: Any,
) -> T:
    async def main() -> T:
        async with E2BEmulator(root / "envd", token=TOKEN, faults=faults) as emu:
            emu.create_sandbox("sbx")
            _, transport = open_transport("e2b://sbx/work", {**emu.transport_options(), **options})
            assert isinstance(transport, E2BTransport)
            async with transport:
                return await body(emu, transport)

    return asyncio.run(main())


def test_bytes_streams_exit_codes_and_stdin(tmp_path: Path) -> None:
    blob = os.urandom(700 * KiB)

    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        r = await t.exec(["sh", "-c", "printf out; printf err >&2; exit 7"], timeout=20)
        assert (r.stdout, r.stderr, r.exit_status, r.truncated) == (b"out", b"err", 7, False)
        r = await t.exec(["cat"], stdin=blob, timeout=20)
        assert (r.stdout == blob, r.exit_status) == (True, 0)
        r = await t.exec(["cat"], timeout=20)  # "stdin": false, so /dev/null, not a hang
        assert (r.stdout, r.exit_status) == (b"", 0)
        r = await t.exec(["no-such-command-wsync"], timeout=20)
        assert r.exit_status == 127
        r = await t.exec(["sh", "-c", "kill -9 $$"], timeout=20)
        assert r.exit_status == 137  # exitCode -1, "signal: killed"

    with_envd(tmp_path, body)


def test_a_command_abandoned_before_its_start_event_is_killed_by_its_tag(
    tmp_path: Path,
) -> None:
    """Cancelled while the edge still holds the ``start`` frame: the client has no pid,
    yet envd keeps the process; the tag from the StartRequest names it for SendSignal."""

    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        task = asyncio.create_task(t.exec(["sleep", "3600"], timeout=60))
        for _ in range(1500):  # 30 s
            if emu.procs:
                break
            await asyncio.sleep(0.02)
        assert emu.procs, "the command never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(600):
            if not emu.procs:
                break
            await asyncio.sleep(0.05)
        assert emu.procs == {}
        assert emu.stats["signals"] == 1

    with_envd(tmp_path, body, E2BFaults(start_delay=30.0))


def test_a_clean_cut_without_end_stream_is_none_never_zero(tmp_path: Path) -> None:
    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        for _ in range(4):
            r = await t.exec(["head", "-c", "300000", "/dev/zero"], timeout=20)
            assert r.exit_status is None
            assert len(r.stdout) < 300000
            assert any("end-stream" in n or "inside an envelope" in n for n in r.notes)
        assert emu.stats["cut_clean"] == 4

    faults = E2BFaults(cut_stream=1.0, cut_reset_share=0.0, cut_max_bytes=200 * KiB, seed=3)
    with_envd(tmp_path, body, faults)


def test_a_reset_mid_stream_is_a_transport_error(tmp_path: Path) -> None:
    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        with pytest.raises(TransportError):
            await t.exec(["head", "-c", "300000", "/dev/zero"], timeout=20)
        assert emu.stats["cut_reset"] == 1

    faults = E2BFaults(cut_stream=1.0, cut_reset_share=1.0, cut_max_bytes=100 * KiB)
    with_envd(tmp_path, body, faults)


def test_start_then_silence_gives_up_at_the_stall_bound(tmp_path: Path) -> None:
    async def body(emu: E2BEmulator, t: E2BTransport) -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TransportError, match="stalled"):
            await t.exec(["echo", "hi"], timeout=60)
        return loop.time() - started

    elapsed = with_envd(tmp_path, body, E2BFaults(silence=1.0))
    assert elapsed < 30  # the stall bound (about 4 s here), far from the 60 s deadline


def test_by_default_a_silent_stream_is_given_up_within_six_seconds() -> None:
    """Keepalives every 2 s unless tuned, given up after 2.5 missed: a start-then-silence
    fault on the admission (no shorter deadline) cost 30.5 s at 10 s, 9.5 s at 3 s."""
    t = E2BTransport.from_uri(parse("e2b://sbx/work"), {"e2b_url": "http://127.0.0.1:9"})
    assert t.keepalive_interval == 2.0
    assert t.stall_timeout <= 6.0


def test_silence_with_keepalives_ends_at_the_deadline(tmp_path: Path) -> None:
    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        with pytest.raises(TransportTimeout):
            await t.exec(["echo", "hi"], timeout=2.5)
        assert emu.stats["silence"] == 1

    with_envd(tmp_path, body, E2BFaults(silence=1.0, silence_keepalive=True))


def test_dropped_duplicated_and_noisy_output_still_claims_exit_zero(tmp_path: Path) -> None:
    """What a naive client cannot see: the stream is well formed and says 0."""
    data = os.urandom(256 * KiB)

    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        (emu.root / "sbx" / "f").write_bytes(data)
        wrong = 0
        for _ in range(6):
            r = await t.exec(["cat", "f"], timeout=20)
            assert r.exit_status == 0
            wrong += r.stdout != data
        assert wrong >= 3
        assert emu.stats["dropped_data"] + emu.stats["duplicated_data"] >= 3
        assert emu.stats["login_noise"] >= 1

    faults = E2BFaults(drop_data=0.5, dup_data=0.5, login_noise=0.5, seed=2)
    with_envd(tmp_path, body, faults)


def test_deadline_exceeded_racing_end_is_an_error_not_a_result(tmp_path: Path) -> None:
    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        with pytest.raises(TransportError, match="deadline_exceeded") as info:
            await t.exec(["echo", "x"], timeout=20)
        assert not isinstance(info.value, TransportTimeout)  # nothing waited 20 s
        with pytest.raises(TransportTimeout):  # envd's own deadline kill, at ours
            await t.exec(["sleep", "5"], timeout=0.5)

    with_envd(tmp_path, body, E2BFaults(deadline_race=1.0))


def test_502_not_found_is_unreachable_first_then_transient(tmp_path: Path) -> None:
    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        emu.faults = E2BFaults(bad_gateway=1.0, not_found_share=1.0)
        with pytest.raises(SandboxUnreachable, match="sandbox not found") as info:
            await t.exec(["true"], timeout=10)
        assert not isinstance(info.value, TransportError)
        assert emu.stats["bad_gateway"] == 3  # asked three times: a resuming sandbox says it too
        emu.faults = E2BFaults()
        assert (await t.exec(["true"], timeout=10)).exit_status == 0
        emu.faults = E2BFaults(bad_gateway=1.0, not_found_share=1.0)
        with pytest.raises(TransportError, match="502"):  # the sandbox was just there
            await t.exec(["true"], timeout=10)
        emu.faults = E2BFaults(bad_gateway=1.0, not_found_share=0.0)
        with pytest.raises(TransportError, match="Bad Gateway"):
            await t.exec(["true"], timeout=10)

    with_envd(tmp_path, body)


def test_unknown_sandbox_and_wrong_token_are_exit_3_and_never_leak(tmp_path: Path) -> None:
    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        _, ghost = open_transport("e2b://ghost/work", emu.transport_options())
        with pytest.raises(SandboxUnreachable, match="sandbox not found"):
            await ghost.exec(["true"], timeout=10)
        await ghost.aclose()
        _, bad = open_transport(
            "e2b://sbx/work", {"e2b_url": emu.url, "e2b_token": "wrong-token-xyz"}
        )
        with pytest.raises(AuthFailed) as info:
            await bad.exec(["true"], timeout=10)
        assert info.value.exit_code == 3
        assert "wrong-token-xyz" not in str(info.value)
        assert "401" in str(info.value)
        with pytest.raises(TransportError, match="401"):  # the file API refuses, no exit 3
            await bad.read_file("f", 0, 10, timeout=10)
        await bad.aclose()
        assert TOKEN not in repr(t)
        assert t.description == "e2b://sbx"

    with_envd(tmp_path, body)


def test_refused_connection_is_sandbox_unreachable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _, t = open_transport("e2b://sbx/w", {"e2b_url": f"http://127.0.0.1:{port}"})

    async def main() -> None:
        async with t:
            with pytest.raises(SandboxUnreachable, match="cannot connect"):
                await t.exec(["true"], timeout=10)

    asyncio.run(main())


def test_an_absent_stdin_field_keeps_a_pipe_open_until_the_deadline(tmp_path: Path) -> None:
    """Why the client always sends ``"stdin": false``: envd's backward-compatible default."""

    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        message = b'{"process":{"cmd":"cat","args":[]}}'
        async with httpx.AsyncClient(base_url=emu.url, timeout=20) as client:
            response = await client.post(
                START_PATH,
                content=encode_envelope(message),
                headers={
                    "Content-Type": CONNECT_JSON,
                    "Connect-Timeout-Ms": "800",
                    "X-Access-Token": TOKEN,
                    "E2b-Sandbox-Id": "sbx",
                },
            )
        assert response.status_code == 200
        collector = StartCollector(1024)
        collector.feed(response.content)
        assert collector.end is not None and collector.end.status == "signal: killed"
        assert collector.error is not None and collector.error.error_code == "deadline_exceeded"

    with_envd(tmp_path, body)


# ---------------------------------------------------------------- /files fast path


def test_read_file_is_exact_and_honest_about_the_end(tmp_path: Path) -> None:
    data = os.urandom(900 * KiB)

    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        (emu.root / "sbx" / "f").write_bytes(data)
        assert await t.read_file("f", 0, len(data), timeout=10) == data
        absolute = str(emu.root / "sbx" / "f")
        assert await t.read_file(absolute, 12345, 100000, timeout=10) == data[12345:112345]
        assert await t.read_file("f", len(data) - 10, 100, timeout=10) == data[-10:]
        assert await t.read_file("f", len(data), 100, timeout=10) == b""
        assert await t.read_file("f", 5, 0, timeout=10) == b""
        with pytest.raises(TransportError, match="404"):
            await t.read_file("missing", 0, 10, timeout=10)
        with pytest.raises(TransportError, match="400"):
            await t.read_file(str(emu.root / "sbx"), 0, 10, timeout=10)

    with_envd(tmp_path, body)


def test_read_file_faults_short_cut_and_ignored_range(tmp_path: Path) -> None:
    data = os.urandom(2 * 1024 * KiB)
    offset, length = 700 * KiB, 300 * KiB
    want = data[offset : offset + length]

    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        (emu.root / "sbx" / "f").write_bytes(data)
        emu.faults = E2BFaults(file_ignore_range=1.0)
        assert await t.read_file("f", offset, length, timeout=10) == want
        emu.faults = E2BFaults(file_short=1.0)
        short = await t.read_file("f", offset, length, timeout=10)
        assert 0 < len(short) < length and want.startswith(short)
        # a body cut part-way keeps what came before the cut: the caller asks for the rest
        emu.faults = E2BFaults(file_cut=1.0)
        cut = await t.read_file("f", offset, length, timeout=10)
        assert 0 < len(cut) < length and want.startswith(cut)
        stats = emu.stats
        assert (stats["file_ignored_range"], stats["file_short"], stats["file_cut"]) == (1, 1, 1)
        # cut before its first byte (a body of one byte is cut at 0): short too, not an
        # error (raised, it counted as a file API failure, and a pull test that asserts
        # none failed whenever its parallel reads drew such a cut)
        assert await t.read_file("f", offset, 1, timeout=10) == b""
        assert stats["file_cut"] == 2

    with_envd(tmp_path, body)


def test_options_and_environment_resolution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = parse("e2b://i1abc2def/home/user/work")
    for var in ("E2B_ACCESS_TOKEN", "E2B_ENVD_URL", "E2B_DOMAIN"):
        monkeypatch.delenv(var, raising=False)
    t = E2BTransport.from_uri(uri, {})
    assert t.base_url == "https://49983-i1abc2def.e2b.app"
    assert t._token is None  # envd checks a token only on "secure" sandboxes
    assert t.workspace == "/home/user/work"
    monkeypatch.setenv("E2B_DOMAIN", "e2b.dev")
    monkeypatch.setenv("E2B_ACCESS_TOKEN", "from-env")
    t = E2BTransport.from_uri(uri, {})
    assert (t.base_url, t._token) == ("https://49983-i1abc2def.e2b.dev", "from-env")
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert E2BTransport.from_uri(uri, {"e2b_token_file": str(token_file)})._token == "from-file"
    assert E2BTransport.from_uri(uri, {"e2b_token": "opt"})._token == "opt"
    monkeypatch.setenv("E2B_ENVD_URL", "http://127.0.0.1:9/")
    assert E2BTransport.from_uri(uri, {}).base_url == "http://127.0.0.1:9"
    templated = E2BTransport.from_uri(uri, {"e2b_url": "https://{id}.example.test"})
    assert templated.base_url == "https://i1abc2def.example.test"
    with pytest.raises(UsageError):
        E2BTransport.from_uri(uri, {"e2b_url": "ftp://nope"})
    with pytest.raises(UsageError):
        E2BTransport.from_uri(uri, {"e2b_token_file": str(tmp_path / "missing")})
    with pytest.raises(UsageError):
        E2BTransport.from_uri(uri, {"e2b_token": "a\nb"})
    caps = E2BTransport.capabilities
    assert (caps.stdin, caps.binary_safe, caps.separate_stderr, caps.file_read) == (
        True,
        True,
        True,
        True,
    )


def test_files_serves_gzip_without_range_and_errors_as_json(tmp_path: Path) -> None:
    """envd's ``/files`` as other clients meet it: gzip when asked and no Range, JSON errors."""
    data = b"compressible " * 10000

    async def body(emu: E2BEmulator, t: E2BTransport) -> None:
        (emu.root / "sbx" / "g").write_bytes(data)
        headers = {"X-Access-Token": TOKEN, "E2b-Sandbox-Id": "sbx", "Accept-Encoding": "gzip"}
        async with httpx.AsyncClient(base_url=emu.url, timeout=20, headers=headers) as client:
            whole = await client.get("/files", params={"path": "g"})
            assert whole.headers["content-encoding"] == "gzip"
            assert whole.content == data
            ranged = await client.get(
                "/files", params={"path": "g"}, headers={"Range": "bytes=2-5"}
            )
            assert ranged.status_code == 206
            assert "content-encoding" not in ranged.headers
            assert ranged.content == data[2:6]
            missing = await client.get("/files", params={"path": "nope"})
            assert missing.status_code == 404
            assert missing.json() == {"code": 404, "message": "path 'nope' does not exist"}

    with_envd(tmp_path, body)


def test_a_sandbox_id_that_could_change_the_envd_host_is_refused() -> None:
    """The id fills ``{id}`` in the envd host name: only letters, digits, '-' and '_'."""
    from wsync.errors import UsageError
    from wsync.transports.e2b import E2BTransport

    for bad in ("evil.example#", "a.b", "x@y"):
        with pytest.raises(UsageError, match="bad E2B sandbox id"):
            E2BTransport(bad, token=None, base_url="https://49983-{id}.e2b.app", workspace="/w")
