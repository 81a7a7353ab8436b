"""``wsync pull e2b://ID/PATH`` through the engine, against the lossy envd emulator.

The emulator runs in a background thread with its own event loop (as in ``wsync demo``);
each pull runs in the test's ``asyncio.run`` through the registry, exactly as the CLI does.
The invariant everywhere: exact tree, or a clear :class:`WsyncError` with DEST untouched.
The naive client at the end is the connect-rust#140 reading of a Connect stream (end of
body = success, absent ``exitCode`` = 0): on the same emulator it takes a cut stream for a
complete, successful answer.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_exact, make_tree, options
from wsync.emulators.e2b import E2BFaults, EmulatorThread
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.pull import pull_uri
from wsync.errors import IntegrityFailed, WsyncError
from wsync.transports.e2b_protocol import (
    CONNECT_JSON,
    START_PATH,
    EnvelopeDecoder,
    start_request,
)
from wsync.treediff import snapshot

KiB = 1024
MiB = 1024 * KiB
FAULTS = ("cut_clean", "cut_reset", "dropped_data", "duplicated_data", "login_noise")


@pytest.fixture(scope="module")
def envd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorThread]:
    with EmulatorThread(tmp_path_factory.mktemp("e2b")) as emu:
        yield emu


def workspace(emu: EmulatorThread, sandbox: str) -> Path:
    ws = emu.create_sandbox(sandbox) / "work"
    ws.mkdir()
    return ws


def pull_e2b(
    emu: EmulatorThread, sandbox: str, ws: Path, dest: Path, opts: PullOptions
) -> PullResult:
    return asyncio.run(pull_uri(f"e2b://{sandbox}{ws}", dest, opts, emu.transport_options()))


def fired(emu: EmulatorThread) -> int:
    return sum(emu.stats[k] for k in FAULTS)


@pytest.mark.parametrize("helpers", [True, False], ids=["helpers", "exec-per-call"])
def test_small_workspace_is_exact_with_every_fault_on(
    envd: EmulatorThread, tmp_path: Path, helpers: bool
) -> None:
    ws = make_tree(workspace(envd, f"small-{int(helpers)}") / "t", big=300 * KiB, small=20)
    faults = E2BFaults.all_on(seed=11)
    if helpers:
        # a pull through helpers is a few Start streams: one data event of each doubled,
        # so the fault a helper's stream meets surely happens
        faults = dataclasses.replace(faults, dup_data=1.0)
    envd.set_faults(faults)
    before = dict(envd.stats)
    dest = tmp_path / "out"
    opts = options(tmp_path, chunk_size=128 * KiB, helpers=helpers)
    result = pull_e2b(envd, f"small-{int(helpers)}", ws, dest, opts)
    assert result.ok
    assert_exact(ws, dest)
    hit = {k: envd.stats[k] - before.get(k, 0) for k in (*FAULTS, "execs")}
    assert sum(hit[k] for k in FAULTS) > 0, hit  # the faults really happened on the wire
    if helpers:
        assert hit["duplicated_data"] > 0, hit
        assert hit["execs"] < 10, hit  # one exec per call takes 10 and more


def test_guest_helpers_answer_many_calls_over_one_start_stream(
    envd: EmulatorThread, tmp_path: Path
) -> None:
    """Faults off: the probe, admissions, statuses and cleanups of a pull go through
    helpers (the chunks through /files), so the pull costs a Start per helper, not one per
    call."""
    ws = make_tree(workspace(envd, "helped") / "t", big=300 * KiB, small=20)
    envd.set_faults(E2BFaults.off())
    execs = envd.stats["execs"]
    dest = tmp_path / "out"
    result = pull_e2b(envd, "helped", ws, dest, options(tmp_path, chunk_size=128 * KiB))
    assert_exact(ws, dest)
    assert result.retries == 0
    assert result.execs <= 2, result.execs
    assert envd.stats["execs"] - execs == result.execs


def test_multi_mb_workspace_is_exact_with_every_fault_on(
    envd: EmulatorThread, tmp_path: Path
) -> None:
    ws = make_tree(workspace(envd, "multi") / "t", big=4 * MiB, small=40)
    (ws / "more-random.bin").write_bytes(os.urandom(3 * MiB))
    envd.set_faults(E2BFaults.all_on(seed=12))
    dest = tmp_path / "out"
    result = pull_e2b(envd, "multi", ws, dest, options(tmp_path, chunk_size=1 * MiB, parallel=4))
    assert_exact(ws, dest)
    assert result.chunks >= 3


def test_empty_workspace_is_an_empty_dest(envd: EmulatorThread, tmp_path: Path) -> None:
    ws = workspace(envd, "empty")
    envd.set_faults(E2BFaults.all_on(seed=13))
    dest = tmp_path / "out"
    pull_e2b(envd, "empty", ws, dest, options(tmp_path))
    assert dest.is_dir()
    assert list(dest.iterdir()) == []


@pytest.mark.slow
def test_a_50_mb_workspace_is_exact_with_every_fault_on(
    envd: EmulatorThread, tmp_path: Path
) -> None:
    ws = workspace(envd, "large")
    rng_data = os.urandom(40 * MiB)
    (ws / "model.bin").write_bytes(rng_data)
    (ws / "zeros.bin").write_bytes(bytes(10 * MiB))
    (ws / "src").mkdir()
    for i in range(200):
        (ws / "src" / f"f{i}.py").write_text(f"print({i})\n" * 50)
    envd.set_faults(E2BFaults.all_on(seed=14))
    dest = tmp_path / "out"
    result = pull_e2b(envd, "large", ws, dest, options(tmp_path, parallel=4, call_timeout=60))
    assert result.ok
    assert_exact(ws, dest)


def test_cut_and_short_file_reads_are_continued_and_the_file_api_stays_on(
    envd: EmulatorThread, tmp_path: Path
) -> None:
    """A /files body cut part-way (or answered short) is not a failure of the file API:
    the bytes before the cut are kept and the rest asked for, so exec reads (slower:
    a process per read) never take over the pull."""
    ws = make_tree(workspace(envd, "cuts") / "t", big=1 * MiB, small=4)
    envd.set_faults(E2BFaults(seed=15, file_cut=0.5, file_short=0.3))
    before = envd.stats["file_reads"]
    dest = tmp_path / "out"
    result = pull_e2b(envd, "cuts", ws, dest, options(tmp_path, chunk_size=128 * KiB))
    assert_exact(ws, dest)
    assert result.faults.get("file-api-failed", 0) == 0, result.faults
    assert result.faults["file-api-short"] > 0  # the faults fired and were continued
    assert envd.stats["file_reads"] - before > result.chunks  # the API served to the end


def test_a_backend_that_goes_silent_fails_clearly_and_leaves_dest(
    envd: EmulatorThread, tmp_path: Path
) -> None:
    ws = make_tree(workspace(envd, "mute") / "t", big=10 * KiB, small=2)
    envd.set_faults(E2BFaults(silence=1.0))
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "previous").write_text("the old tree\n")
    before = snapshot(dest)
    opts = options(tmp_path, max_attempts=2, force=True, call_timeout=20)
    with pytest.raises(IntegrityFailed):
        pull_e2b(envd, "mute", ws, dest, opts)
    assert snapshot(dest) == before


# ------------------------------------------------------------------ the naive client


async def naive_cat(url: str, token: str, sandbox: str, path: str) -> tuple[bytes, int]:
    """connect-rust#140's reading: the body's end is success, a missing exitCode is 0."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.post(
            START_PATH,
            content=start_request(["cat", path], stdin=False),
            headers={
                "Content-Type": CONNECT_JSON,
                "X-Access-Token": token,
                "E2b-Sandbox-Id": sandbox,
            },
        )
    out, code = bytearray(), 0
    for envelope in EnvelopeDecoder().feed(response.content):
        event = json.loads(envelope.message).get("event", {})
        if "data" in event:
            out += base64.b64decode(event["data"].get("stdout", ""))
        if "end" in event:
            code = event["end"].get("exitCode", 0)
    return bytes(out), code


