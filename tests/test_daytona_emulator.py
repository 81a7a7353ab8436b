"""The Daytona emulator speaks the daemon's wire format, and a naive client loses data.

The "naive client" is what the SDKs do: ``POST /process/execute``, take ``result`` as
the output and trust ``exitCode``.  Against the emulator it reproduces the field
reports: a binary file read back through execute comes back corrupted (lossy UTF-8),
and a large output comes back cut short, both with exit code 0.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ProcessWatch
from helpers import assert_exact, options
from wsync.emulators.daytona import DaytonaEmulatorThread, DaytonaFaults
from wsync.engine.pull import pull_uri

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaytonaEmulatorThread]:
    with DaytonaEmulatorThread(tmp_path_factory.mktemp("daytona")) as emulator:
        emulator.create_sandbox("sb")
        yield emulator


@pytest.fixture(autouse=True)
def faults_off(emu: DaytonaEmulatorThread) -> Iterator[None]:
    emu.set_faults(DaytonaFaults.off())
    yield
    emu.set_faults(DaytonaFaults.off())


def client(emu: DaytonaEmulatorThread, token: str | None = None) -> httpx.Client:
    return httpx.Client(
        base_url=emu.url,
        headers={"Authorization": f"Bearer {token or emu.token}"},
        timeout=60,
    )


def naive_exec(emu: DaytonaEmulatorThread, command: str, **extra: Any) -> httpx.Response:
    with client(emu) as c:
        return c.post("/sb/process/execute", json={"command": command, **extra})


# -- the wire --------------------------------------------------------------------------


def test_execute_merges_streams_in_order_and_answers_like_go(emu: DaytonaEmulatorThread) -> None:
    r = naive_exec(emu, "echo out1; echo err1 >&2; echo out2; printf '<\\377>'; exit 4")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert r.content.startswith(b'{"exitCode":4,"result":')  # Go's field order
    assert r.json() == {"exitCode": 4, "result": "out1\nerr1\nout2\n<\ufffd>"}
    assert b"\\u003c" in r.content  # encoding/json's HTML-safe escape


def test_execute_runs_in_cwd_and_a_signal_death_is_minus_one(emu: DaytonaEmulatorThread) -> None:
    assert naive_exec(emu, "pwd", cwd="/tmp").json()["result"] == "/tmp\n"
    assert naive_exec(emu, "pwd").json()["result"].rstrip("\n").endswith("/sb")
    assert naive_exec(emu, "kill -9 $$").json()["exitCode"] == -1


def test_the_command_is_the_shells_stdin(emu: DaytonaEmulatorThread) -> None:
    """No stdin: a command reading stdin consumes the rest of the script (INFER in the notes)."""
    r = naive_exec(emu, "cat\necho this line is read by cat, not run")
    assert r.json()["result"] == "echo this line is read by cat, not run"


def test_timeout_kills_the_group_and_answers_408_without_output(
    emu: DaytonaEmulatorThread, procs: ProcessWatch
) -> None:
    arg = procs.sleep_arg()
    started = time.monotonic()
    r = naive_exec(emu, f"echo partial; sleep {arg} & sleep {arg}; echo never", timeout=1)
    assert time.monotonic() - started < 15
    assert r.status_code == 408
    body = r.json()
    assert body["code"] == "REQUEST_TIMEOUT" and body["statusCode"] == 408
    assert set(body) == {"statusCode", "message", "code", "timestamp", "path", "method"}
    assert "partial" not in r.text
    assert procs.wait_gone(arg) == []


def test_the_command_goes_on_when_the_client_leaves(
    emu: DaytonaEmulatorThread, procs: ProcessWatch
) -> None:
    """The daemon runs commands on a background context: a disconnect kills nothing."""
    arg = procs.sleep_arg(3)
    with client(emu) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/sb/process/execute", json={"command": f"sleep {arg}"}, timeout=0.5)
    assert procs.wait_present(arg)


def test_auth_unknown_sandbox_and_bad_requests(emu: DaytonaEmulatorThread) -> None:
    with client(emu, token="wrong") as c:
        r = c.post("/sb/process/execute", json={"command": "true"})
        assert r.status_code == 401
        assert r.json()["statusCode"] == 401
    with httpx.Client(base_url=emu.url) as c:
        assert c.post("/sb/process/execute", json={"command": "true"}).status_code == 401
    with client(emu) as c:
        assert c.post("/nope/process/execute", json={"command": "true"}).status_code == 404
        r = c.post("/sb/process/execute", json={"timeout": 1})
        assert (r.status_code, r.content) == (400, b"")  # AbortWithError: empty body


def test_downloads_serve_raw_bytes_and_ranges(emu: DaytonaEmulatorThread, tmp_path: Path) -> None:
    data = os.urandom(100_000)
    f = tmp_path / "blob"
    f.write_bytes(data)
    with client(emu) as c:
        whole = c.get("/sb/files/download", params={"path": str(f)})
        assert whole.status_code == 200 and whole.content == data
        assert whole.headers["content-type"] == "application/octet-stream"
        part = c.get(
            "/sb/files/download", params={"path": str(f)}, headers={"Range": "bytes=10-19"}
        )
        assert part.status_code == 206 and part.content == data[10:20]
        assert part.headers["content-range"] == "bytes 10-19/100000"
        past = c.get(
            "/sb/files/download", params={"path": str(f)}, headers={"Range": "bytes=100000-"}
        )
        assert past.status_code == 416
        for path, status in ((str(tmp_path / "missing"), 404), (str(tmp_path), 400), ("", 400)):
            r = c.get("/sb/files/download", params={"path": path})
            assert (r.status_code, r.content) == (status, b"")
    emu.set_faults(DaytonaFaults(range_support=False))
    with client(emu) as c:
        r = c.get("/sb/files/download", params={"path": str(f)}, headers={"Range": "bytes=0-9"})
        assert r.status_code == 200 and r.content == data


# -- each fault, at probability 1 -----------------------------------------------------------


def test_each_exec_fault_fires_as_configured(emu: DaytonaEmulatorThread) -> None:
    text = "x" * 10_000
    emu.set_faults(DaytonaFaults(truncate_result=1.0))
    r = naive_exec(emu, f"printf {text}").json()
    assert r["exitCode"] == 0 and len(r["result"]) < 10_000 and text.startswith(r["result"])
    emu.set_faults(DaytonaFaults(minus_one=1.0, seed=1))
    assert naive_exec(emu, "echo hi").json()["exitCode"] == -1
    emu.set_faults(DaytonaFaults(bad_gateway=1.0))
    assert naive_exec(emu, "true").status_code == 502
    emu.set_faults(DaytonaFaults(early_timeout=1.0))
    assert naive_exec(emu, "sleep 5", timeout=30).status_code == 408
    emu.set_faults(DaytonaFaults(late_partial=1.0, late_delay=0.5))
    started = time.monotonic()
    r = naive_exec(emu, f"printf {text}").json()
    assert time.monotonic() - started >= 0.5 and text.startswith(r["result"])
    emu.set_faults(DaytonaFaults(result_cap=100))
    assert naive_exec(emu, f"printf {text}").json() == {"exitCode": 0, "result": "x" * 100}
    for kind in ("truncated_result", "minus_one", "bad_gateway", "early_timeout", "late_partial"):
        assert emu.stats[kind] > 0, kind


def test_short_downloads_cut_or_declare_less(emu: DaytonaEmulatorThread, tmp_path: Path) -> None:
    data = os.urandom(50_000)
    f = tmp_path / "blob"
    f.write_bytes(data)
    emu.set_faults(DaytonaFaults(short_download=1.0, seed=3))
    seen = set()
    for _ in range(12):
        with client(emu) as c:
            try:
                r = c.get("/sb/files/download", params={"path": str(f)})
            except httpx.RemoteProtocolError:
                seen.add("cut")  # fewer bytes than Content-Length, then the close
                continue
            assert len(r.content) < len(data) and data.startswith(r.content)
            seen.add("short")
    assert seen == {"cut", "short"}


# -- the field report, reproduced --------------------------------------------------------------


def test_naive_client_corrupts_binary_and_loses_the_tail_but_wsync_pull_is_exact(
    emu: DaytonaEmulatorThread, tmp_path: Path
) -> None:
    ws = emu.create_sandbox("report") / "work"
    ws.mkdir()
    binary = os.urandom(64 * 1024)
    (ws / "model.bin").write_bytes(binary)
    log = b"".join(b"line %07d of the agent's log\n" % i for i in range(300_000))  # ~9 MiB
    (ws / "agent.log").write_bytes(log)
    emu.set_faults(DaytonaFaults.report_table())

    with client(emu) as c:
        answer = c.post(
            "/report/process/execute", json={"command": f"cat {shlex.quote(str(ws / 'model.bin'))}"}
        ).json()
        got = answer["result"].encode()
        assert answer["exitCode"] == 0
        assert got != binary and "\ufffd" in answer["result"]  # lossy UTF-8

        answer = c.post(
            "/report/process/execute", json={"command": f"cat {shlex.quote(str(ws / 'agent.log'))}"}
        ).json()
        got = answer["result"].encode()
        assert answer["exitCode"] == 0
        assert len(got) == 6 * MiB and log.startswith(got)  # the tail is gone, exit 0

    dest = tmp_path / "out"
    asyncio.run(pull_uri(f"daytona://report{ws}", dest, options(tmp_path), emu.transport_options()))
    assert_exact(ws, dest)
    assert (dest / "model.bin").read_bytes() == binary


def test_a_child_holding_the_pipe_delays_the_answer_by_the_hang_timeout(
    tmp_path: Path, procs: ProcessWatch
) -> None:
    """The daemon's drain quirk: the shell is gone, a child keeps the pipe; the answer
    comes after ``hang_timeout`` with what was buffered."""
    arg = procs.sleep_arg()
    with DaytonaEmulatorThread(tmp_path / "emu", hang_timeout=1.0) as emulator:
        emulator.create_sandbox("sb")
        started = time.monotonic()
        r = naive_exec(emulator, f"echo before; sleep {arg} &")
        elapsed = time.monotonic() - started
        assert r.json() == {"exitCode": 0, "result": "before\n"}
        assert 1.0 <= elapsed < 20
        assert emulator.stats["pipes_abandoned"] == 1
