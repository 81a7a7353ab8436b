"""The Bridge emulator speaks the Bridge's wire and misbehaves on demand.

A plain httpx client here (not the transport): these tests pin the wire — status
codes, JSON error shapes, SSE framing, the channel's text transforms — and show
each fault firing, so the transport's tests stand on a faithful server.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from wsync.emulators.cloudflare import CloudflareEmulator, CloudflareFaults
from wsync.transports.cloudflare_protocol import Event, SSEParser, exec_body, file_path

TOKEN = "emulator-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

Body = Callable[[CloudflareEmulator, httpx.AsyncClient, Path], Awaitable[None]]


def with_emulator(tmp_path: Path, body: Body, faults: CloudflareFaults | None = None) -> None:
    async def main() -> None:
        async with CloudflareEmulator(tmp_path / "emu", token=TOKEN, faults=faults) as emu:
            box = emu.create_sandbox("box")
            async with httpx.AsyncClient(base_url=emu.url, timeout=30) as client:
                await body(emu, client, box)

    asyncio.run(main())


async def run(
    client: httpx.AsyncClient, argv: list[str], *, session: str | None = None, **kw: object
) -> tuple[int, list[Event], bytes]:
    headers = dict(AUTH)
    if session is not None:
        headers["Session-Id"] = session
    body = exec_body(argv, timeout_ms=int(str(kw.get("timeout_ms", 30000))))
    response = await client.post("/v1/sandbox/box/exec", content=body, headers=headers)
    events = SSEParser().feed(response.content) if response.status_code == 200 else []
    return response.status_code, events, response.content


def output(events: list[Event], name: str = "stdout") -> bytes:
    return b"".join(base64.b64decode(e.data) for e in events if e.name == name)


def exit_code(events: list[Event]) -> int | None:
    codes = [json.loads(e.data)["exit_code"] for e in events if e.name == "exit"]
    return codes[0] if codes else None


def test_wire_shape_of_a_plain_exec(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, client: httpx.AsyncClient, box: Path) -> None:
        response = await client.post(
            "/v1/sandbox/box/exec", content=exec_body(["echo", "hi"], timeout_ms=5000), headers=AUTH
        )
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert (
            response.content
            == b'event: stdout\ndata: aGkK\n\nevent: exit\ndata: {"exit_code":0}\n\n'
        )

    with_emulator(tmp_path, body)


def test_errors_are_json_with_the_bridge_statuses(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, client: httpx.AsyncClient, box: Path) -> None:
        ok = exec_body(["true"], timeout_ms=1000)
        cases = [
            ("/v1/sandbox/box/exec", ok, {}, 401, "unauthorized"),
            ("/v1/sandbox/box/exec", ok, {"Authorization": "Bearer nope"}, 401, "unauthorized"),
            ("/v1/sandbox/ghost/exec", ok, AUTH, 404, "sandbox_not_found"),
            ("/v1/sandbox/box/exec", b"{", AUTH, 400, "invalid_request"),
            ("/v1/sandbox/box/exec", b'{"argv": []}', AUTH, 400, "invalid_request"),
            ("/v1/sandbox/box/exec", ok, {**AUTH, "Session-Id": "bad id!"}, 400, "invalid_request"),
        ]
        for path, content, headers, status, code in cases:
            response = await client.post(path, content=content, headers=headers)
            assert (response.status_code, response.json()["code"]) == (status, code), path
            assert set(response.json()) == {"error", "code"}
        outside = json.dumps({"argv": ["true"], "cwd": "/etc"}).encode()
        response = await client.post("/v1/sandbox/box/exec", content=outside, headers=AUTH)
        assert response.status_code == 403

    with_emulator(tmp_path, body)


def test_the_channel_is_lossy_text(tmp_path: Path) -> None:
    """Sessionless: invalid UTF-8 is U+FFFD, NUL and a missing final newline survive."""

    async def body(emu: CloudflareEmulator, client: httpx.AsyncClient, box: Path) -> None:
        _, events, _ = await run(client, ["printf", "a\\377\\000b"])
        assert output(events) == "a\ufffd\x00b".encode()
        # session mode: one event per line, "\n" added, NULs gone
        _, events, _ = await run(client, ["printf", "l1\\nl\\0002"], session="s1")
        assert [base64.b64decode(e.data) for e in events if e.name == "stdout"] == [
            b"l1\n",
            b"l2\n",
        ]

    with_emulator(tmp_path, body)


def test_timeout_ms_kills_and_reports_124(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, client: httpx.AsyncClient, box: Path) -> None:
        started = time.monotonic()
        _, events, _ = await run(client, ["sleep", "30"], timeout_ms=300)
        assert time.monotonic() - started < 20
        assert exit_code(events) == 124
        assert output(events, "stderr").endswith(b"Command timed out after 300ms")

    with_emulator(tmp_path, body)


def test_made_up_exit_while_the_command_runs(tmp_path: Path) -> None:
    """#873: exit 0 arrives after 64 KiB; the command goes on and finishes unseen."""

    async def body(emu: CloudflareEmulator, client: httpx.AsyncClient, box: Path) -> None:
        script = "head -c 200000 /dev/zero | tr '\\0' x; sleep 3; touch finished; exit 7"
        _, events, _ = await run(client, ["sh", "-c", script])
        assert exit_code(events) == 0
        assert len(output(events)) == 64 * 1024
        assert not (box / "finished").exists()  # still running when the stream "completed"
        for _ in range(100):
            if (box / "finished").exists():
                break
            await asyncio.sleep(0.1)
        assert (box / "finished").exists()
        assert emu.stats["early_exit"] == 1

    with_emulator(tmp_path, body, CloudflareFaults.cut_at(64 * 1024))