def test_naive_client_takes_a_cut_stream_for_success_but_wsync_pull_is_exact(
    envd: EmulatorThread, tmp_path: Path
) -> None:
    ws = workspace(envd, "report")
    data = os.urandom(1 * MiB)
    (ws / "f1024").write_bytes(data)
    envd.set_faults(E2BFaults(seed=5, cut_stream=1.0, cut_reset_share=0.0, cut_max_bytes=900 * KiB))
    token = envd.token
    assert token is not None
    received, code = asyncio.run(naive_cat(envd.url, token, "report", str(ws / "f1024")))
    assert code == 0  # what the naive client reports...
    assert len(received) < len(data)  # ...for a stream that was cut short
    assert data.startswith(received)

    envd.set_faults(E2BFaults.all_on(seed=6))
    dest = tmp_path / "out"
    pull_e2b(envd, "report", ws, dest, options(tmp_path, chunk_size=256 * KiB))
    assert (dest / "f1024").read_bytes() == data


# ------------------------------------------------------------------------ property


@pytest.fixture(scope="module")
def prop_workspace(envd: EmulatorThread) -> Path:
    return make_tree(workspace(envd, "prop") / "t", big=200 * KiB, small=8)


@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**16),
    cut=st.floats(0.0, 0.5),
    reset=st.floats(0.0, 1.0),
    silence=st.floats(0.0, 0.03),
    drop=st.floats(0.0, 0.5),
    dup=st.floats(0.0, 0.5),
    noise=st.floats(0.0, 1.0),
    gateway=st.floats(0.0, 0.3),
    race=st.floats(0.0, 0.3),
)
def test_random_fault_schedules_never_produce_a_wrong_tree(
    tmp_path_factory: pytest.TempPathFactory,
    envd: EmulatorThread,
    prop_workspace: Path,
    seed: int,
    cut: float,
    reset: float,
    silence: float,
    drop: float,
    dup: float,
    noise: float,
    gateway: float,
    race: float,
) -> None:
    envd.set_faults(
        E2BFaults(
            seed=seed,
            cut_stream=cut,
            cut_reset_share=reset,
            cut_max_bytes=64 * KiB,
            silence=silence,
            drop_data=drop,
            dup_data=dup,
            login_noise=noise,
            bad_gateway=gateway,
            deadline_race=race,
        )
    )
    tmp = tmp_path_factory.mktemp("prop")
    dest = tmp / "out"
    dest.mkdir()
    (dest / "previous").write_text("the old tree\n")
    before = snapshot(dest)
    opts = options(tmp, chunk_size=64 * KiB, max_attempts=8, force=True, timeout=120)
    try:
        pull_e2b(envd, "prop", prop_workspace, dest, opts)
    except WsyncError:
        assert snapshot(dest) == before  # untouched
    else:
        assert_exact(prop_workspace, dest)
    shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------- CLI and doctor


