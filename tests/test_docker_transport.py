"""``DockerTransport`` against the Engine API emulator, one fault at a time.

The emulator serves a real unix socket (and TCP for ``tcp://``), hijacks the start
connection, runs each exec as a local process, and injects the field faults of
``shared/backends.md`` section 4.5.  What the client must do with each: read frames whose
headers arrive split, accept ``101`` and ``200``, wait for an exit code that is ``null``
after EOF (never 0), stop waiting for an EOF a background child holds, kill what it
abandons (and nothing detached), and map a missing container or daemon to exit 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ProcessWatch
from helpers import busybox_bin
from wsync.emulators.docker import DockerFaults, EmulatorThread
from wsync.errors import AuthFailed, SandboxUnreachable, TransportTimeout, UsageError
from wsync.transports import docker_http
from wsync.transports.base import KILL_MARK, KILL_MARK_TTL, ExecResult
from wsync.transports.docker import (
    EXEC_WRAPPER,
    KILL_SCRIPT,
    SID_VAR,
    TOKEN_VAR,
    DockerTransport,
)
from wsync.transports.docker_protocol import (
    START_BODY,
    ExecCollector,
    exec_create_body,
    parse_docker_host,
    parse_exec_id,
    parse_inspect,
)
from wsync.transports.registry import open_transport

PAYLOAD = bytes(range(256)) * 2000 + os.urandom(300_000)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorThread]:
    with EmulatorThread(tmp_path_factory.mktemp("docker"), tcp=True) as emu:
        emu.create_container("box")
        emu.create_container("MixedCase_1.x")
        yield emu


def run(
    uri: str, argv: list[str], options: dict[str, Any], stdin: bytes | None = None, timeout=30.0
) -> ExecResult:
    async def main() -> ExecResult:
        _, transport = open_transport(uri, options)
        try:
            return await transport.exec(argv, stdin=stdin, timeout=timeout)
        finally:
            await transport.aclose()

    return asyncio.run(main())


def test_split_headers_and_200_answers_give_the_exact_bytes(daemon: EmulatorThread) -> None:
    daemon.set_faults(DockerFaults(split_frames=1.0, answer_200=1.0))
    before = daemon.stats["split_frames"], daemon.stats["answered_200"]
    result = run("docker://box/w", ["cat"], daemon.transport_options(), stdin=PAYLOAD)
    assert result.stdout == PAYLOAD
    assert result.exit_status == 0
    assert "start answered 200 (no upgrade)" in result.notes
    mixed = run(
        "docker://box/w", ["sh", "-c", "echo o; echo e >&2; exit 4"], daemon.transport_options()
    )
    assert (mixed.stdout, mixed.stderr, mixed.exit_status) == (b"o\n", b"e\n", 4)
    assert daemon.stats["split_frames"] > before[0]
    assert daemon.stats["answered_200"] > before[1]


def test_an_exit_code_null_after_eof_is_waited_for_never_read_as_zero(
    daemon: EmulatorThread,
) -> None:
    daemon.set_faults(DockerFaults(exit_null=1.0, exit_null_max=0.8))
    before = daemon.stats["inspect_null_after_exit"]
    result = run("docker://box/w", ["sh", "-c", "exit 9"], daemon.transport_options())
    assert result.exit_status == 9
    failing = run("docker://box/w", ["false"], daemon.transport_options())
    assert failing.exit_status == 1
    # the client really met the null and asked again
    assert daemon.stats["inspect_null_after_exit"] > before
    # still null when the client stops waiting: no exit status, never 0
    daemon.set_faults(DockerFaults(seed=1, exit_null=1.0, exit_null_max=60.0))
    options = {**daemon.transport_options(), "docker_exit_wait": 0.3}
    unknown = run("docker://box/w", ["true"], options)
    assert unknown.exit_status is None
    assert any("still null" in note for note in unknown.notes)


def test_a_dropped_final_frame_looks_complete_to_the_transport(daemon: EmulatorThread) -> None:
    """The loss only the engine's envelopes can see: EOF, exit 0, bytes missing."""
    daemon.set_faults(DockerFaults(drop_final=1.0))
    result = run("docker://box/w", ["cat"], daemon.transport_options(), stdin=PAYLOAD)
    assert result.exit_status == 0
    assert len(result.stdout) < len(PAYLOAD)
    assert PAYLOAD.startswith(result.stdout)


