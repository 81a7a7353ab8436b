"""The ``wsync`` command as a user meets it: help, exit codes, JSON, kill -9 and resume."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import assert_exact, make_tree
from wsync.errors import EXIT_CODES

REQUIRED_JSON = {
    "ok",
    "snapshot",
    "files",
    "bytes",
    "transferred_bytes",
    "chunks",
    "resumed_chunks",
    "retries",
    "elapsed_s",
}


def wsync(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wsync", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_explains_and_lists_exit_codes() -> None:
    proc = wsync("pull", "--help")
    assert proc.returncode == 0
    for text in ("SANDBOX", "DEST", "--json", "--parallel", "ssh://", "exit codes"):
        assert text in proc.stdout
    for code in EXIT_CODES:
        assert f"{code:>3}" in proc.stdout
    assert wsync().returncode == 2


def test_json_result_has_the_documented_fields(tmp_path: Path) -> None:
    ws = make_tree(tmp_path / "ws", big=100_000)
    proc = wsync(
        "pull",
        f"local:{ws}",
        str(tmp_path / "out"),
        "--json",
        "--state-dir",
        str(tmp_path / "state"),
        "--staging-dir",
        str(tmp_path / "stage"),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result.keys() >= REQUIRED_JSON
    assert result["ok"] is True and result["files"] > 60
    assert_exact(ws, tmp_path / "out")


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["pull", "", "out"], 2, "empty"),
        (["pull", "nonsense", "out"], 2, "not a sandbox URI"),
        (["pull", "ftp://host/x", "out"], 2, "unknown sandbox scheme"),
        (["pull", "ssh://host", "out"], 2, "missing workspace path"),
        (["pull", "local:/x\udcff", "out"], 2, "not valid UTF-8"),
        (["pull", "ssh://host/w%ff", "out"], 2, "not valid UTF-8"),
        (["pull", "local:/definitely/not/here", "out"], 2, "does not exist"),
        (["pull", "ssh://127.0.0.1:1/work", "out"], 3, ""),
        (["pull", "local:/tmp", "out", "--parallel", "0"], 2, "at least 1"),
        (["pull", "local:/tmp", "out", "--chunk-size", "lots"], 2, "not a size"),
        # found by a red team: tracebacks (OverflowError, ValueError), a limit of 0 bytes
        # that failed every pull with exit 7, a --parallel that ran the host out of memory
        (["pull", "local:/tmp", "out", "--chunk-size", "inf"], 2, "not a finite size"),
        (["pull", "local:/tmp", "out", "--max-bytes", "1e400"], 2, "not a finite size"),
        (["pull", "local:/tmp", "out", "--max-bytes", "0.5"], 2, "at least 1 byte"),
        # (an option that takes 0 never says "at least 1 byte")
        (["pull", "local:/tmp", "out", "--min-free", "-5"], 2, "'-5' (0: none"),
        (["pull", "local:/tmp", "out", "--parallel", "65"], 2, "at most 64"),
        (["pull", "ssh://[::1/work", "out"], 2, "Invalid IPv6 URL"),
        # found by a new user: the path was checked before the scheme ("missing host"),
        # and every scheme's hint said "host"
        (["pull", "file:///tmp/x", "out"], 2, "unknown sandbox scheme 'file'"),
        (["pull", "foo://x", "out"], 2, "unknown sandbox scheme 'foo'"),
        (["pull", "docker://c", "out"], 2, "e.g. docker://CONTAINER/work"),
        # found by a new user: an abbreviation was the option it began (--fo: --force)
        (["pull", "local:/tmp", "out", "--fo"], 2, "unrecognized arguments: --fo"),
        (["pull", "local:/tmp", "out", "--ful"], 2, "unrecognized arguments: --ful"),
    ],
)
def test_bad_input_is_one_clear_line_and_a_documented_code(
    tmp_path: Path, args: list[str], code: int, message: str
) -> None:
    args = [a if a != "out" else str(tmp_path / "out") for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "wsync", *args, "--state-dir", str(tmp_path / "s")],
        capture_output=True,
        timeout=120,
    )
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == code, stderr
    assert message in stderr
    assert "Traceback" not in stderr
    assert stderr.count("\n") == 1, stderr  # one line (a usage error had the usage before)
    assert not (tmp_path / "out").exists()


def test_json_on_failure_carries_error_and_exit_code(tmp_path: Path) -> None:
    proc = wsync(
        "pull",
        "local:/definitely/not/here",
        str(tmp_path / "out"),
        "--json",
        "--state-dir",
        str(tmp_path / "s"),
    )
    assert proc.returncode == 2
    result = json.loads(proc.stdout)
    assert result["ok"] is False and result["exit_code"] == 2 and result["error"]


def _chunks_on_disk(state: Path) -> int:
    """Journaled chunks (``SEQ.HASH``), not the temp file of a write in flight."""
    return sum(
        1
        for d in (state / "pulls").glob("*")
        for p in d.glob("chunks/*")
        if re.fullmatch(r"\d{8}\.[0-9a-f]+", p.name)
    )


def pull_argv(ws: Path, dest: Path, state: Path, stage: Path, chunk: str) -> list[str]:
    """A slow, one-read-at-a-time ``wsync pull --json``: easy to interrupt midway."""
    return [
        sys.executable, "-m", "wsync", "pull", f"local:{ws}", str(dest), "--json",
        "--state-dir", str(state), "--staging-dir", str(stage),
        "--chunk-size", chunk, "--parallel", "1",
    ]  # fmt: skip


def wait_for_chunks(proc: subprocess.Popen[Any], state: Path, n: int) -> None:
    """Until ``n`` chunks are journaled, the pull ends, or a generous deadline."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (state / "pulls").exists() and _chunks_on_disk(state) >= n:
            return
        time.sleep(0.005)


