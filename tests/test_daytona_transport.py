"""DaytonaTransport against the emulator: error mapping, secrets, honesty, the file API."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from conftest import ProcessWatch
from wsync.emulators.daytona import DaytonaEmulatorThread, DaytonaFaults
from wsync.errors import (
    AuthFailed,
    SandboxUnreachable,
    TransportError,
    TransportTimeout,
    UsageError,
)
from wsync.transports.daytona import DaytonaTransport
from wsync.transports.registry import open_transport
from wsync.uri import parse

T = TypeVar("T")
SECRET = "sekrit-daytona-key-123"


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaytonaEmulatorThread]:
    with DaytonaEmulatorThread(tmp_path_factory.mktemp("daytona"), token=SECRET) as emulator:
        emulator.create_sandbox("sb")
        yield emulator


@pytest.fixture(autouse=True)
def faults_off(emu: DaytonaEmulatorThread) -> Iterator[None]:
    emu.set_faults(DaytonaFaults.off())
    yield
    emu.set_faults(DaytonaFaults.off())


def run(
    emu: DaytonaEmulatorThread,
    body: Callable[[DaytonaTransport], Awaitable[T]],
    sandbox: str = "sb",
    **options: Any,
) -> T:
    async def main() -> T:
        opts = {**emu.transport_options(), **options}
        _, transport = open_transport(f"daytona://{sandbox}/work", opts)
        assert isinstance(transport, DaytonaTransport)
        async with transport:
            return await body(transport)

    return asyncio.run(main())


def test_capabilities_declare_a_text_channel_with_a_file_api() -> None:
    caps = DaytonaTransport.capabilities
    assert (caps.stdin, caps.binary_safe, caps.separate_stderr, caps.file_read) == (
        False,
        False,
        False,
        True,
    )


def test_exec_reports_merged_lossy_output_as_seen(emu: DaytonaEmulatorThread) -> None:
    async def body(t: DaytonaTransport) -> None:
        r = await t.exec(["sh", "-c", "echo a; echo b >&2; printf '\\377'; exit 5"], timeout=30)
        assert (r.stdout, r.stderr, r.exit_status) == (b"a\nb\n\xef\xbf\xbd", b"", 5)
        assert any("lossy" in note for note in r.notes)
        with pytest.raises(UsageError):
            await t.exec(["cat"], stdin=b"x", timeout=30)

    run(emu, body)


def test_field_faults_are_reported_not_repaired(emu: DaytonaEmulatorThread) -> None:
    async def body(t: DaytonaTransport) -> None:
        emu.set_faults(DaytonaFaults(truncate_result=1.0))
        cut = await t.exec(["head", "-c", "10000", "/dev/zero"], timeout=30)
        assert cut.exit_status == 0 and len(cut.stdout) < 10000  # the lie passes through
        emu.set_faults(DaytonaFaults(minus_one=1.0))
        assert (await t.exec(["true"], timeout=30)).exit_status == -1
        emu.set_faults(DaytonaFaults(bad_gateway=1.0))
        with pytest.raises(TransportError, match="HTTP 502") as info:
            await t.exec(["true"], timeout=30)
        assert not isinstance(info.value, SandboxUnreachable)  # retryable
        emu.set_faults(DaytonaFaults(early_timeout=1.0))
        with pytest.raises(TransportTimeout):
            await t.exec(["sleep", "3"], timeout=30)

    run(emu, body)


def test_wrong_or_missing_key_is_auth_failed_and_never_shown(
    emu: DaytonaEmulatorThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(t: DaytonaTransport) -> None:
        await t.exec(["true"], timeout=30)

    with pytest.raises(AuthFailed) as info:
        run(emu, body, daytona_token="wrong-key")
    assert info.value.exit_code == 3
    assert "DAYTONA_API_KEY" in str(info.value) and "wrong-key" not in str(info.value)

    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    with pytest.raises(AuthFailed):
        DaytonaTransport.from_uri(parse("daytona://sb/w"), {"daytona_url": emu.url})
    monkeypatch.setenv("DAYTONA_API_KEY", SECRET)
    monkeypatch.setenv("DAYTONA_TOOLBOX_URL", emu.url)
    t = DaytonaTransport.from_uri(parse("daytona://sb/w"), {})
    assert SECRET not in repr(t) and SECRET not in t.description
    assert t.base_url == emu.url
    with pytest.raises(UsageError):
        DaytonaTransport.from_uri(parse("daytona://sb/w"), {"daytona_url": "ftp://x/y"})


def test_token_file_option(emu: DaytonaEmulatorThread, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text(SECRET + "\n")

    async def body(t: DaytonaTransport) -> int | None:
        return (await t.exec(["true"], timeout=30)).exit_status

    assert run(emu, body, daytona_token=None, daytona_token_file=str(key)) == 0


def test_unknown_sandbox_and_no_server_are_unreachable(emu: DaytonaEmulatorThread) -> None:
    async def body(t: DaytonaTransport) -> None:
        await t.exec(["true"], timeout=30)

    with pytest.raises(SandboxUnreachable, match="not found"):
        run(emu, body, sandbox="nope")
    with pytest.raises(SandboxUnreachable) as info:
        run(emu, body, daytona_url="http://127.0.0.1:9/toolbox")
    assert info.value.exit_code == 3


def test_a_client_side_deadline_is_a_timeout_and_kills_the_command(
    emu: DaytonaEmulatorThread, procs: ProcessWatch
) -> None:
    """The answer is held back (late_partial) past the client's grace: the client gives up,
    and kills what it started, since the daemon would not."""
    arg = procs.sleep_arg()
    emu.set_faults(DaytonaFaults(late_partial=1.0, late_delay=20.0))

    async def body(t: DaytonaTransport) -> None:
        with pytest.raises(TransportTimeout):
            await t.exec(["sh", "-c", f"sleep {arg}"], timeout=1.0)
        emu.set_faults(DaytonaFaults.off())

    run(emu, body, timeout_grace=0.5)
    assert procs.wait_gone(arg) == []


def test_read_file_gives_exact_ranges(emu: DaytonaEmulatorThread, tmp_path: Path) -> None:
    data = os.urandom(300_000)
    f = tmp_path / "data"
    f.write_bytes(data)

    async def body(t: DaytonaTransport) -> None:
        assert await t.read_file(str(f), 0, 4096, timeout=30) == data[:4096]
        assert await t.read_file(str(f), 123_457, 65_536, timeout=30) == data[123_457:188_993]
        # the file ends first: short, and honestly so
        assert await t.read_file(str(f), 299_000, 4096, timeout=30) == data[299_000:]
        assert await t.read_file(str(f), 300_000, 10, timeout=30) == b""
        assert await t.read_file(str(f), 5, 0, timeout=30) == b""
        for path in (str(tmp_path / "missing"), str(tmp_path), "relative/path"):
            with pytest.raises(TransportError):
                await t.read_file(path, 0, 10, timeout=30)

    run(emu, body)


def test_read_file_reports_short_bodies_as_errors(
    emu: DaytonaEmulatorThread, tmp_path: Path
) -> None:
    data = os.urandom(200_000)
    f = tmp_path / "data"
    f.write_bytes(data)
    emu.set_faults(DaytonaFaults(short_download=1.0, seed=9))

    async def body(t: DaytonaTransport) -> None:
        for _ in range(8):  # both kinds: a cut connection, a short declared length
            with pytest.raises(TransportError, match=r"short|cut|incomplete|peer closed"):
                await t.read_file(str(f), 1000, 100_000, timeout=30)
        emu.set_faults(DaytonaFaults.off())
        assert await t.read_file(str(f), 1000, 100_000, timeout=30) == data[1000:101_000]

    run(emu, body)
    assert emu.stats["short_download"] >= 8


def test_read_file_without_range_support_reads_small_files_only(
    emu: DaytonaEmulatorThread, tmp_path: Path
) -> None:
    data = os.urandom(100_000)
    f = tmp_path / "data"
    f.write_bytes(data)
    emu.set_faults(DaytonaFaults(range_support=False))

    async def body(t: DaytonaTransport) -> None:
        assert await t.read_file(str(f), 4096, 4096, timeout=30) == data[4096:8192]
        with pytest.raises(TransportError, match="ignores Range"):
            await t.read_file(str(f), 60_000, 4096, timeout=30)
        before = emu.stats["downloads"]
        with pytest.raises(TransportError, match="ignores Range"):
            await t.read_file(str(f), 60_000, 4096, timeout=30)
        assert emu.stats["downloads"] == before  # refused without asking again

    async def main() -> None:
        transport = DaytonaTransport(
            "sb", token=emu.token, base_url=emu.url, full_read_limit=50_000
        )
        async with transport:
            await body(transport)

    asyncio.run(main())


def test_read_file_with_a_wrong_key_is_auth_failed(
    emu: DaytonaEmulatorThread, tmp_path: Path
) -> None:
    async def body(t: DaytonaTransport) -> None:
        with pytest.raises(AuthFailed):
            await t.read_file(str(tmp_path), 0, 10, timeout=30)

    run(emu, body, daytona_token="wrong")


@pytest.mark.parametrize("shell", ["/bin/sh", "bash", "busybox"])
def test_every_daemon_shell_runs_the_argv_exactly(tmp_path: Path, shell: str) -> None:
    """zsh, bash or sh read the command text; busybox sh stands in for a minimal image."""
    path = shutil.which(shell)
    assert path is not None
    words = ["it's", "", "$(echo no)", "a  b", "x\ny", "ü"]
    if shell == "busybox":
        wrapper = tmp_path / "bbsh"
        wrapper.write_text(f"#!/bin/sh\nexec {path} sh\n")
        wrapper.chmod(0o755)
        path = str(wrapper)
    with DaytonaEmulatorThread(tmp_path / "emu", shell=path) as emulator:
        emulator.create_sandbox("sb")

        async def body(t: DaytonaTransport) -> bytes:
            r = await t.exec(["printf", "%s\\000", *words], timeout=30)
            assert r.exit_status == 0
            return r.stdout

        out = run(emulator, body)
    assert out.split(b"\0")[:-1] == [w.encode() for w in words]


def test_daemon_sandbox_config_gives_the_key_by_reference(
    emu: DaytonaEmulatorThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's ``[sandboxes.X]``: URL as an option, the key as ``env:``/``file:``."""
    from wsync.daemon.config import SandboxConfig, resolve_transport_options

    monkeypatch.setenv("MY_DAYTONA_KEY", SECRET)
    key = tmp_path / "key"
    key.write_text(SECRET + "\n")
    for ref in ("env:MY_DAYTONA_KEY", f"file:{key}"):
        box = SandboxConfig(
            uri="daytona://sb/work",
            options={"daytona_url": emu.url},
            secrets={"daytona_token": ref},
        )
        opts = resolve_transport_options(box)

        async def body(t: DaytonaTransport) -> int | None:
            return (await t.exec(["true"], timeout=30)).exit_status

        assert run(emu, body, **opts) == 0