def test_a_held_eof_ends_after_the_exit_plus_linger(daemon: EmulatorThread) -> None:
    daemon.set_faults(DockerFaults(hold_eof=1.0, hold_seconds=25.0))
    started = time.monotonic()
    result = run("docker://box/w", ["sh", "-c", "echo done; exit 5"], daemon.transport_options())
    assert time.monotonic() - started < 15.0
    assert (result.stdout, result.exit_status) == (b"done\n", 5)
    assert any("EOF held open" in note for note in result.notes)


def test_a_background_child_holding_stdout_is_not_waited_for_and_is_killed(
    daemon: EmulatorThread, procs: ProcessWatch
) -> None:
    daemon.set_faults(DockerFaults.off())
    arg = procs.sleep_arg()
    started = time.monotonic()
    result = run(
        "docker://box/w", ["sh", "-c", f"sleep {arg} & echo hi"], daemon.transport_options()
    )
    assert time.monotonic() - started < 20.0
    assert (result.stdout, result.exit_status) == (b"hi\n", 0)
    assert procs.wait_gone(arg) == []


def test_deadline_kills_the_session_but_not_a_detached_child(
    daemon: EmulatorThread, procs: ProcessWatch
) -> None:
    daemon.set_faults(DockerFaults.off())
    detached, attached = procs.sleep_arg(), procs.sleep_arg()
    script = f"setsid sleep {detached} </dev/null >/dev/null 2>&1 & sleep {attached}"
    with pytest.raises(TransportTimeout):
        run("docker://box/w", ["sh", "-c", script], daemon.transport_options(), timeout=2.0)
    assert procs.wait_gone(attached) == []
    assert procs.wait_present(detached)


def test_a_command_cancelled_before_its_process_started_never_runs(
    tmp_path: Path, procs: ProcessWatch
) -> None:
    """The daemon answered the start but spawns the process seconds later; the cancel
    lands in between, so the kill exec runs first and finds nothing to signal.  The
    command must still not run (it would hold the sandbox until someone kills it)."""
    arg = procs.sleep_arg()
    with EmulatorThread(tmp_path, faults=DockerFaults(start_delay=3.0)) as emu:
        emu.create_container("box")
        options = emu.transport_options()

        async def main() -> None:
            _, transport = open_transport("docker://box/w", options)
            task = asyncio.create_task(transport.exec(["sleep", arg], timeout=60))
            for _ in range(1500):  # 30 s
                if any(entry.started for entry in emu.emulator.execs.values()):
                    break
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await transport.aclose()  # waits for the kill exec

        asyncio.run(main())
        deadline = time.monotonic() + 30
        while emu.stats["slow_starts"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert emu.stats["slow_starts"] == 1, "the delayed start never came"
        left = procs.wait_gone(arg)
        procs.kill_all()  # a failure must not leave the emulator a live process to stop
    assert left == []


def test_missing_stopped_and_unreachable_are_exit_3(daemon: EmulatorThread, tmp_path: Path) -> None:
    daemon.set_faults(DockerFaults.off())
    with pytest.raises(SandboxUnreachable, match="no such container") as info:
        run("docker://ghost/w", ["true"], daemon.transport_options())
    assert info.value.exit_code == 3
    daemon.create_container("halted")
    daemon.stop_container("halted")
    with pytest.raises(SandboxUnreachable, match="not running"):
        run("docker://halted/w", ["true"], daemon.transport_options())
    nowhere = {"docker_host": f"unix://{tmp_path}/no.sock"}
    with pytest.raises(SandboxUnreachable, match="cannot connect to the docker daemon"):
        run("docker://box/w", ["true"], nowhere)
    if os.geteuid() != 0:
        sock = tmp_path / "locked.sock"
        import socket

        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(sock))
        sock.chmod(0)
        try:
            with pytest.raises(AuthFailed, match="docker group"):
                run("docker://box/w", ["true"], {"docker_host": f"unix://{sock}"})
        finally:
            listener.close()