def killed_after(tmp_path: Path, blobs: list[bytes], chunks: int) -> tuple[Path, list[str], int]:
    """A slow pull of a workspace of ``blobs`` into ``tmp_path/out``, killed (-9) once
    ``chunks`` chunks are journaled; returns the workspace, the command, the chunks left."""
    ws = tmp_path / "ws"
    ws.mkdir()
    for i, blob in enumerate(blobs):
        (ws / f"blob{i}").write_bytes(blob)
    state = tmp_path / "state"
    args = pull_argv(ws, tmp_path / "out", state, tmp_path / "stage", "256K")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_chunks(proc, state, chunks)
    proc.kill()
    proc.communicate()
    return ws, args, _chunks_on_disk(state)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_9_at_a_random_point_then_resume(tmp_path: Path, seed: int) -> None:
    """kill -9 costs at most the reads in flight; the rerun never refetches a chunk."""
    rng = random.Random(seed)
    blobs = [rng.randbytes(3 * 1024 * 1024) for _ in range(6)]
    dest = tmp_path / "out"
    ws, args, killed_with = killed_after(tmp_path, blobs, rng.randrange(1, 40))
    assert not dest.exists()

    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)
    assert_exact(ws, dest)
    assert result["resumed_chunks"] == killed_with >= 1
    assert result["chunks"] > result["resumed_chunks"]