def test_a_cancelled_exec_is_killed_but_a_detached_producer_survives(
    emu: DaytonaEmulatorThread, procs: ProcessWatch
) -> None:
    """The kill hits the exec's process group only; ``setsid`` children have their own."""
    detached, attached = procs.sleep_arg(), procs.sleep_arg()
    script = f"setsid sleep {detached} </dev/null >/dev/null 2>&1 & sleep {attached}"

    async def body(t: DaytonaTransport) -> None:
        task = asyncio.create_task(t.exec(["sh", "-c", script], timeout=60))
        assert await asyncio.to_thread(procs.wait_present, attached)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(emu, body)  # aclose waits for the kill
    assert procs.wait_gone(attached) == []
    assert procs.pids(detached), "the detached process must survive"


def test_a_command_cancelled_before_its_shell_started_never_runs(
    tmp_path: Path, procs: ProcessWatch
) -> None:
    """The daemon holds the execute a few seconds before starting its shell; the cancel
    lands in between, so the kill runs first and finds no marked process.  The command
    must still not run: the daemon would keep it until its own timeout."""
    arg = procs.sleep_arg(600)
    with DaytonaEmulatorThread(tmp_path, faults=DaytonaFaults(start_delay=3.0)) as emu:
        emu.create_sandbox("sb")

        async def body(t: DaytonaTransport) -> None:
            task = asyncio.create_task(t.exec(["sleep", arg], timeout=600))
            for _ in range(1500):  # 30 s
                if emu.stats["execs"]:
                    break
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        run(emu, body)  # aclose waits for the kill
        # both executes answered (the kill, then the late command): the command is over
        deadline = time.monotonic() + 20
        while emu.stats["http_200"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert emu.stats["slow_starts"] == 1, "the delayed start never came"
        left = procs.wait_gone(arg)
        procs.kill_all()  # a failure must not leave the emulator a live process to stop
    assert left == []


def test_aclose_does_not_wait_long_for_a_kill_that_hangs(
    emu: DaytonaEmulatorThread, procs: ProcessWatch
) -> None:
    """Every answer is held back: the kill itself hangs, and aclose gives up on it."""
    arg = procs.sleep_arg()
    emu.set_faults(DaytonaFaults(late_partial=1.0, late_delay=25.0))

    async def main() -> float:
        transport = DaytonaTransport(
            "sb", token=emu.token, base_url=emu.url, timeout_grace=0.2, close_wait=1.0
        )
        with pytest.raises(TransportTimeout):
            await transport.exec(["sleep", arg], timeout=0.5)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await transport.aclose()
        return loop.time() - started

    assert asyncio.run(main()) < 15.0  # the held answers take 25 s


def test_a_redirecting_url_is_unreachable_not_retried(tmp_path: Path) -> None:
    """A wrong toolbox URL that redirects (http → https, a login page) is a setup error."""

    async def main() -> None:
        async def redirect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 301 Moved\r\nLocation: https://x/\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(redirect, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport = DaytonaTransport("sb", token="k", base_url=f"http://127.0.0.1:{port}/tb")
        try:
            with pytest.raises(SandboxUnreachable, match="redirects"):
                await transport.exec(["true"], timeout=10)
        finally:
            await transport.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_read_file_never_ends_a_pull_on_a_connection_failure() -> None:
    """The file API is a fast path: no server is a TransportError (fall back), not exit 3."""

    async def main() -> None:
        transport = DaytonaTransport("sb", token="k", base_url="http://127.0.0.1:9/toolbox")
        async with transport:
            with pytest.raises(TransportError) as info:
                await transport.read_file("/x", 0, 10, timeout=10)
            assert not isinstance(info.value, SandboxUnreachable)

    asyncio.run(main())


def test_old_daemons_that_split_the_command_without_a_shell_run_it_too(tmp_path: Path) -> None:
    """Before PR #3918 the daemon split ``command`` on quotes (``parseCommand``): the same
    text still runs the argv, but empty words vanish (documented)."""
    words = ["it's", "$(echo no)", "a  b", "x\ny", "ü", '"dq"']
    with DaytonaEmulatorThread(tmp_path / "emu", split_command=True) as emulator:
        emulator.create_sandbox("sb")

        async def body(t: DaytonaTransport) -> tuple[bytes, bytes, int | None]:
            r = await t.exec(["printf", "%s\\000", *words], timeout=30)
            empty = await t.exec(["sh", "-c", 'echo "$#"', "sh", "", "x"], timeout=30)
            assert (await t.exec(["sh", "-c", "exit 9"], timeout=30)).exit_status == 9
            return r.stdout, empty.stdout, r.exit_status

        out, empty, status = run(emulator, body)
    assert status == 0
    assert out.split(b"\0")[:-1] == [w.encode() for w in words]
    assert empty == b"1\n"  # the empty word was dropped (a shell-reading daemon says 2)