def test_docker_host_from_the_environment_option_and_tcp(
    daemon: EmulatorThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon.set_faults(DockerFaults.off())
    monkeypatch.setenv("DOCKER_HOST", daemon.url)
    assert run("docker://box/w", ["echo", "env"], {}).stdout == b"env\n"
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    # the option beats the environment
    assert run("docker://box/w", ["echo", "opt"], {"docker_host": daemon.url}).stdout == b"opt\n"
    tcp = {"docker_host": daemon.tcp_url}
    assert run("docker://box/w", ["cat"], tcp, stdin=PAYLOAD).stdout == PAYLOAD
    monkeypatch.setenv("DOCKER_TLS_VERIFY", "1")
    with pytest.raises(UsageError, match="TLS"):
        open_transport("docker://box/w", tcp)


def test_uri_forms(daemon: EmulatorThread) -> None:
    options = daemon.transport_options()
    result = run("docker://MixedCase_1.x/w", ["pwd"], options)
    assert result.stdout.decode().strip().endswith("MixedCase_1.x")  # case kept
    _, transport = open_transport("docker://1000@box/w", options)
    assert isinstance(transport, DockerTransport)
    assert transport.user == "1000"
    assert transport.description == "docker://box"
    for bad in ("docker://box:22/w", "docker://-x/w", "docker://a%2Fb/w"):
        with pytest.raises(UsageError):
            open_transport(bad, options)


def test_cli_missing_container_is_exit_3_and_one_line(
    daemon: EmulatorThread, tmp_path: Path
) -> None:
    dest = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wsync",
            "pull",
            f"docker://ghost{tmp_path}",
            str(dest),
            "--docker-host",
            daemon.url,
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "DOCKER_HOST"},
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "no such container" in proc.stderr and "ghost" in proc.stderr
    assert not dest.exists()


@pytest.mark.parametrize("shell", ["dash", "busybox"])
def test_the_kill_script_runs_under_dash_and_busybox(
    shell: str, tmp_path: Path, procs: ProcessWatch
) -> None:
    """The killer is a guest script: a busybox-only container (alpine) must run it too."""
    env = dict(os.environ)
    if shell == "busybox":
        env["PATH"] = str(busybox_bin(tmp_path / "bin"))
    sh = [shutil.which("busybox") or "busybox", "sh"] if shell == "busybox" else ["dash"]
    inside, detached, other = procs.sleep_arg(), procs.sleep_arg(), procs.sleep_arg()
    script = f"setsid sleep {detached} </dev/null >/dev/null 2>&1 & sleep {inside}"
    victim = subprocess.Popen(
        [*sh, *EXEC_WRAPPER[1:], "sh", "-c", script],
        env={**env, TOKEN_VAR: "tok1"},
        start_new_session=True,
    )
    bystander = subprocess.Popen(
        ["sleep", other], env={**env, TOKEN_VAR: "tok2"}, start_new_session=True
    )
    try:
        assert procs.wait_present(inside) and procs.wait_present(detached)
        environ = Path(f"/proc/{victim.pid}/environ").read_bytes()
        assert f"{SID_VAR}={victim.pid}".encode() in environ.split(b"\0")
        killer = subprocess.run(
            [*sh, "-c", KILL_SCRIPT, "sh", "tok1"], env=env, capture_output=True, timeout=60
        )
        assert killer.returncode == 0, killer.stderr
        assert procs.wait_gone(inside) == []
        assert procs.pids(detached), "a child in its own session is left alone"
        assert procs.pids(other), "another exec's processes are left alone"
    finally:
        victim.kill()
        bystander.kill()
        victim.wait()
        bystander.wait()