def test_sigterm_exits_130_and_the_next_run_resumes(tmp_path: Path) -> None:
    rng = random.Random(7)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "blob").write_bytes(rng.randbytes(12 * 1024 * 1024))
    dest, state = tmp_path / "out", tmp_path / "state"
    args = pull_argv(ws, dest, state, tmp_path / "stage", "128K")
    # a grace long enough for a loaded machine: this test is about the orderly
    # stop (JSON result, partial tree removed), not the cut at the grace period
    env = {**os.environ, "WSYNC_STOP_GRACE": "60"}
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    wait_for_chunks(proc, state, 5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert json.loads(out)["error_kind"] == "interrupted"
    assert not dest.exists()
    assert not any(p.name.startswith(".out.wsync-tmp") for p in tmp_path.iterdir())
    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["resumed_chunks"] >= 5
    assert_exact(ws, dest)


# docker and e2b have their own demo tests (test_docker_pull.py, test_e2b_pull.py)
@pytest.mark.parametrize("backend", ["local", "sprites", "k8s", "daytona", "cloudflare"])
def test_demo_shows_naive_corruption_and_an_exact_pull(tmp_path: Path, backend: str) -> None:
    proc = wsync("demo", "--backend", backend, "--dir", str(tmp_path / "demo"), "--json")
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    assert outcome["naive"]["exact"] is False
    assert outcome["wsync"]["exact"] is True
    assert os.path.isdir(outcome["wsync"]["dest"])


def test_relative_local_paths_are_pinned_to_the_current_directory(tmp_path: Path) -> None:
    make_tree(tmp_path / "ws", big=1000)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wsync",
            "pull",
            "local:ws",
            "out",
            "--json",
            "--state-dir",
            "state",
            "--staging-dir",
            str(tmp_path / "stage"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sandbox"] == f"local:{tmp_path / 'ws'}"
    assert_exact(tmp_path / "ws", tmp_path / "out")


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--call-timeout", "0", "must be more than 0"),  # was: internal error (exit 1)
        ("--timeout", "nan", "not a finite number"),  # was: "deadline of nans passed" (6)
        ("--call-timeout", "nan", "not a finite number"),  # was: taken silently
        ("--timeout", "1e400", "not a finite number"),
        ("--call-timeout", "inf", "not a finite number"),
    ],
)
def test_timeouts_that_are_not_finite_or_zero_are_usage_errors(
    tmp_path: Path, flag: str, value: str, says: str
) -> None:
    ws = make_tree(tmp_path / "ws", big=1024, small=2)
    done = wsync("pull", f"local:{ws}", str(tmp_path / "d"), flag, value)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    "args",
    [["--exclude", "["], ["--exclude-from", "/nonexistent/x"], ["--chunk-size", "100K"]],
    ids=["pattern", "exclude-from", "chunk-size"],
)
def test_json_has_its_object_for_every_usage_error(tmp_path: Path, args: list[str]) -> None:
    """These were checked before the JSON reporter was set up: stdout stayed empty."""
    ws = make_tree(tmp_path / "ws", big=1024, small=2)
    done = wsync("pull", f"local:{ws}", str(tmp_path / "d"), "--json", *args)
    assert done.returncode == 2, done.stderr
    result = json.loads(done.stdout)
    assert result["ok"] is False and result["exit_code"] == 2
    assert result["error_kind"] == "usage" and args[0] in result["error"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--parallel", "0"], "--parallel"),
        (["--timeout", "nan"], "--timeout"),
        (["--max-bytes", "0"], "--max-bytes"),
        (["--compress-level", "99"], "--compress-level"),
        (["--no-such-option"], "--no-such-option"),
        (["extra"], "extra"),
    ],
    ids=["parallel", "timeout", "max-bytes", "compress-level", "unknown-option", "extra"],
)
def test_json_has_its_object_for_a_usage_error_of_the_parser(
    tmp_path: Path, args: list[str], says: str
) -> None:
    """A value the parser refuses was a usage error with nothing on stdout, where a
    chunk size that is no multiple of 64K (checked after the parser) gave the JSON
    object: a script reading the result of ``--max-bytes "$LIMIT"`` got no JSON."""
    ws = make_tree(tmp_path / "ws", big=1024, small=2)
    done = wsync("pull", f"local:{ws}", str(tmp_path / "d"), "--json", *args)
    assert done.returncode == 2, done.stderr
    result = json.loads(done.stdout)
    assert result["ok"] is False and result["exit_code"] == 2
    assert result["error_kind"] == "usage" and says in result["error"]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # the line, as before
    assert says in done.stderr and not (tmp_path / "d").exists()


def test_a_usage_error_without_json_prints_nothing_on_stdout(tmp_path: Path) -> None:
    done = wsync("pull", "local:/x", str(tmp_path / "d"), "--parallel", "0")
    assert done.returncode == 2 and done.stdout == "", done.stdout
    done = wsync("doctor", "local:/x", "--json", "--bogus")
    assert done.returncode == 2 and done.stdout == "", done.stdout


