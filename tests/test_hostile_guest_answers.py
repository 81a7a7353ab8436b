"""Answers a hostile guest forges, valid envelopes around payloads that lie (found by an
independent review; each test fails on the code before its fix).

:class:`wsync.testing.forge.ForgingTransport` is the real ``local:`` guest with chosen
answers replaced: an index that announces a thousand terabytes of chunks whose data never
comes, figures of thousands of digits, a staging root with a NUL.  Each must end the pull
with wsync's own error, bounded, never an internal error or a host out of memory.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from wsync.engine.api import ExtractLimits, MiB, PullOptions
from wsync.engine.pull import pull
from wsync.errors import LimitExceeded, StagingFailed, TransportTimeout, WsyncError
from wsync.protocol.records import chunk_length
from wsync.testing.forge import Call, ForgingTransport
from wsync.transports.base import ExecResult

CHUNK = 4 * MiB
#: an index line's width: "C seq(10) offset(20) length(10) hash(32)\n"
LINE = 78
HUGE_STATUS = b"exists 1\nalive 1\nlaunched 1\nindex_size %d\ndata_size 0" % 10**12

Real = Callable[[], Awaitable[ExecResult]]


def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f").write_text("hello\n")
    return ws


def run_pull(
    tmp_path: Path, forge: Callable[[Call, Real], Awaitable[bytes | None]], **options: object
) -> BaseException | None:
    opts = PullOptions(
        state_dir=tmp_path / "state",
        staging_root=str(tmp_path / "staging"),
        helpers=False,
        **options,  # type: ignore[arg-type]
    )

    async def go() -> BaseException | None:
        transport = ForgingTransport(forge)
        try:
            await pull(transport, str(tmp_path / "ws"), tmp_path / "dest", opts)
        except Exception as exc:  # the test looks at what came out
            return exc
        finally:
            await transport.aclose()
        return None

    return asyncio.run(go())


def offset_of(seq: int) -> int:
    return sum(chunk_length(s, CHUNK) for s in range(min(seq, 6))) + max(0, seq - 6) * CHUNK


def index_bytes(start: int, length: int) -> bytes:
    """Bytes ``start`` to ``start + length`` of an endless, well-formed index."""
    first, last = start // LINE, (start + length - 1) // LINE
    lines = b"".join(
        b"C %010d %020d %010d %s\n" % (seq, offset_of(seq), chunk_length(seq, CHUNK), b"0" * 32)
        for seq in range(first, last + 1)
    )
    cut = start - first * LINE
    return lines[cut : cut + length]


@pytest.mark.parametrize("run", ["tar", "manifest"])
def test_an_endless_index_is_refused_at_the_size_bound_not_queued(tmp_path: Path, run: str) -> None:
    """The index's size is the guest's word; --max-bytes was checked only once the whole
    index it announced was read, so 10**12 bytes of index lines, their data never served,
    queued chunks until the host's memory ran out (a listing had no bound at all)."""
    workspace(tmp_path)
    ours: set[str] = set()
    index_read = [0]

    async def forge(call: Call, real: Real) -> bytes | None:
        if call.name.startswith("admit") and call.args[9] == run:
            ours.add(call.args[1])
            await real()  # the producer starts; its admission's answer is ours
            return call.envelope(b"admitted\n" + HUGE_STATUS)
        if call.name == "status" and call.args[0].rsplit("/", 1)[1] in ours:
            return call.envelope(HUGE_STATUS)
        if call.name == "read" and call.args[0].rsplit("/", 2)[-2] in ours:
            if call.args[0].endswith("/index"):
                index_read[0] += int(call.args[2])
                return call.envelope(index_bytes(int(call.args[1]), int(call.args[2])))
            await asyncio.sleep(30)  # the data never comes
            raise TransportTimeout(30)
        return None

    error = run_pull(
        tmp_path,
        forge,
        full=run == "tar",
        timeout=120.0,
        call_timeout=60.0,
        limits=ExtractLimits(max_bytes=64 * MiB, min_free_bytes=0),
    )
    assert isinstance(error, LimitExceeded), error
    assert ("listing" if run == "manifest" else "archive larger") in str(error)
    assert index_read[0] <= 2 * MiB


@pytest.mark.parametrize("digits", [400, 5000])
def test_a_disk_full_refusal_of_endless_figures_is_the_guests_error(
    tmp_path: Path, digits: int
) -> None:
    """``int`` of 5,000 digits raises ValueError, ``float`` of 400 OverflowError: the
    admission's ``disk-full FREE NEED`` ended the pull as an internal error."""
    workspace(tmp_path)

    async def forge(call: Call, real: Real) -> bytes | None:
        if call.name.startswith("admit"):
            return call.envelope(b"disk-full " + b"9" * digits + b" 1", ok=False)
        return None

    error = run_pull(tmp_path, forge)
    assert isinstance(error, StagingFailed), error


def test_a_probe_with_an_endless_free_space_figure_still_pulls(tmp_path: Path) -> None:
    """The free space is advisory: a figure past 19 digits is unknown, not a crash."""
    ws = workspace(tmp_path)

    async def forge(call: Call, real: Real) -> bytes | None:
        if call.name == "probe":
            return call.envelope(call.payload(await real()) + b"\nstage_free_kb " + b"9" * 5000)
        return None

    assert run_pull(tmp_path, forge) is None
    assert (tmp_path / "dest" / "f").read_bytes() == (ws / "f").read_bytes()


def test_a_staging_root_with_a_nul_is_refused(tmp_path: Path) -> None:
    """A NUL passed the root's check: the next exec raised ValueError (an internal error),
    and a helper's shell would have dropped it (another path than the one checked)."""
    workspace(tmp_path)

    async def forge(call: Call, real: Real) -> bytes | None:
        if call.name == "probe":
            lines = call.payload(await real()).split(b"\n")
            forged = [
                line.replace(b"/staging", b"/stag\x00ing")
                if line.startswith(b"stage_root ")
                else line
                for line in lines
            ]
            return call.envelope(b"\n".join(forged))
        return None

    error = run_pull(tmp_path, forge)
    assert isinstance(error, WsyncError) and "control character" in str(error), error


def test_a_staging_dir_that_is_not_utf8_is_a_usage_error(tmp_path: Path) -> None:
    """Through a guest helper it was an internal error (UnicodeEncodeError)."""
    ws = workspace(tmp_path)
    staging = os.fsencode(tmp_path) + b"/stage-\xe9"
    argv = [
        sys.executable, "-m", "wsync", "pull", f"local:{ws}", str(tmp_path / "dest"),
        "--state-dir", str(tmp_path / "state"), "--staging-dir", os.fsdecode(staging),
    ]  # fmt: skip
    out = subprocess.run([os.fsencode(a) for a in argv], capture_output=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert b"the staging directory is not valid UTF-8" in out.stderr
