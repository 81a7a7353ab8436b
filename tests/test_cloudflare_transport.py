"""``CloudflareTransport`` against the Bridge emulator: honest results, mapped errors, no leaks.

What the transport promises: what the Bridge said is reported as said (a made-up
``exit 0`` included — the engine's envelopes catch it), a stream without an
``exit`` event is ``exit_status=None``, broken streams and refusals are
``TransportError``, deadlines ``TransportTimeout``, auth ``AuthFailed`` (exit 3),
and the token appears nowhere but the ``Authorization`` header.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from wsync.emulators.cloudflare import CloudflareEmulator, CloudflareFaults
from wsync.errors import (
    AuthFailed,
    SandboxUnreachable,
    TransportError,
    TransportTimeout,
    UsageError,
)
from wsync.transports.cloudflare import CloudflareTransport
from wsync.transports.registry import open_transport
from wsync.uri import parse

TOKEN = "cf-s3cr3t-token-value"

Body = Callable[[CloudflareEmulator, CloudflareTransport, Path], Awaitable[None]]


def with_emulator(tmp_path: Path, body: Body, faults: CloudflareFaults | None = None) -> None:
    async def main() -> None:
        async with CloudflareEmulator(tmp_path / "emu", token=TOKEN, faults=faults) as emu:
            box = emu.create_sandbox("Box-1")
            _, t = open_transport(f"cloudflare://Box-1{box}", emu.transport_options())
            assert isinstance(t, CloudflareTransport)
            async with t:
                await body(emu, t, box)

    asyncio.run(main())


def test_exec_reports_what_the_channel_carried(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, t: CloudflareTransport, box: Path) -> None:
        r = await t.exec(["sh", "-c", "printf 'ok\\377'; echo err >&2; exit 4"], timeout=20)
        assert (r.stdout, r.stderr, r.exit_status) == ("ok\ufffd".encode(), b"err\n", 4)
        with pytest.raises(UsageError, match="no stdin"):
            await t.exec(["cat"], stdin=b"x", timeout=5)
        assert t.capabilities.binary_safe is False and t.capabilities.stdin is False
        assert t.sandbox_id == "Box-1"  # the id keeps its case (URL hostnames do not)

    with_emulator(tmp_path, body)


def test_made_up_exit_zero_is_reported_not_repaired(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, t: CloudflareTransport, box: Path) -> None:
        r = await t.exec(["sh", "-c", "head -c 300000 /dev/zero | tr '\\0' z"], timeout=20)
        assert r.exit_status == 0 and len(r.stdout) == 64 * 1024  # what the Bridge claimed

    with_emulator(tmp_path, body, CloudflareFaults.cut_at(64 * 1024))


def test_stream_faults_map_to_honest_results(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, t: CloudflareTransport, box: Path) -> None:
        emu.faults = CloudflareFaults(no_exit=1.0)
        r = await t.exec(["echo", "x"], timeout=20)
        assert (r.stdout, r.exit_status) == (b"x\n", None)
        assert "stream ended without exit event" in r.notes
        emu.faults = CloudflareFaults(sever=1.0, max_fault_bytes=100)
        with pytest.raises(TransportError, match="stream broken"):
            await t.exec(["sh", "-c", "head -c 5000 /dev/zero"], timeout=20)
        emu.faults = CloudflareFaults(error_event=1.0, max_fault_bytes=0)
        with pytest.raises(TransportError, match="exec_transport_error"):
            await t.exec(["echo", "x"], timeout=20)
        emu.faults = CloudflareFaults(hang=1.0)
        with pytest.raises(TransportTimeout):
            await t.exec(["echo", "x"], timeout=1.0)
        emu.faults = CloudflareFaults(split=1.0, line_mode=1.0)
        r = await t.exec(["sh", "-c", "echo a; echo b >&2; printf c"], timeout=20)
        assert (r.stdout, r.stderr, r.exit_status) == (b"a\nc\n", b"b\n", 0)
        emu.faults = CloudflareFaults.off()
        assert (await t.exec(["echo", "again"], timeout=20)).stdout == b"again\n"

    with_emulator(tmp_path, body)


def test_503_before_the_stream_is_retried_then_reported(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, t: CloudflareTransport, box: Path) -> None:
        # "starting" for 2 s: the first request lands in it even on a loaded machine (0.3 s
        # did not, once), and the retries' delays (0.4 + 0.8 + 1.6 + 3.2 s) outlast it
        t.retry_delay = 0.4
        emu.faults = CloudflareFaults(starting_for=2.0)
        emu._started = asyncio.get_running_loop().time()  # "the container is starting" now
        assert (await t.exec(["echo", "up"], timeout=20)).stdout == b"up\n"
        assert emu.stats["http_503"] >= 1
        t.retry_delay = 0.05  # (every answer a 503 now: no window to outlast)
        emu.faults = CloudflareFaults(unavailable=1.0)
        with pytest.raises(TransportError, match="HTTP 503"):
            await t.exec(["true"], timeout=20)

    with_emulator(tmp_path, body)


def test_wrong_token_is_auth_failed_and_never_leaks(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, t: CloudflareTransport, box: Path) -> None:
        _, bad = open_transport(
            "cloudflare://Box-1/w", {"cloudflare_url": emu.url, "cloudflare_token": "wrong-xyz"}
        )
        async with bad:
            with pytest.raises(AuthFailed) as info:
                await bad.exec(["true"], timeout=10)
            assert "wrong-xyz" not in str(info.value) and "401" in str(info.value)
            with pytest.raises(AuthFailed):
                await bad.read_file(str(box / "x"), 0, 1, timeout=10)
        for text in (repr(t), t.description, repr(bad), bad.description):
            assert TOKEN not in text and "wrong-xyz" not in text
        assert t.description == "cloudflare://Box-1"

    with_emulator(tmp_path, body)


def test_unknown_sandbox_and_refused_connection_are_unreachable(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, t: CloudflareTransport, box: Path) -> None:
        _, other = open_transport("cloudflare://ghost/work", emu.transport_options())
        async with other:
            with pytest.raises(SandboxUnreachable, match="ghost not found"):
                await other.exec(["true"], timeout=10)

    with_emulator(tmp_path, body)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = {"cloudflare_url": f"http://127.0.0.1:{port}", "cloudflare_token": "x"}
    _, t = open_transport("cloudflare://b/w", options)

    async def refused() -> None:
        async with t:
            await t.exec(["true"], timeout=10)

    with pytest.raises(SandboxUnreachable, match="cannot reach"):
        asyncio.run(refused())


def test_read_file_exact_short_refused(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)

    async def body(emu: CloudflareEmulator, t: CloudflareTransport, box: Path) -> None:
        (box / "chunk").write_bytes(data)
        path = str(box / "chunk")
        assert await t.read_file(path, 0, len(data), timeout=20) == data
        assert await t.read_file(path, 1000, 70000, timeout=20) == data[1000:71000]
        assert await t.read_file(path, len(data) - 5, 100, timeout=20) == data[-5:]
        assert await t.read_file(path, 0, 0, timeout=20) == b""
        with pytest.raises(TransportError, match="HTTP 403"):
            await t.read_file("/etc/hostname", 0, 10, timeout=20)  # outside /workspace
        with pytest.raises(TransportError, match="HTTP 404"):
            await t.read_file(str(box / "missing"), 0, 10, timeout=20)
        emu.faults = CloudflareFaults(file_truncate=1.0)
        with pytest.raises(TransportError, match="broken"):
            await t.read_file(path, 0, len(data), timeout=20)
        emu.faults = CloudflareFaults(file_short=1.0)
        short = await t.read_file(path, 0, len(data), timeout=20)
        assert len(short) < len(data) and data.startswith(short)  # short, never wrong
        emu.faults = CloudflareFaults(file_unavailable=1.0)
        with pytest.raises(TransportError, match="HTTP 503"):
            await t.read_file(path, 0, 10, timeout=20)

    with_emulator(tmp_path, body)


def test_options_and_environment_resolution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = parse("cloudflare://MyBox/workspace/project")
    for var in ("CLOUDFLARE_SANDBOX_URL", "CLOUDFLARE_SANDBOX_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UsageError, match="CLOUDFLARE_SANDBOX_URL"):
        CloudflareTransport.from_uri(uri, {})
    monkeypatch.setenv("CLOUDFLARE_SANDBOX_URL", "https://bridge.example.workers.dev/")
    with pytest.raises(AuthFailed, match="CLOUDFLARE_SANDBOX_TOKEN"):
        CloudflareTransport.from_uri(uri, {})
    monkeypatch.setenv("CLOUDFLARE_SANDBOX_TOKEN", "from-env")
    t = CloudflareTransport.from_uri(uri, {})
    assert (t._token, t.base_url, t.sandbox_id) == (
        "from-env",
        "https://bridge.example.workers.dev",
        "MyBox",
    )
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    t = CloudflareTransport.from_uri(uri, {"cloudflare_token_file": str(token_file)})
    assert t._token == "from-file"
    t = CloudflareTransport.from_uri(uri, {"cloudflare_token": "explicit"})
    assert t._token == "explicit"
    with pytest.raises(UsageError, match="cannot read"):
        CloudflareTransport.from_uri(uri, {"cloudflare_token_file": str(tmp_path / "missing")})
    with pytest.raises(UsageError, match="URL"):
        CloudflareTransport.from_uri(uri, {"cloudflare_url": "ftp://x"})
    with pytest.raises(UsageError, match="no user or port"):
        CloudflareTransport.from_uri(parse("cloudflare://u@box:99/w"), {})


def test_daemon_sandbox_config_gives_the_token_by_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's ``[sandboxes.X]``: the URL as an option, the token as ``env:``/``file:``."""
    from wsync.daemon.config import SandboxConfig, resolve_transport_options

    monkeypatch.setenv("MY_CF_TOKEN", TOKEN)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")

    async def body(emu: CloudflareEmulator, t: CloudflareTransport, box: Path) -> None:
        for ref in ("env:MY_CF_TOKEN", f"file:{token_file}"):
            config = SandboxConfig(
                uri=f"cloudflare://Box-1{box}",
                options={"cloudflare_url": emu.url},
                secrets={"cloudflare_token": ref},
            )
            _, daemon_t = open_transport(config.uri, resolve_transport_options(config))
            async with daemon_t:
                assert (await daemon_t.exec(["echo", "ok"], timeout=20)).stdout == b"ok\n"

    with_emulator(tmp_path, body)


