"""``wsync pull daytona://ID/PATH`` through the engine and the CLI, against the lossy emulator.

The invariant everywhere: exact tree, or a clear :class:`WsyncError` with DEST untouched.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_exact, make_tree, options
from wsync.emulators.daytona import DaytonaEmulatorThread, DaytonaFaults
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.pull import pull_uri
from wsync.errors import IntegrityFailed, WsyncError
from wsync.treediff import snapshot

KiB = 1024
MiB = 1024 * KiB
FAULT_STATS = ("truncated_result", "bad_gateway", "early_timeout", "minus_one", "late_partial")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaytonaEmulatorThread]:
    with DaytonaEmulatorThread(tmp_path_factory.mktemp("daytona")) as emu:
        yield emu


def sandbox_workspace(emu: DaytonaEmulatorThread, sandbox: str) -> Path:
    ws = emu.create_sandbox(sandbox) / "work"
    ws.mkdir()
    return ws


def pull_sandbox(
    emu: DaytonaEmulatorThread, sandbox: str, ws: Path, dest: Path, opts: PullOptions
) -> PullResult:
    return asyncio.run(pull_uri(f"daytona://{sandbox}{ws}", dest, opts, emu.transport_options()))


def fired(emu: DaytonaEmulatorThread) -> int:
    return sum(emu.stats[k] for k in FAULT_STATS)


def test_empty_workspace_is_an_empty_dest(emulator: DaytonaEmulatorThread, tmp_path: Path) -> None:
    ws = sandbox_workspace(emulator, "empty")
    emulator.set_faults(DaytonaFaults.all_on(seed=1))
    dest = tmp_path / "out"
    pull_sandbox(emulator, "empty", ws, dest, options(tmp_path))
    assert dest.is_dir() and list(dest.iterdir()) == []


def test_multi_mb_workspace_is_exact_with_every_fault_on(
    emulator: DaytonaEmulatorThread, tmp_path: Path
) -> None:
    ws = make_tree(sandbox_workspace(emulator, "mb") / "t", big=3 * MiB, small=40)
    (ws / "more-random.bin").write_bytes(os.urandom(2 * MiB))
    emulator.set_faults(DaytonaFaults.all_on(seed=2))
    before = fired(emulator)
    dest = tmp_path / "out"
    result = pull_sandbox(
        emulator, "mb", ws, dest, options(tmp_path, chunk_size=512 * KiB, parallel=4)
    )
    assert_exact(ws, dest)
    assert result.chunks >= 3
    assert fired(emulator) > before  # the faults really happened on the wire
    assert result.retries > 0


@pytest.mark.slow
def test_a_50_mb_workspace_is_exact_with_every_fault_on(
    emulator: DaytonaEmulatorThread, tmp_path: Path
) -> None:
    ws = sandbox_workspace(emulator, "big")
    (ws / "random.bin").write_bytes(os.urandom(40 * MiB))
    (ws / "zeros.bin").write_bytes(bytes(10 * MiB))
    make_tree(ws / "t", big=256 * KiB, small=20)
    emulator.set_faults(DaytonaFaults.all_on(seed=3))
    dest = tmp_path / "out"
    result = pull_sandbox(emulator, "big", ws, dest, options(tmp_path, parallel=4))
    assert_exact(ws, dest)
    assert result.chunks >= 10


def test_a_backend_that_always_fails_leaves_dest_untouched(
    emulator: DaytonaEmulatorThread, tmp_path: Path
) -> None:
    ws = make_tree(sandbox_workspace(emulator, "down") / "t", big=10 * KiB, small=2)
    emulator.set_faults(DaytonaFaults(bad_gateway=1.0))
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "previous").write_text("the old tree\n")
    before = snapshot(dest)
    with pytest.raises(IntegrityFailed):
        pull_sandbox(emulator, "down", ws, dest, options(tmp_path, max_attempts=3, force=True))
    assert snapshot(dest) == before


@pytest.fixture(scope="module")
def prop_workspace(emulator: DaytonaEmulatorThread) -> Path:
    return make_tree(sandbox_workspace(emulator, "prop") / "t", big=200 * KiB, small=8)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**16),
    truncate=st.floats(0.0, 0.4),
    early=st.floats(0.0, 0.2),
    gateway=st.floats(0.0, 0.3),
    minus_one=st.floats(0.0, 1.0),
    late=st.floats(0.0, 0.2),
    cap=st.sampled_from([None, 128 * KiB, 1 * MiB]),
)
def test_random_fault_schedules_never_produce_a_wrong_tree(
    tmp_path_factory: pytest.TempPathFactory,
    emulator: DaytonaEmulatorThread,
    prop_workspace: Path,
    seed: int,
    truncate: float,
    early: float,
    gateway: float,
    minus_one: float,
    late: float,
    cap: int | None,
) -> None:
    emulator.set_faults(
        DaytonaFaults(
            seed=seed,
            truncate_result=truncate,
            early_timeout=early,
            early_timeout_max=0.05,
            bad_gateway=gateway,
            minus_one=minus_one,
            late_partial=late,
            late_delay=0.05,
            result_cap=cap,
        )
    )
    tmp = tmp_path_factory.mktemp("prop")
    dest = tmp / "out"
    dest.mkdir()
    (dest / "previous").write_text("the old tree\n")
    before = snapshot(dest)
    opts = options(tmp, chunk_size=64 * KiB, max_attempts=6, force=True, timeout=120)
    try:
        pull_sandbox(emulator, "prop", prop_workspace, dest, opts)
    except WsyncError:
        assert snapshot(dest) == before  # untouched
    else:
        assert_exact(prop_workspace, dest)
    shutil.rmtree(tmp, ignore_errors=True)


# -- the CLI -------------------------------------------------------------------------------------


def wsync(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wsync", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_cli_pulls_with_the_key_from_env_and_a_wrong_key_exits_3_in_one_line(
    emulator: DaytonaEmulatorThread, tmp_path: Path
) -> None:
    ws = make_tree(sandbox_workspace(emulator, "cli") / "t", big=20 * KiB, small=3)
    emulator.set_faults(DaytonaFaults.all_on(seed=4))
    uri = f"daytona://cli{ws}"
    state = ["--state-dir", str(tmp_path / "state"), "--staging-dir", str(tmp_path / "stage")]
    good = {"DAYTONA_API_KEY": emulator.token, "DAYTONA_TOOLBOX_URL": emulator.url}
    ok = wsync("pull", uri, str(tmp_path / "ok"), *state, env=good)
    assert ok.returncode == 0, ok.stderr
    assert_exact(ws, tmp_path / "ok")

    key = tmp_path / "wrong-key"
    key.write_text("not-the-key\n")
    dest = tmp_path / "never"
    bad = wsync(
        "pull",
        uri,
        str(dest),
        "--daytona-url",
        emulator.url,
        "--daytona-token-file",
        str(key),
        *state,
        env={"DAYTONA_API_KEY": ""},
    )
    assert bad.returncode == 3
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1, bad.stderr
    assert "authentication failed" in lines[0] and "DAYTONA_API_KEY" in lines[0]
    assert "not-the-key" not in bad.stderr + bad.stdout
    assert not dest.exists()


def test_doctor_shows_the_loss_against_the_emulator(
    emulator: DaytonaEmulatorThread, tmp_path: Path
) -> None:
    emulator.create_sandbox("doc")
    emulator.set_faults(DaytonaFaults.report_table())
    scratch = tmp_path / "scratch"  # the doctor's workspace; staging must lie outside it
    scratch.mkdir()
    proc = wsync(
        "doctor",
        f"daytona://doc{scratch}",
        "--json",
        "--staging-dir",
        str(tmp_path / "stage"),
        env={"DAYTONA_API_KEY": emulator.token, "DAYTONA_TOOLBOX_URL": emulator.url},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["lossy"]
    rows = {row["size"] // KiB: row for row in report["rows"]}
    # random bytes through a lossy-UTF-8 channel: never intact, yet "exit 0"
    assert all(not r["intact"] and r["exit"] == 0 for r in rows.values())
    assert rows[1024]["received"] > 1 * MiB  # U+FFFD is 3 bytes for each bad one
    assert 6 * MiB - 4 <= rows[4096]["received"] <= 6 * MiB + 16  # the tail cut at the cap
    assert all(r["verified"] == "intact" for r in rows.values())


def test_an_old_daemon_that_drops_empty_words_pulls_exactly(tmp_path: Path) -> None:
    """Daemons before PR #3918 split the command text into words and drop empty ones. An
    empty argument (the default staging root, no listed size) shifted every later one: the
    probe took the next argument's text for the staging root, and every admission failed
    for want of arguments.  No argument is empty now; a first and an incremental pull,
    with the default staging root, are exact."""
    with DaytonaEmulatorThread(tmp_path / "emu", split_command=True) as emu:
        ws = make_tree(sandbox_workspace(emu, "old") / "t", big=256 * KiB, small=20)
        dest = tmp_path / "out"
        opts = options(tmp_path, staging_root="")
        first = pull_sandbox(emu, "old", ws, dest, opts)
        assert first.ok, first.error
        assert_exact(ws, dest)
        (ws / "added.txt").write_text("after the first pull\n")
        again = pull_sandbox(emu, "old", ws, dest, opts)
        # (the file and the directory that holds it)
        assert again.ok and again.mode == "incremental" and again.changed_files == 2, again
        assert_exact(ws, dest)