@pytest.mark.parametrize("shell", ["dash", "busybox"])
def test_a_kill_marker_stops_a_command_that_starts_after_the_kill(
    shell: str, tmp_path: Path, procs: ProcessWatch
) -> None:
    """The killer ran first (``mark``): the wrapper that starts afterwards runs nothing and
    removes the marker; a killer that does kill something removes it too."""
    env = dict(os.environ)
    if shell == "busybox":
        env["PATH"] = str(busybox_bin(tmp_path / "bin"))
    sh = [shutil.which("busybox") or "busybox", "sh"] if shell == "busybox" else ["dash"]
    token = secrets.token_hex(16)
    marker = Path(KILL_MARK + token)
    arg = procs.sleep_arg()
    try:
        kill = [*sh, "-c", KILL_SCRIPT, "sh", token, "mark"]
        assert subprocess.run(kill, env=env, timeout=60).returncode == 0
        assert marker.is_dir()
        late = subprocess.run(
            [*sh, *EXEC_WRAPPER[1:], "sleep", arg], env={**env, TOKEN_VAR: token}, timeout=60
        )
        assert late.returncode == 137
        assert not marker.exists()
        # killed while running: the marker made by the killer goes with the command
        victim = subprocess.Popen(
            [*sh, *EXEC_WRAPPER[1:], "sleep", arg],
            env={**env, TOKEN_VAR: token},
            start_new_session=True,
        )
        assert procs.wait_present(arg)
        assert subprocess.run(kill, env=env, timeout=60).returncode == 0
        assert victim.wait(timeout=30) == -9
        assert not marker.exists()
    finally:
        with contextlib.suppress(OSError):
            marker.rmdir()


@pytest.mark.parametrize("shell", ["dash", "busybox"])
def test_a_killer_sweeps_this_users_stale_kill_markers(shell: str, tmp_path: Path) -> None:
    """A kill whose command had already ended leaves its marker; a later kill removes the
    markers older than the TTL, and only real directories of this user."""
    env = dict(os.environ)
    if shell == "busybox":
        env["PATH"] = str(busybox_bin(tmp_path / "bin"))
    sh = [shutil.which("busybox") or "busybox", "sh"] if shell == "busybox" else ["dash"]
    stale, fresh, linked = (Path(KILL_MARK + secrets.token_hex(16)) for _ in range(3))
    old = time.time() - (KILL_MARK_TTL + 5) * 60
    stale.mkdir()
    fresh.mkdir()
    (tmp_path / "target").mkdir()
    linked.symlink_to(tmp_path / "target")
    os.utime(stale, (old, old))
    os.utime(linked, (old, old), follow_symlinks=False)
    try:
        kill = [*sh, "-c", KILL_SCRIPT, "sh", secrets.token_hex(16)]
        assert subprocess.run(kill, env=env, timeout=60).returncode == 0
        assert not stale.exists()
        assert fresh.is_dir()
        assert linked.is_symlink()
    finally:
        for path in (stale, fresh):
            with contextlib.suppress(OSError):
                path.rmdir()
        linked.unlink(missing_ok=True)


def test_emulator_start_failure_in_the_stream_and_a_second_start(daemon: EmulatorThread) -> None:
    """moby's hand-written answers: a start failure is stdout text and exit 127 from
    inspect; an exec started twice is 409; every path takes a /v1.NN prefix."""
    daemon.set_faults(DockerFaults.off())
    endpoint = parse_docker_host(daemon.url)

    async def main() -> None:
        body = exec_create_body(["/no/such/binary"], stdin=False)
        created = await docker_http.request(endpoint, "POST", "/v1.47/containers/box/exec", body)
        assert created.status == 201
        exec_id = parse_exec_id(created.body)
        started = await docker_http.hijack(endpoint, f"/exec/{exec_id}/start", START_BODY)
        assert isinstance(started, docker_http.Hijacked) and started.status == 101
        collector = ExecCollector(1 << 20)
        collector.feed(started.leftover)
        while data := await started.reader.read(65536):
            collector.feed(data)
        await docker_http.close(started.writer)
        collector.eof()
        assert b"OCI runtime exec failed" in collector.result(None).stdout
        inspect = await docker_http.request(endpoint, "GET", f"/v1.47/exec/{exec_id}/json")
        assert parse_inspect(inspect.body).exit_code == 127
        again = await docker_http.hijack(endpoint, f"/exec/{exec_id}/start", START_BODY)
        assert isinstance(again, docker_http.Answer) and again.status == 409
        empty = await docker_http.request(endpoint, "POST", "/containers/box/exec", b'{"Cmd":[]}')
        assert empty.status == 400

    asyncio.run(main())
