"""The contract every real transport keeps (see ``wsync.transports.base``).

Each test runs against every entry of ``conftest.REAL_TRANSPORTS`` with real
processes: ``local`` forks here, ``ssh`` goes through a real OpenSSH sshd on
loopback.  What they prove, in the engine's terms:

* quoting: hostile argv values arrive as the same bytes (no shell injection);
* exactness: binary stdout and stdin survive byte for byte, several MB;
* honesty: stderr is not mixed into stdout, exit codes are real, and a
  bounded read says it was truncated;
* deadlines: a stuck command raises ``TransportTimeout`` and is killed,
  while a deliberately detached child (the guest producer) is neither
  waited for nor killed;
* concurrency: many execs at once on one transport each get their own bytes.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from conftest import ProcessWatch, TransportCase
from wsync.errors import TransportTimeout
from wsync.transports.base import Transport

T = TypeVar("T")

#: a deadline no healthy exec on a loaded 2-core machine comes near
GENEROUS = 30.0


def run_with(case: TransportCase, body: Callable[[Transport], Awaitable[T]]) -> T:
    """Build the transport inside a fresh event loop, run ``body``, always close."""

    async def main() -> T:
        transport = case.make()
        try:
            return await body(transport)
        finally:
            await transport.aclose()

    return asyncio.run(main())


def needs(t: Transport, *what: str) -> None:
    """Skip a check that the transport's declared capabilities rule out (no stdin...)."""
    missing = [name for name in what if not getattr(t.capabilities, name)]
    if missing:
        pytest.skip(f"{t.scheme} declares no {', '.join(missing)}")


AWKWARD = [
    "plain",
    "two words",
    "  leading and trailing  ",
    "it's",
    '"double"',
    "$(echo injected)",
    "`echo injected`",
    "${HOME}",
    "$HOME",
    "a;b&&c||d|e",
    "> /tmp/wsync-should-not-exist",
    "line one\nline two\n",
    "tab\there",
    "back\\slash",
    "glob * ? [a]",
    "~",
    "",
    "-n",
    "--",
    "-e \\x41",
    "ünïcødé ✓ 日本語 🚀",
    "'\"'\"'",
]


def test_argv_round_trips_exactly(transport_case: TransportCase) -> None:
    async def body(t: Transport) -> None:
        result = await t.exec(["printf", "%s\\000", *AWKWARD], timeout=GENEROUS)
        assert result.exit_status == 0, result
        assert result.stdout.split(b"\0")[:-1] == [a.encode() for a in AWKWARD]
        assert result.stdout.endswith(b"\0")
        assert not result.truncated

    run_with(transport_case, body)
    assert not Path("/tmp/wsync-should-not-exist").exists()


def test_binary_stdout_and_stdin_are_exact(transport_case: TransportCase, tmp_path: Path) -> None:
    pattern = bytes(range(256)) * 4096 * 3  # 3 MiB, every byte value, incl. NUL, \r, \n
    noise = random.Random(7).randbytes(1 << 20)
    payload = pattern + noise
    target = tmp_path / "blob"

    async def body(t: Transport) -> None:
        needs(t, "stdin", "binary_safe")
        # stdin -> file, then file -> stdout: both directions, several MB
        up = await t.exec(
            ["sh", "-c", 'cat > "$1"', "sh", str(target)], stdin=payload, timeout=GENEROUS
        )
        assert up.exit_status == 0, up
        down = await t.exec(["cat", str(target)], timeout=GENEROUS)
        assert down.exit_status == 0
        assert len(down.stdout) == len(payload)
        assert down.stdout == payload
        assert not down.truncated
        echoed = await t.exec(["cat"], stdin=payload, timeout=GENEROUS)
        assert echoed.stdout == payload

    run_with(transport_case, body)
    assert target.read_bytes() == payload


def test_stdin_is_delivered_then_closed(transport_case: TransportCase) -> None:
    async def body(t: Transport) -> None:
        needs(t, "stdin")
        # waits for one line before printing anything: the engine's stdin gate
        gated = await t.exec(
            ["sh", "-c", 'read -r line; printf "got:%s" "$line"'],
            stdin=b"hello\n",
            timeout=GENEROUS,
        )
        assert gated.stdout == b"got:hello"
        assert gated.exit_status == 0
        # EOF follows the bytes, so cat ends; no stdin at all is EOF immediately
        assert (await t.exec(["cat"], stdin=b"x", timeout=GENEROUS)).stdout == b"x"
        assert (await t.exec(["cat"], stdin=b"", timeout=GENEROUS)).stdout == b""
        none = await t.exec(["cat"], timeout=GENEROUS)
        assert none.stdout == b""
        assert none.exit_status == 0
        # a command that never reads stdin still finishes (no EPIPE surprise)
        unread = await t.exec(["true"], stdin=os.urandom(1 << 20), timeout=GENEROUS)
        assert unread.exit_status == 0

    run_with(transport_case, body)