def test_json_of_a_failed_pull_counts_what_it_did(tmp_path: Path) -> None:
    """A pull that gives up: its retries and faults are what an operator needs, and the
    result said 0 and {} (it was built afresh from the error)."""
    ws = make_tree(tmp_path / "ws", big=1024, small=2)
    done = wsync(
        "pull", f"local:{ws}", str(tmp_path / "d"), "--json", "--retries", "3",
        "--chaos", "all=1.0,seed=3", "--state-dir", str(tmp_path / "st"),
    )  # fmt: skip
    assert done.returncode == 6, done.stderr
    result = json.loads(done.stdout)
    assert result["ok"] is False and result["retries"] == 3
    assert sum(result["faults"].values()) == 3 and result["execs"] >= 1
    assert result["transferred_bytes"] > 0


def test_a_journaled_chunk_damaged_on_disk_is_fetched_again_not_called_hostile(
    tmp_path: Path,
) -> None:
    """A red team flipped one byte of a journaled chunk between a kill -9 and the rerun:
    the decompressor called the stream undecodable, the pull ended "archive refused"
    (exit 7) and threw away the guest's snapshot and every journaled chunk.  The rerun
    now checks its journaled chunks against their hashes and fetches a damaged one again."""
    rng = random.Random(11)
    blobs = [rng.randbytes(2 * 1024 * 1024) for _ in range(4)]
    dest, state = tmp_path / "out", tmp_path / "state"
    ws, args, killed_with = killed_after(tmp_path, blobs, 6)
    assert killed_with >= 6 and not dest.exists()
    damaged = sorted(p for p in state.glob("pulls/*/chunks/*") if "." in p.name)[1]
    data = bytearray(damaged.read_bytes())
    data[1000] ^= 0xFF
    damaged.write_bytes(bytes(data))

    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert_exact(ws, dest)
    assert json.loads(again.stdout)["resumed_chunks"] == killed_with - 1


def test_min_free_is_a_host_condition_that_keeps_the_journal(tmp_path: Path) -> None:
    """Free space below the reserve is the host's condition, on DEST's filesystem or the
    state directory's alike (a red team saw exit 7 "archive refused" for one, exit 8 for
    the other): exit 8 naming ``--min-free``, DEST untouched, and the same command with
    room made (here: the reserve lowered) finishes; ``--min-free`` was the daemon's only."""
    ws = tmp_path / "ws"
    make_tree(ws, seed=5)
    dest, state = tmp_path / "out", tmp_path / "state"
    base = [f"local:{ws}", str(dest), "--json", "--state-dir", str(state)]
    starved = wsync("pull", *base, "--min-free", "1000000G")
    assert starved.returncode == 8, starved.stderr
    assert "--min-free" in json.loads(starved.stdout)["error"]
    assert not dest.exists()
    done = wsync("pull", *base, "--min-free", "0M")
    assert done.returncode == 0, done.stderr
    assert_exact(ws, dest)


@pytest.mark.parametrize("relative", ["dest", "sandbox", "state-dir"])
def test_a_relative_path_from_a_removed_current_directory_is_a_usage_error(
    tmp_path: Path, relative: str
) -> None:
    """A red team ran wsync from a directory removed meanwhile: "internal error:
    FileNotFoundError" (exit 1) for a relative DEST (getcwd fails); now exit 2, saying so."""
    ws = tmp_path / "ws"
    make_tree(ws, seed=3)
    gone = tmp_path / "gone"
    gone.mkdir()
    sandbox = "local:ws" if relative == "sandbox" else f"local:{ws}"
    dest = "out" if relative == "dest" else str(tmp_path / "out")
    state = "state" if relative == "state-dir" else str(tmp_path / "state")
    script = 'cd "$1" && rmdir "$1" && shift && exec "$@"'
    argv = ["bash", "-c", script, "bash", str(gone), sys.executable, "-m", "wsync"]
    argv += ["pull", sandbox, dest, "--state-dir", state]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "current directory no longer exists" in done.stderr
    assert "internal error" not in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("home", ["/nonexistent-wsync-home", ""])
def test_no_usable_home_for_the_default_state_dir_is_a_usage_error(
    tmp_path: Path, home: str | None
) -> None:
    """Run as root with HOME=/nonexistent (a service account), a red team saw wsync
    create /nonexistent/.local/state/wsync, and with HOME= /.local/state/wsync."""
    ws = tmp_path / "ws"
    make_tree(ws, seed=4)
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_STATE_HOME")}
    env["HOME"] = home
    argv = [sys.executable, "-m", "wsync", "pull", f"local:{ws}", str(tmp_path / "out")]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "--state-dir" in done.stderr and "internal error" not in done.stderr
    assert not Path("/nonexistent-wsync-home").exists()
    env["XDG_STATE_HOME"] = str(tmp_path / "xdg")  # the other way to name it
    assert subprocess.run(argv, env=env, timeout=300).returncode == 0
    assert_exact(ws, tmp_path / "out")