def _exec_against_one_answer(content_type: str, body: bytes) -> None:
    """``exec(["true"])`` through a loopback server that answers every request with one
    200 of ``content_type`` and ``body``; what it raises is the caller's to check."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\n"
        writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        options = {"cloudflare_url": f"http://127.0.0.1:{port}", "cloudflare_token": "t"}
        _, t = open_transport("cloudflare://b/w", options)
        try:
            async with t:
                await t.exec(["true"], timeout=10)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_a_login_page_instead_of_the_bridge_is_unreachable_not_retried() -> None:
    """A 200 that is not an event stream (an Access login page, a wrong URL) is exit 3."""
    with pytest.raises(SandboxUnreachable, match="not an event stream"):
        _exec_against_one_answer("text/html", b"<html>Sign in</html>")


def test_a_base_url_with_credentials_is_refused_without_echoing_them() -> None:
    from wsync.errors import UsageError
    from wsync.transports.e2b import E2BTransport
    from wsync.uri import parse

    for scheme, key in (("cloudflare", "cloudflare_url"), ("e2b", "e2b_url")):
        options = {key: "https://user:hunter2@bridge.example", f"{scheme}_token": "t" * 20}
        factory = CloudflareTransport if scheme == "cloudflare" else E2BTransport
        with pytest.raises(UsageError) as info:
            factory.from_uri(parse(f"{scheme}://sbx/work"), options)
        assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("bad", ["\x0c", "\x0b", " ", "\t", "\x7f"])
@pytest.mark.parametrize(
    ("uri", "option", "extra"),
    [
        ("cloudflare://sbx/work", "cloudflare_token", {"cloudflare_url": "http://127.0.0.1:9"}),
        ("e2b://sbx/work", "e2b_token", {"e2b_url": "http://127.0.0.1:9"}),
        ("daytona://sbx/work", "daytona_token", {"daytona_url": "http://127.0.0.1:9/tb"}),
        ("daytona://sbx/work", "daytona_organization_id", {"daytona_token": "k" * 20}),
    ],
)
def test_a_header_value_with_a_control_character_is_refused_unechoed(
    uri: str, option: str, extra: dict[str, str], bad: str
) -> None:
    """Found by a red-team review: a Daytona key holding a form feed or vertical tab
    passed the check (only CR, LF and NUL were refused), h11 refused the header with a
    message quoting it whole, and that reached every retry's log line; the pull ended
    as 'integrity not established'.  Only visible ASCII goes into a header now."""
    from wsync.errors import UsageError

    value = f"secret{bad}value-1234567890"
    with pytest.raises(UsageError, match="control character") as info:
        open_transport(uri, {**extra, option: value})
    assert "secret" not in str(info.value)


def test_a_working_directory_outside_the_workspace_is_not_a_token_problem(tmp_path: Path) -> None:
    """The Bridge refuses a ``cwd`` outside /workspace with 403 (its auth failure is 401);
    that was reported as a bad token (exit 3).  Found by a red-team review."""
    from wsync.errors import UsageError

    async def main() -> None:
        async with CloudflareEmulator(tmp_path / "emu") as emu:
            emu.create_sandbox("sb")
            t = CloudflareTransport("sb", token=emu.token, base_url=emu.url, cwd="/etc")
            try:
                with pytest.raises(UsageError, match=r"only under /workspace.*'/etc'"):
                    await t.exec(["true"], timeout=10)
            finally:
                await t.aclose()

    asyncio.run(main())


def test_a_read_past_the_whole_file_limit_goes_through_exec(tmp_path: Path) -> None:
    """The Bridge serves whole files: each read of a staged stream's later chunks
    downloaded everything before it (quadratic in the stream's length, and its deadline,
    learnt from the length asked, ran out).  A read ending past ``full_read_limit`` is
    refused, and the engine reads it through exec (noted by a red-team review)."""
    data = os.urandom(3 * 1024 * 1024)

    async def body(emu: CloudflareEmulator, t: CloudflareTransport, box: Path) -> None:
        (box / "data").write_bytes(data)
        small = CloudflareTransport("Box-1", token=TOKEN, base_url=emu.url, full_read_limit=2 << 20)
        try:
            path = str(box / "data")
            got = await small.read_file(path, 1 << 20, 1 << 20, timeout=20)
            assert got == data[1 << 20 : 2 << 20]
            with pytest.raises(TransportError, match="serves whole files"):
                await small.read_file(path, 1 << 20, (1 << 20) + 1, timeout=20)
        finally:
            await small.aclose()

    with_emulator(tmp_path, body)


@pytest.mark.parametrize(
    "data",
    [
        b'{"error":"\\u001b]0;owned\\u0007\\u001b[2Jpull complete","code":"\\u001b[31mexec_error"}',
        b"\x1b]0;owned\x07\x1b[2Jpull complete",  # not JSON: its head is the message
    ],
)
def test_an_error_events_words_reach_the_message_printable(data: bytes) -> None:
    """The error event's text comes from the sandbox's side (the command's failure): a
    terminal escape in it went into the TransportError as it was, and from there into
    every retry's log line on the user's terminal (``-v``)."""
    with pytest.raises(TransportError) as info:
        _exec_against_one_answer("text/event-stream", b"event: error\ndata: " + data + b"\n\n")
    said = str(info.value)
    assert "owned" in said and "pull complete" in said, said
    assert said.isprintable(), repr(said)