def test_stderr_is_separate_and_exit_status_is_real(transport_case: TransportCase) -> None:
    async def body(t: Transport) -> None:
        mixed = await t.exec(
            ["sh", "-c", "echo out1; echo err1 >&2; echo out2; echo err2 >&2; exit 3"],
            timeout=GENEROUS,
        )
        assert mixed.stdout == b"out1\nout2\n"
        assert mixed.stderr == b"err1\nerr2\n"
        assert mixed.exit_status == 3
        assert (await t.exec(["sh", "-c", "exit 42"], timeout=GENEROUS)).exit_status == 42
        ok = await t.exec(["true"], timeout=GENEROUS)
        assert (ok.exit_status, ok.stdout, ok.stderr) == (0, b"", b"")
        missing = await t.exec(["wsync-no-such-command-xyz"], timeout=GENEROUS)
        assert missing.exit_status == 127

    run_with(transport_case, body)


def test_max_output_truncates_and_says_so(transport_case: TransportCase) -> None:
    async def body(t: Transport) -> None:
        big = await t.exec(
            ["head", "-c", "3000000", "/dev/zero"], timeout=GENEROUS, max_output=12345
        )
        assert big.truncated
        assert big.stdout == b"\0" * 12345
        assert big.exit_status == 0  # the child was drained, not blocked or killed
        exact = await t.exec(["head", "-c", "4096", "/dev/zero"], timeout=GENEROUS, max_output=4096)
        assert not exact.truncated
        assert len(exact.stdout) == 4096
        noisy = await t.exec(
            ["sh", "-c", "head -c 100000 /dev/zero >&2; echo ok"], timeout=GENEROUS, max_output=100
        )
        assert noisy.truncated
        assert noisy.stdout == b"ok\n"
        assert len(noisy.stderr) == 100

    run_with(transport_case, body)


def test_deadline_raises_promptly_and_kills_the_command(
    transport_case: TransportCase, procs: ProcessWatch
) -> None:
    arg_bg, arg_fg = procs.sleep_arg(), procs.sleep_arg()
    script = f"sleep {arg_bg} & sleep {arg_fg}; echo never"

    async def body(t: Transport) -> float:
        started = time.monotonic()
        with pytest.raises(TransportTimeout) as info:
            await t.exec(["sh", "-c", script], timeout=1.0)
        assert info.value.args == (1.0,)
        return time.monotonic() - started

    elapsed = run_with(transport_case, body)
    assert elapsed < 20.0  # the sleeps last 30 s
    if transport_case.guest_is_local:
        assert procs.wait_gone(arg_fg) == []
        assert procs.wait_gone(arg_bg) == []


def test_detached_child_neither_waited_for_nor_killed(
    transport_case: TransportCase, procs: ProcessWatch
) -> None:
    arg = procs.sleep_arg()
    script = f"setsid sh -c 'sleep {arg}' </dev/null >/dev/null 2>&1 & echo started"

    async def body(t: Transport) -> None:
        # if exec waited for the detached sleep (30 s), this deadline would fire
        result = await t.exec(["sh", "-c", script], timeout=15.0)
        assert result.stdout == b"started\n"
        assert result.exit_status == 0

    run_with(transport_case, body)
    if transport_case.guest_is_local:
        assert procs.wait_present(arg), "the detached child must survive its exec"


def test_many_concurrent_execs_each_get_their_own_bytes(transport_case: TransportCase) -> None:
    rng = random.Random(11)
    payloads = [rng.randbytes(rng.randrange(1, 200_000)) for _ in range(24)]

    async def one(t: Transport, i: int) -> None:
        if i % 3 == 0 and t.capabilities.stdin and t.capabilities.binary_safe:
            result = await t.exec(["cat"], stdin=payloads[i], timeout=GENEROUS)
            assert result.stdout == payloads[i]
        else:
            result = await t.exec(
                [
                    "sh",
                    "-c",
                    'printf "%s" "$1"; printf "%s" "$1" >&2; exit "$2"',
                    "sh",
                    f"n{i}",
                    str(i),
                ],
                timeout=GENEROUS,
            )
            assert (result.stdout, result.stderr) == (f"n{i}".encode(), f"n{i}".encode())
            assert result.exit_status == i

    async def body(t: Transport) -> None:
        await asyncio.gather(*(one(t, i) for i in range(len(payloads))))

    run_with(transport_case, body)


def test_aclose_is_idempotent(transport_case: TransportCase) -> None:
    async def main() -> None:
        unused = transport_case.make()
        await unused.aclose()
        await unused.aclose()
        used = transport_case.make()
        assert (await used.exec(["echo", "x"], timeout=GENEROUS)).stdout == b"x\n"
        await used.aclose()
        await used.aclose()
        async with transport_case.make() as ctx:
            assert (await ctx.exec(["true"], timeout=GENEROUS)).exit_status == 0
        assert transport_case.make().description.startswith(transport_case.name)

    asyncio.run(main())


def test_cancelled_exec_kills_the_command(
    transport_case: TransportCase, procs: ProcessWatch
) -> None:
    """The engine cancels execs on Ctrl-C or its overall deadline: nothing may linger."""
    arg = procs.sleep_arg()

    async def body(t: Transport) -> None:
        task = asyncio.create_task(t.exec(["sleep", arg], timeout=GENEROUS))
        assert await asyncio.to_thread(procs.wait_present, arg)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the transport is still usable afterwards
        assert (await t.exec(["echo", "ok"], timeout=GENEROUS)).stdout == b"ok\n"

    run_with(transport_case, body)
    if transport_case.guest_is_local:
        assert procs.wait_gone(arg) == []
