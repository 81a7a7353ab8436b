"""``wsync pull cloudflare://ID/PATH`` through the engine, against the faulty Bridge emulator.

The invariant everywhere: an exact tree, or a clear :class:`WsyncError` with DEST
untouched — never a wrong tree.  Plus the seed report reproduced with a naive
client, ``wsync doctor`` showing the loss, and the CLI's wrong-token exit 3.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_exact, make_tree, options
from wsync.emulators.cloudflare import CloudflareFaults, EmulatorThread
from wsync.engine.api import Progress, PullOptions, PullResult
from wsync.engine.pull import pull_uri
from wsync.errors import WsyncError
from wsync.transports.cloudflare import CloudflareTransport
from wsync.transports.registry import open_transport
from wsync.treediff import snapshot

KiB = 1024
MiB = 1024 * KiB
FAULT_STATS = ("early_exit", "zero_exit", "no_exit", "severed", "http_503", "error_event")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorThread]:
    with EmulatorThread(tmp_path_factory.mktemp("cloudflare")) as emu:
        yield emu


def workspace(emu: EmulatorThread, sandbox: str) -> Path:
    ws = emu.create_sandbox(sandbox) / "work"
    ws.mkdir()
    return ws


def pull(emu: EmulatorThread, sandbox: str, ws: Path, dest: Path, opts: PullOptions) -> PullResult:
    uri = f"cloudflare://{sandbox}{ws}"
    return asyncio.run(pull_uri(uri, dest, opts, emu.transport_options()))


def faults_fired(emu: EmulatorThread) -> int:
    return sum(emu.stats[k] for k in FAULT_STATS)


def test_small_workspace_is_exact_with_every_fault_on(
    emulator: EmulatorThread, tmp_path: Path
) -> None:
    ws = make_tree(workspace(emulator, "small") / "t", big=300 * KiB, small=20)
    emulator.set_faults(CloudflareFaults.all_on(seed=21))
    before = faults_fired(emulator)
    dest = tmp_path / "out"
    result = pull(emulator, "small", ws, dest, options(tmp_path, chunk_size=128 * KiB))
    assert result.ok
    assert_exact(ws, dest)
    assert faults_fired(emulator) > before  # the faults really happened on the wire


def test_multi_mb_workspace_is_exact_with_every_fault_on(
    emulator: EmulatorThread, tmp_path: Path
) -> None:
    ws = make_tree(workspace(emulator, "big") / "t", big=4 * MiB, small=40)
    (ws / "more-random.bin").write_bytes(os.urandom(2 * MiB))
    emulator.set_faults(CloudflareFaults.all_on(seed=22))
    dest = tmp_path / "out"
    result = pull(emulator, "big", ws, dest, options(tmp_path, chunk_size=1 * MiB, parallel=4))
    assert_exact(ws, dest)
    assert result.chunks >= 3


@pytest.mark.slow
def test_fifty_mb_workspace_is_exact_with_every_fault_on(
    emulator: EmulatorThread, tmp_path: Path
) -> None:
    """~50 MB on disk (random + zeros + a hard link), every fault on, hangs included: a
    hang is abandoned at a deadline learnt from the calls so far, not the call timeout."""
    ws = make_tree(workspace(emulator, "fifty") / "t", big=16 * MiB, small=40)
    (ws / "random-2.bin").write_bytes(os.urandom(16 * MiB))
    # hangs at 5x their all_on rate: at 1 % the pull's few dozen execs often meet none
    emulator.set_faults(dataclasses.replace(CloudflareFaults.all_on(seed=23), hang=0.05))
    before = emulator.stats["hangs"]
    dest = tmp_path / "out"
    # a hang on a call run once a pull (the admission) has no learnt deadline: it waits out
    # the call deadline, so keep that at 10 s (a 4 MiB read here takes under a second)
    pull(emulator, "fifty", ws, dest, options(tmp_path, parallel=4, call_timeout=10.0))
    assert_exact(ws, dest)
    assert emulator.stats["hangs"] > before  # the hangs really happened


def test_empty_workspace_is_an_empty_dest(emulator: EmulatorThread, tmp_path: Path) -> None:
    ws = workspace(emulator, "empty")
    emulator.set_faults(CloudflareFaults.all_on(seed=24))
    dest = tmp_path / "out"
    pull(emulator, "empty", ws, dest, options(tmp_path))
    assert dest.is_dir() and list(dest.iterdir()) == []


def test_naive_client_loses_output_behind_a_made_up_exit_zero(
    emulator: EmulatorThread, tmp_path: Path
) -> None:
    """The seed report (#873): a long command's stream "completes" with exit 0 mid-output
    while the process still runs; its later output is lost.  wsync's pull through the
    same faults is exact: its reads are short, and a cut one fails its envelope."""
    ws = workspace(emulator, "report")
    data = os.urandom(1 * MiB)
    (ws / "f1024").write_bytes(data)
    emulator.set_faults(CloudflareFaults.seed_report(after=0.5))
    # an agent CLI: minutes of JSONL, here 40 turns over ~2 s
    agent = 'i=0; while [ $i -lt 40 ]; do echo "{\\"turn\\": $i}"; i=$((i+1)); sleep 0.05; done'
    script = f'{agent}; touch "$1"'
    marker = ws / "agent.finished"

    async def naive() -> tuple[bytes, int | None]:
        _, transport = open_transport(f"cloudflare://report{ws}", emulator.transport_options())
        assert isinstance(transport, CloudflareTransport)
        async with transport:
            result = await transport.exec(["sh", "-c", script, "sh", str(marker)], timeout=30)
            return result.stdout, result.exit_status

    received, status = asyncio.run(naive())
    assert status == 0  # "complete, exitCode 0"
    turns = received.decode().splitlines()
    assert 0 < len(turns) < 40  # the stream ended mid-run
    assert not marker.exists()  # ... while the process was still running
    for _ in range(100):
        if marker.exists():
            break
        time.sleep(0.1)
    assert marker.exists()  # it finished later, its output streamed into a void
    assert emulator.stats["early_exit"] >= 1

    dest = tmp_path / "out"
    pull(emulator, "report", ws, dest, options(tmp_path, chunk_size=256 * KiB))
    assert (dest / "f1024").read_bytes() == data
    assert_exact(ws, dest)


def test_a_bridge_that_always_cuts_fails_clearly_and_leaves_dest(
    emulator: EmulatorThread, tmp_path: Path
) -> None:
    ws = make_tree(workspace(emulator, "mute") / "t", big=10 * KiB, small=2)
    emulator.set_faults(CloudflareFaults(early_exit=1.0, max_fault_bytes=0))
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "previous").write_text("the old tree\n")
    before = snapshot(dest)
    opts = options(tmp_path, max_attempts=3, force=True, call_timeout=10)
    with pytest.raises(WsyncError):
        pull(emulator, "mute", ws, dest, opts)
    assert snapshot(dest) == before


@pytest.fixture(scope="module")
def prop_workspace(emulator: EmulatorThread) -> Path:
    return make_tree(workspace(emulator, "prop") / "t", big=100 * KiB, small=8)


def test_a_cleanup_that_hangs_ends_by_the_overall_deadline(
    emulator: EmulatorThread, tmp_path: Path
) -> None:
    """DEST is swapped and only the guest staging's removal is left when every stream
    starts to hang (#101, #320): the pull still returns by ``--timeout`` (its cleanup
    given up, a warning that says why), not two call deadlines after it."""
    ws = make_tree(workspace(emulator, "hung-cleanup") / "t", big=2 * MiB, small=5)
    emulator.set_faults(CloudflareFaults.off())

    def hang_from_cleanup(progress: Progress) -> None:
        if progress.phase == "cleanup":
            emulator.set_faults(CloudflareFaults(hang=1.0))

    timeout = 10.0
    opts = options(tmp_path, chunk_size=256 * KiB, timeout=timeout, call_timeout=30.0)
    dest = tmp_path / "out"
    started = time.monotonic()
    uri = f"cloudflare://hung-cleanup{ws}"
    result = asyncio.run(
        pull_uri(uri, dest, opts, emulator.transport_options(), on_progress=hang_from_cleanup)
    )
    elapsed = time.monotonic() - started
    emulator.set_faults(CloudflareFaults.off())
    assert result.ok
    assert_exact(ws, dest)
    # (generous for a loaded machine: the cleanup's old bound, two call deadlines past
    # the overall one, took about 60 s here)
    assert elapsed < timeout + 20.0, elapsed
    (warning,) = [w for w in result.warnings if "staging not removed" in w]
    assert "gave up after" in warning, warning  # (a bare TimeoutError said nothing)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**16),
    early=st.floats(0.0, 0.5),
    zero=st.floats(0.0, 1.0),
    lines=st.floats(0.0, 1.0),
    drop=st.floats(0.0, 1.0),
    tail=st.floats(0.0, 0.4),
    unavailable=st.floats(0.0, 0.5),
    sever=st.floats(0.0, 0.4),
    no_exit=st.floats(0.0, 1.0),
    split=st.floats(0.0, 1.0),
)
def test_random_fault_schedules_never_produce_a_wrong_tree(
    tmp_path_factory: pytest.TempPathFactory,
    emulator: EmulatorThread,
    prop_workspace: Path,
    seed: int,
    early: float,
    zero: float,
    lines: float,
    drop: float,
    tail: float,
    unavailable: float,
    sever: float,
    no_exit: float,
    split: float,
) -> None:
    emulator.set_faults(
        CloudflareFaults(
            seed=seed,
            early_exit=early,
            zero_exit=zero,
            line_mode=lines,
            drop_long_lines=drop,
            lose_tail=tail,
            unavailable=unavailable,
            sever=sever,
            no_exit=no_exit,
            error_event=0.05,
            split=split,
            max_fault_bytes=64 * KiB,
        )
    )
    tmp = tmp_path_factory.mktemp("prop")
    dest = tmp / "out"
    dest.mkdir()
    (dest / "previous").write_text("the old tree\n")
    before = snapshot(dest)
    opts = options(tmp, chunk_size=64 * KiB, max_attempts=6, force=True, timeout=120)
    try:
        pull(emulator, "prop", prop_workspace, dest, opts)
    except WsyncError:
        assert snapshot(dest) == before  # untouched
    else:
        assert_exact(prop_workspace, dest)
    shutil.rmtree(tmp, ignore_errors=True)


def wsync_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    env.pop("CLOUDFLARE_SANDBOX_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "wsync", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )


def test_cli_wrong_token_exits_3_with_one_clear_line(
    emulator: EmulatorThread, tmp_path: Path
) -> None:
    ws = workspace(emulator, "cli")
    emulator.set_faults(CloudflareFaults.off())
    token = tmp_path / "token"
    token.write_text("not-the-token\n")
    dest = tmp_path / "out"
    proc = wsync_cli(
        "pull",
        f"cloudflare://cli{ws}",
        str(dest),
        "--cloudflare-url",
        emulator.url,
        "--cloudflare-token-file",
        str(token),
        "--state-dir",
        str(tmp_path / "state"),
    )
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "authentication failed" in lines[0], proc.stderr
    assert "not-the-token" not in proc.stderr + proc.stdout
    assert not dest.exists()


def test_doctor_shows_the_loss_and_reads_exactly(emulator: EmulatorThread, tmp_path: Path) -> None:
    ws = workspace(emulator, "doctor")
    emulator.set_faults(CloudflareFaults.seed_report(after=2.0))
    token = tmp_path / "token"
    token.write_text(emulator.token)
    proc = wsync_cli(
        "doctor",
        f"cloudflare://doctor{ws}",
        "--cloudflare-url",
        emulator.url,
        "--cloudflare-token-file",
        str(token),
        "--staging-dir",
        str(ws.parent / "doctor-stage"),
        "--json",
    )
    report = json.loads(proc.stdout)
    assert report["lossy"]
    rows = {row["size"] // KiB: row for row in report["rows"]}
    # random bytes through a text channel: every invalid byte became U+FFFD (3 bytes),
    # so each size arrives longer than it is and not intact, under a trusted exit 0
    assert not any(row["intact"] for row in rows.values())
    assert all(row["exit"] == 0 and row["received"] > row["size"] for row in rows.values())
    assert all(row["verified"] == "intact" for row in rows.values())