def test_zero_exit_long_line_drop_and_lost_tail(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, client: httpx.AsyncClient, box: Path) -> None:
        emu.faults = CloudflareFaults(zero_exit=1.0)
        _, events, _ = await run(client, ["sh", "-c", "exit 3"])
        assert exit_code(events) == 0
        emu.faults = CloudflareFaults(drop_long_lines=1.0)
        _, events, _ = await run(client, ["sh", "-c", "head -c 10000 /dev/zero | tr '\\0' y; echo"])
        assert output(events) == b"y" * 4096 + b"\n"
        emu.faults = CloudflareFaults(lose_tail=1.0)
        _, events, _ = await run(client, ["sh", "-c", "echo one; sleep 1; echo two; exit 5"])
        assert output(events) == b"one\n"
        assert exit_code(events) == 5

    with_emulator(tmp_path, body)


def test_broken_streams(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, client: httpx.AsyncClient, box: Path) -> None:
        emu.faults = CloudflareFaults(no_exit=1.0)
        status, events, _ = await run(client, ["echo", "x"])
        assert (status, output(events), exit_code(events)) == (200, b"x\n", None)
        emu.faults = CloudflareFaults(error_event=1.0, max_fault_bytes=0)
        _, events, _ = await run(client, ["echo", "x"])
        assert [e.name for e in events] == ["error"]
        assert json.loads(events[0].data)["code"] == "exec_transport_error"
        emu.faults = CloudflareFaults(sever=1.0, max_fault_bytes=10)
        with pytest.raises(httpx.RemoteProtocolError):
            await run(client, ["sh", "-c", "head -c 1000 /dev/zero"])
        emu.faults = CloudflareFaults(unavailable=1.0)
        status, _, raw = await run(client, ["true"])
        assert (status, json.loads(raw)["code"]) == (503, "capacity_exceeded")
        emu.faults = CloudflareFaults(idle_close=1.5)  # (sh starts and echoes within it)
        _, events, _ = await run(client, ["sh", "-c", "echo a; sleep 5; echo b"])
        assert (output(events), exit_code(events)) == (b"a\n", None)
        assert emu.stats["idle_close"] == 1

    with_emulator(tmp_path, body)


def test_a_hung_stream_dies_with_its_client(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, client: httpx.AsyncClient, box: Path) -> None:
        for argv in (["echo", "quick"], ["sh", "-c", "echo a; sleep 30"]):
            with pytest.raises(httpx.ReadTimeout):
                await client.post(
                    "/v1/sandbox/box/exec",
                    content=exec_body(argv, timeout_ms=60000),
                    headers=AUTH,
                    timeout=httpx.Timeout(5, read=0.5),
                )
        for _ in range(100):
            if not emu.procs:
                break
            await asyncio.sleep(0.1)
        assert not emu.procs  # the client left: the command was killed
        assert emu.stats["hangs"] >= 1  # the quick one never ended: a hang, not slowness

    with_emulator(tmp_path, body, CloudflareFaults(hang=1.0))


def test_file_api(tmp_path: Path) -> None:
    async def body(emu: CloudflareEmulator, client: httpx.AsyncClient, box: Path) -> None:
        data = bytes(range(256)) * 1000
        (box / "f.bin").write_bytes(data)
        response = await client.get(file_path("box", str(box / "f.bin")), headers=AUTH)
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/octet-stream"
        assert response.content == data
        outside = await client.get(file_path("box", "/etc/hostname"), headers=AUTH)
        assert outside.status_code == 403
        # (built by hand: file_path refuses ".." parts; httpx resolves them, as a server may)
        escape = await client.get(file_path("box", str(box)) + "/../../x", headers=AUTH)
        assert escape.status_code == 403
        missing = await client.get(file_path("box", str(box / "nope")), headers=AUTH)
        assert (missing.status_code, missing.json()["code"]) == (404, "workspace_read_not_found")
        emu.faults = CloudflareFaults(file_truncate=1.0)
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(file_path("box", str(box / "f.bin")), headers=AUTH)
        emu.faults = CloudflareFaults(file_short=1.0)
        short = await client.get(file_path("box", str(box / "f.bin")), headers=AUTH)
        assert short.status_code == 200 and len(short.content) < len(data)
        assert data.startswith(short.content)

    with_emulator(tmp_path, body)