def test_a_low_open_file_limit_still_records_the_state(tmp_path: Path) -> None:
    """At ``ulimit -n 48`` DEST's scan kept 64 directory fds open: every pull's state
    commit failed ("Too many open files", a warning) and every pull was a full one."""
    import resource

    ws = tmp_path / "ws"
    for d in range(40):
        for s in range(3):
            (ws / f"d{d}" / f"s{s}").mkdir(parents=True)
            (ws / f"d{d}" / f"s{s}" / "f").write_text(f"{d} {s}\n")
    args = [
        sys.executable, "-m", "wsync", "pull", f"local:{ws}", str(tmp_path / "out"), "--json",
        "--state-dir", str(tmp_path / "state"), "--staging-dir", str(tmp_path / "stage"),
    ]  # fmt: skip

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    results = []
    for _ in range(2):
        done = subprocess.run(args, capture_output=True, text=True, timeout=300, preexec_fn=low)
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout))
    assert results[0]["warnings"] == [] and results[1]["mode"] == "incremental"
    assert results[1]["changed_files"] == 0
    assert_exact(ws, tmp_path / "out")


def test_out_of_file_descriptors_is_the_hosts_limit_not_a_transport_fault() -> None:
    """Starting a guest command with no descriptor left was retried twelve times and
    ended "integrity not established" (exit 6), the cause shown only with -v."""
    import errno

    from wsync.errors import HostOutOfFiles, TransportError
    from wsync.transports.local import _cannot_start

    full = _cannot_start("sh", OSError(errno.EMFILE, "Too many open files"))
    assert isinstance(full, HostOutOfFiles) and full.exit_code == 8
    assert "ulimit -n" in str(full)
    assert isinstance(_cannot_start("sh", OSError(errno.EAGAIN, "again")), TransportError)


def test_a_full_sqlite_temporary_directory_is_named_in_the_warning(tmp_path: Path) -> None:
    """SQLite keeps the diff's scratch tables in its temporary directory ($TMPDIR): full,
    the state was not recorded and the warning blamed the state file in --state-dir,
    whose filesystem had room."""
    ws = tmp_path / "ws"
    (ws / "s").mkdir(parents=True)
    for i in range(500):
        (ws / "s" / f"f{i}").write_text(f"{i}\n")
    tiny = tmp_path / "tmp"
    tiny.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with contextlib.suppress(OSError):
            (tiny / "fill").write_bytes(b"\0" * 1024 * 1024)  # as full as it gets
        base = ["pull", f"local:{ws}", str(tmp_path / "out"), "--json"]
        base += ["--state-dir", str(tmp_path / "state")]
        assert wsync(*base).returncode == 0
        (ws / "s" / "f1").write_text("changed\n")
        env = {**os.environ, "TMPDIR": str(tiny)}
        argv = [sys.executable, "-m", "wsync", *base]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    finally:
        subprocess.run(["umount", "-l", str(tiny)], check=False)
    assert done.returncode == 0, done.stderr
    (warning,) = json.loads(done.stdout)["warnings"]
    assert f"SQLite's temporary directory, {tiny}, is full" in warning
    assert_exact(ws, tmp_path / "out")


@pytest.mark.parametrize(
    "args",
    [["status", "--wai"], ["jobs", "--stat", "running"], ["daemon", "--conf", "x.toml"]],
)
def test_the_daemon_commands_take_no_abbreviations_either(args: list[str]) -> None:
    """``wsync status --wai`` was ``--wait``, ``wsync daemon --conf`` ``--config``: as in
    ``wsync pull``, a mistyped option is an error, in one line (found by a review)."""
    proc = wsync(*args)
    assert proc.returncode == 2, proc.stderr
    assert "unrecognized arguments" in proc.stderr and proc.stderr.count("\n") == 1