def test_cli_wrong_token_is_exit_3_and_one_clear_line(envd: EmulatorThread, tmp_path: Path) -> None:
    ws = workspace(envd, "cli")
    (ws / "a").write_text("a\n")
    envd.set_faults(E2BFaults.off())
    token_file = tmp_path / "token"
    token_file.write_text("not-the-token-42\n")
    dest = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wsync",
            "pull",
            f"e2b://cli{ws}",
            str(dest),
            "--e2b-url",
            envd.url,
            "--e2b-token-file",
            str(token_file),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
    )
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "authentication failed" in lines[0] and "E2B_ACCESS_TOKEN" in lines[0]
    assert "not-the-token-42" not in proc.stderr + proc.stdout
    assert not dest.exists()
    ghost = subprocess.run(
        [
            sys.executable,
            "-m",
            "wsync",
            "pull",
            f"e2b://ghost{ws}",
            str(dest),
            "--e2b-url",
            envd.url,
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
    )
    assert ghost.returncode == 3, ghost.stderr
    assert ghost.stderr.strip().count("\n") == 0
    assert "sandbox not found" in ghost.stderr and "The sandbox was not found" in ghost.stderr
    assert not dest.exists()


def test_doctor_shows_the_loss_and_reads_exactly(envd: EmulatorThread, tmp_path: Path) -> None:
    envd.create_sandbox("probe")
    envd.set_faults(E2BFaults.naive_table())
    token = envd.token
    assert token is not None
    token_file = tmp_path / "token"
    token_file.write_text(token)
    scratch = tmp_path / "scratch"  # the doctor's workspace; staging must lie outside it
    scratch.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wsync",
            "doctor",
            f"e2b://probe{scratch}",
            "--json",
            "--e2b-url",
            envd.url,
            "--e2b-token-file",
            str(token_file),
            "--staging-dir",
            str(tmp_path / "stage"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["lossy"]
    assert any(not r["intact"] for r in report["rows"])
    assert all(r["verified"] == "intact" for r in report["rows"])
    assert token not in proc.stdout


def test_demo_backend_e2b_shows_naive_corruption_and_an_exact_pull(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wsync",
            "demo",
            "--backend",
            "e2b",
            "--json",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    assert outcome["backend"] == "e2b"
    assert outcome["naive"]["exact"] is False
    assert outcome["wsync"]["exact"] is True
