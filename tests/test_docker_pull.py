"""``wsync pull docker://CONTAINER/PATH`` through the engine, against the lossy daemon emulator.

The emulator runs in a background thread with its own event loop (as in ``wsync demo``);
each pull runs in the test's ``asyncio.run`` through the registry, exactly as the CLI does.
The invariant everywhere: exact tree, or a clear :class:`WsyncError` with DEST untouched.
The naive client at the end reads the stream the way the Go SDK users of
testcontainers-go#3766 did (EOF is the end, ``ExitCode`` taken as an int, null as 0): on
the same emulator it takes a stream that lost its last frame for a complete success.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from test_daemon_harness import TOKEN, base_config, running
from wsync.emulators.docker import DockerFaults, EmulatorThread
from wsync.engine.api import ProgressCallback, PullOptions, PullResult
from wsync.engine.journal import Journal
from wsync.engine.pull import pull_uri
from wsync.errors import IntegrityFailed, WsyncError
from wsync.transports import docker_http
from wsync.transports.docker_protocol import (
    START_BODY,
    ExecCollector,
    exec_create_body,
    parse_docker_host,
    parse_exec_id,
)
from wsync.treediff import snapshot

KiB = 1024
MiB = 1024 * KiB
FAULTS = ("dropped_final", "exit_null", "held_eof", "split_frames", "answered_200")


@pytest.fixture(scope="module")
def dockerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorThread]:
    with EmulatorThread(tmp_path_factory.mktemp("docker")) as emu:
        yield emu


def workspace(emu: EmulatorThread, container: str) -> Path:
    ws = emu.create_container(container) / "work"
    ws.mkdir()
    return ws


def pull_docker(
    emu: EmulatorThread,
    container: str,
    ws: Path,
    dest: Path,
    opts: PullOptions,
    on_progress: ProgressCallback | None = None,
) -> PullResult:
    uri = f"docker://{container}{ws}"
    return asyncio.run(pull_uri(uri, dest, opts, emu.transport_options(), on_progress=on_progress))


def fired(emu: EmulatorThread) -> int:
    return sum(emu.stats[k] for k in FAULTS)


#: the faults an exec meets and a helper's channel does not (it is never inspected, and
#: its answers are not the output it ends with)
EXEC_FAULTS = ("dropped_final", "exit_null", "held_eof")


@pytest.mark.parametrize("helpers", [True, False], ids=["helpers", "exec-per-call"])
def test_small_workspace_is_exact_with_every_fault_on(
    dockerd: EmulatorThread, tmp_path: Path, helpers: bool
) -> None:
    ws = make_tree(workspace(dockerd, f"small-{helpers}") / "t", big=300 * KiB, small=20)
    faults = DockerFaults.all_on(seed=11)
    if helpers:
        # a pull through helpers is two or three execs: the lost final frame drawn for
        # each of them, so the fault a channel meets surely happens
        faults = dataclasses.replace(faults, drop_final=1.0)
    dockerd.set_faults(faults)
    before = dict(dockerd.stats)
    dest = tmp_path / "out"
    opts = options(tmp_path, chunk_size=128 * KiB, helpers=helpers)
    result = pull_docker(dockerd, f"small-{helpers}", ws, dest, opts)
    assert result.ok
    assert_exact(ws, dest)
    hit = {k: dockerd.stats[k] - before.get(k, 0) for k in (*FAULTS, "released_final")}
    if helpers:
        assert hit["released_final"] > 0, hit  # answers held back as final frames, let go
    else:
        assert sum(hit[k] for k in EXEC_FAULTS) > 0, hit  # the exec path's own faults


@pytest.mark.parametrize("helpers", [True, False], ids=["helpers", "exec-per-call"])
def test_multi_mb_workspace_is_exact_with_every_fault_on(
    dockerd: EmulatorThread, tmp_path: Path, helpers: bool
) -> None:
    ws = make_tree(workspace(dockerd, f"multi-{helpers}") / "t", big=4 * MiB, small=40)
    (ws / "more-random.bin").write_bytes(os.urandom(3 * MiB))
    dockerd.set_faults(DockerFaults.all_on(seed=12))
    dest = tmp_path / "out"
    opts = options(tmp_path, chunk_size=1 * MiB, parallel=4, helpers=helpers)
    result = pull_docker(dockerd, f"multi-{helpers}", ws, dest, opts)
    assert_exact(ws, dest)
    assert result.chunks >= 3


def test_empty_workspace_is_an_empty_dest(dockerd: EmulatorThread, tmp_path: Path) -> None:
    ws = workspace(dockerd, "empty")
    dockerd.set_faults(DockerFaults.all_on(seed=13))
    dest = tmp_path / "out"
    pull_docker(dockerd, "empty", ws, dest, options(tmp_path))
    assert dest.is_dir()
    assert list(dest.iterdir()) == []


@pytest.mark.slow
def test_a_200_mb_workspace_is_exact_with_every_fault_on(
    dockerd: EmulatorThread, tmp_path: Path
) -> None:
    ws = workspace(dockerd, "large")
    with (ws / "model.bin").open("wb") as f:
        for _ in range(16):
            f.write(os.urandom(10 * MiB))
    (ws / "zeros.bin").write_bytes(bytes(40 * MiB))
    (ws / "src").mkdir()
    for i in range(300):
        (ws / "src" / f"f{i}.py").write_text(f"print({i})\n" * 50)
    dockerd.set_faults(DockerFaults.all_on(seed=14))
    dest = tmp_path / "out"
    try:
        result = pull_docker(
            dockerd, "large", ws, dest, options(tmp_path, parallel=4, call_timeout=60)
        )
        assert result.ok
        assert_exact(ws, dest)
    finally:
        shutil.rmtree(ws, ignore_errors=True)


# ------------------------------------------------------------------ the naive client


async def naive_cat(docker_host: str, container: str, path: str) -> tuple[bytes, int]:
    """Create, start, read to EOF, inspect once: ``ExitCode`` null read as 0 (the Go
    SDK's ``int``), the stream's end taken as the output's end."""
    endpoint = parse_docker_host(docker_host)
    body = exec_create_body(["cat", path], stdin=False)
    created = await docker_http.request(endpoint, "POST", f"/containers/{container}/exec", body)
    exec_id = parse_exec_id(created.body)
    started = await docker_http.hijack(endpoint, f"/exec/{exec_id}/start", START_BODY)
    assert isinstance(started, docker_http.Hijacked)
    collector = ExecCollector(1 << 30)
    collector.feed(started.leftover)
    while data := await started.reader.read(65536):
        collector.feed(data)
    await docker_http.close(started.writer)
    inspect = await docker_http.request(endpoint, "GET", f"/exec/{exec_id}/json")
    code = json.loads(inspect.body).get("ExitCode") or 0
    return collector.result(code).stdout, code


def test_naive_client_takes_a_lost_final_frame_for_success_but_wsync_pull_is_exact(
    dockerd: EmulatorThread, tmp_path: Path
) -> None:
    ws = workspace(dockerd, "report")
    data = os.urandom(1 * MiB)
    (ws / "f1024").write_bytes(data)
    dockerd.set_faults(DockerFaults(seed=5, drop_final=1.0, exit_null=1.0))
    received, code = asyncio.run(naive_cat(dockerd.url, "report", str(ws / "f1024")))
    assert code == 0  # what the naive client reports...
    assert len(received) < len(data)  # ...for a stream that lost its last frame
    assert data.startswith(received)
    # a failing command's null exit code is a success to it, too
    dockerd.set_faults(DockerFaults(seed=5, exit_null=1.0))
    _, missing = asyncio.run(naive_cat(dockerd.url, "report", str(ws / "no-such-file")))
    assert missing == 0

    dockerd.set_faults(DockerFaults.all_on(seed=6))
    dest = tmp_path / "out"
    pull_docker(dockerd, "report", ws, dest, options(tmp_path, chunk_size=256 * KiB))
    assert (dest / "f1024").read_bytes() == data


# ------------------------------------------------------- failure leaves DEST alone


def dest_state(dest: Path) -> tuple[dict[str, tuple[object, ...]], dict[str, tuple[int, ...]]]:
    """Content and metadata of DEST and all beneath it: the tree snapshot (kind, mode,
    size, digest, mtime) plus each entry's raw ``lstat`` (inode, mode, size, links,
    mtime_ns), DEST's own included, so a swap, a rewrite in place or a touch all show."""
    raw: dict[str, tuple[int, ...]] = {}
    for entry in [dest, *sorted(dest.rglob("*"))]:
        st = entry.lstat()
        rel = str(entry.relative_to(dest))
        raw[rel] = (st.st_ino, st.st_mode, st.st_size, st.st_nlink, st.st_mtime_ns)
    return snapshot(dest), raw


def old_dest(tmp_path: Path) -> Path:
    """A DEST holding a tree wsync did not write (hence ``force=True`` below)."""
    dest = tmp_path / "out"
    (dest / "sub").mkdir(parents=True)
    (dest / "previous").write_text("the old tree\n")
    (dest / "sub" / "keep.bin").write_bytes(os.urandom(4 * KiB))
    os.utime(dest / "previous", ns=(1_000_000_123, 1_000_000_123))
    return dest


def test_a_daemon_that_always_drops_the_final_frame_fails_clearly_and_leaves_dest(
    dockerd: EmulatorThread, tmp_path: Path
) -> None:
    """Every stream loses its last frame, so no exec call ever verifies: integrity failure
    (exit 6) after the attempt budget, and DEST exactly as it was.  (One exec per call:
    a guest helper's answers are not its last output, see the next test.)"""
    ws = make_tree(workspace(dockerd, "lossy") / "t", big=10 * KiB, small=2)
    dockerd.set_faults(DockerFaults(seed=3, drop_final=1.0))
    before_drops = dockerd.stats["dropped_final"]
    dest = old_dest(tmp_path)
    before = dest_state(dest)
    opts = options(tmp_path, max_attempts=3, force=True, call_timeout=10, helpers=False)
    with pytest.raises(IntegrityFailed) as failed:
        pull_docker(dockerd, "lossy", ws, dest, opts)
    assert failed.value.exit_code == 6
    assert dockerd.stats["dropped_final"] >= before_drops + 3  # every attempt hit the fault
    assert dest_state(dest) == before


def test_guest_helpers_answer_where_every_exec_loses_its_final_frame(
    dockerd: EmulatorThread, tmp_path: Path
) -> None:
    """The same daemon, with guest helpers: each answers many calls over one exec kept
    open, and an answer is not the output a process ends with, so the exit race does not
    take it: the emulator held each answer back and let it go once the helper was seen
    waiting for more.  The pull is exact."""
    ws = make_tree(workspace(dockerd, "lossy-helped") / "t", big=300 * KiB, small=20)
    dockerd.set_faults(DockerFaults(seed=3, drop_final=1.0))
    execs, released = dockerd.stats["execs"], dockerd.stats["released_final"]
    dest = tmp_path / "out"
    result = pull_docker(dockerd, "lossy-helped", ws, dest, options(tmp_path, call_timeout=10))
    assert_exact(ws, dest)
    assert result.retries == 0
    # a helper per call in flight (chunk reads side by side) and no exec call at all
    assert result.execs <= 4, result.execs
    assert dockerd.stats["execs"] - execs <= result.execs
    assert dockerd.stats["released_final"] - released >= 5  # probe, admissions, reads...


def test_a_daemon_that_turns_lossy_mid_pull_fails_clearly_and_leaves_dest(
    dockerd: EmulatorThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault switched on once a chunk has landed in host staging (when the journal
    stores it: progress is reported at most every 0.1 s, and on a fast machine the whole
    pull ran before the first report): the failure comes with a half-extracted tree on
    the host, and DEST is still untouched."""
    ws = workspace(dockerd, "turns")
    (ws / "a.bin").write_bytes(os.urandom(1 * MiB))
    make_tree(ws / "t", big=64 * KiB, small=4)
    dockerd.set_faults(DockerFaults.off())
    dest = old_dest(tmp_path)
    before = dest_state(dest)
    switched_at: list[int] = []
    staged: list[Path] = []
    store = Journal.store

    def storing(self: Journal, seq: int, digest: str, data: bytes) -> Path:
        stored = store(self, seq, digest, data)
        # (the listing's chunks come before the tree beside DEST is made)
        if not switched_at and list(tmp_path.glob(".out.wsync-tmp-*")):
            switched_at.append(seq)
            staged.extend(tmp_path.glob(".out.wsync-tmp-*"))  # the tree that would be DEST
            dockerd.set_faults(DockerFaults(seed=4, drop_final=1.0))
        return stored

    monkeypatch.setattr(Journal, "store", storing)
    opts = options(
        tmp_path, chunk_size=64 * KiB, max_attempts=3, force=True, call_timeout=10, helpers=False
    )
    with pytest.raises(IntegrityFailed) as failed:
        pull_docker(dockerd, "turns", ws, dest, opts)
    assert failed.value.exit_code == 6
    assert switched_at, "the pull never got a chunk through before the fault"
    assert staged, "no tree was being extracted beside DEST when the fault came"
    assert dest_state(dest) == before
    assert not any(p.exists() for p in staged)  # and the half tree is gone


# ------------------------------------------------------------------------ property


@pytest.fixture(scope="module")
def prop_workspace(dockerd: EmulatorThread) -> Path:
    return make_tree(workspace(dockerd, "prop") / "t", big=200 * KiB, small=8)


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**16),
    null=st.floats(0.0, 1.0),
    null_max=st.floats(0.0, 1.0),
    drop=st.floats(0.0, 0.6),
    hold=st.floats(0.0, 0.1),
    split=st.floats(0.0, 1.0),
    plain=st.floats(0.0, 1.0),
    helpers=st.booleans(),
)
def test_random_fault_schedules_never_produce_a_wrong_tree(
    tmp_path_factory: pytest.TempPathFactory,
    dockerd: EmulatorThread,
    prop_workspace: Path,
    seed: int,
    null: float,
    null_max: float,
    drop: float,
    hold: float,
    split: float,
    plain: float,
    helpers: bool,
) -> None:
    dockerd.set_faults(
        DockerFaults(
            seed=seed,
            exit_null=null,
            exit_null_max=null_max,
            drop_final=drop,
            hold_eof=hold,
            hold_seconds=2.0,
            split_frames=split,
            answer_200=plain,
        )
    )
    tmp = tmp_path_factory.mktemp("prop")
    dest = tmp / "out"
    dest.mkdir()
    (dest / "previous").write_text("the old tree\n")
    before = snapshot(dest)
    opts = options(
        tmp, chunk_size=64 * KiB, max_attempts=8, force=True, timeout=120, helpers=helpers
    )
    try:
        pull_docker(dockerd, "prop", prop_workspace, dest, opts)
    except WsyncError:
        assert snapshot(dest) == before  # untouched
    else:
        assert_exact(prop_workspace, dest)
    shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------- doctor, demo and the daemon


def test_doctor_shows_the_loss_and_reads_exactly(dockerd: EmulatorThread, tmp_path: Path) -> None:
    dockerd.create_container("probe")
    dockerd.set_faults(DockerFaults.naive_table())
    scratch = tmp_path / "scratch"  # the doctor's workspace; staging must lie outside it
    scratch.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wsync",
            "doctor",
            f"docker://probe{scratch}",
            "--json",
            "--docker-host",
            dockerd.url,
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
    assert any(not r["intact"] and r["exit"] == 0 for r in report["rows"])
    assert all(r["verified"] == "intact" for r in report["rows"])


def test_demo_backend_docker_shows_naive_corruption_and_an_exact_pull(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wsync",
            "demo",
            "--backend",
            "docker",
            "--json",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    # nothing on stderr: a guest helper still ending when the emulator stopped had made
    # asyncio warn that the loop handling its pid was closed
    assert proc.stderr == ""
    outcome = json.loads(proc.stdout)
    assert outcome["backend"] == "docker"
    assert outcome["naive"]["exact"] is False
    assert outcome["wsync"]["exact"] is True


def test_the_daemon_pulls_a_configured_container_and_a_docker_uri(
    dockerd: EmulatorThread, tmp_path: Path
) -> None:
    """Config ``options.docker_host`` for a named sandbox; ``$DOCKER_HOST`` of the daemon's
    environment for an ad-hoc ``docker://`` URI in ``POST /v1/pulls``."""
    dockerd.set_faults(DockerFaults.all_on(seed=21))
    ws = make_tree(workspace(dockerd, "daemon") / "t", big=64 * KiB, small=5)
    (tmp_path / "roots").mkdir()
    extra = f"""
[sandboxes.ctr]
uri = "docker://daemon{ws}"
dest = "{tmp_path}/roots/ctr"
options = {{ docker_host = "{dockerd.url}" }}
"""
    config = base_config(tmp_path, extra, api="allow_uris = true")
    with running(tmp_path, config, {"DOCKER_HOST": dockerd.url}) as daemon:
        named = daemon.wait_job(daemon.pull("ctr")["id"], timeout=120)
        assert named["state"] == "succeeded", named
        adhoc = daemon.pull(f"docker://daemon{ws}", f"{tmp_path}/roots/adhoc")
        done = daemon.wait_job(adhoc["id"], timeout=120)
        assert done["state"] == "succeeded", done
        status, ghost = daemon.request(
            "POST", "/v1/pulls", {"sandbox": f"docker://ghost{ws}", "dest": f"{tmp_path}/roots/g"}
        )
        assert status == 202, ghost
        failed = daemon.wait_job(ghost["id"], states=("failed",), timeout=120)
        assert failed["exit_code"] == 3
    assert_exact(ws, tmp_path / "roots" / "ctr")
    assert_exact(ws, tmp_path / "roots" / "adhoc")
    assert TOKEN  # the harness's API token was used for every request
