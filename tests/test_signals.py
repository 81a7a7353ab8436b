"""Ctrl-C and SIGTERM against the real ``python -m wsync pull``: 130, soon, resumable.

Every test runs the real command in a subprocess and sends real signals.  The
promises: a signal at any point ends the process with exit 130 (or exit 0 when
the pull had already put an exact DEST in place), never with a traceback; DEST
is untouched by an interrupted pull; the same command then resumes to an exact
tree; a second signal ends a slow wind-down at once; without one the wind-down
is cut at the grace period.  Deadlines are generous and only tell a stop from
a hang: nothing here measures speed.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import assert_exact
from test_cli import pull_argv, wait_for_chunks

#: a stop that takes longer than this is a hang (the wind-down faults below last 120 s)
STOP_DEADLINE = 60.0
SRC = Path(__file__).resolve().parent.parent / "src"


@pytest.fixture(autouse=True)
def _signals_not_ignored() -> Iterator[None]:
    """The pulls here meet signals as a foreground command does.

    A shell without job control starts background jobs with SIGINT ignored;
    children inherit that, and wsync (like Python) then leaves SIGINT ignored
    (see test_an_ignored_sigint_stays_ignored).  A test run started that way
    must not make these tests fail.
    """
    old = signal.getsignal(signal.SIGINT)
    if old == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def make_workspace(root: Path, seed: int, blobs: int) -> Path:
    rng = random.Random(seed)
    for d in range(4):
        sub = root / f"dir{d}"
        sub.mkdir(parents=True)
        for f in range(50):
            (sub / f"f{f}.txt").write_bytes(rng.randbytes(rng.randrange(10, 3000)))
    for i in range(blobs):
        (root / f"blob{i}.bin").write_bytes(rng.randbytes(1024 * 1024 + i))
    (root / "link").symlink_to("blob0.bin")
    return root


def env_with(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "WSYNC_STOP_GRACE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def wait_exit(proc: subprocess.Popen[Any], deadline: float) -> bool:
    """True when ``proc`` exited within ``deadline`` seconds (pidfd: no polling lag)."""
    fd = os.pidfd_open(proc.pid)
    try:
        ready, _, _ = select.select([fd], [], [], deadline)
        return bool(ready)
    finally:
        os.close(fd)


def wait_guarded(proc: subprocess.Popen[Any]) -> None:
    """Until the process has installed wsync's signal policy (it catches SIGTERM).

    Before that the process is not yet running any wsync code: the first few
    milliseconds belong to the interpreter's own start-up (a signal there gets
    Python's default behaviour, which a shell also shows as 130).  The random
    points below are drawn after it, imports and all.
    """
    bit = 1 << (signal.SIGTERM - 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            return
        caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
        if int(caught.split()[1], 16) & bit:
            return
        time.sleep(0.001)


def stop(proc: subprocess.Popen[Any], signum: int) -> tuple[int, str]:
    """Send ``signum``; return (exit code, stderr), failing if the process hangs."""
    proc.send_signal(signum)
    if not wait_exit(proc, STOP_DEADLINE):
        proc.kill()
        proc.communicate()
        pytest.fail(f"no exit {STOP_DEADLINE:.0f}s after {signal.Signals(signum).name}")
    _, err = proc.communicate()
    return proc.returncode, err or ""


def test_random_signals_always_stop_with_130_and_the_command_resumes(tmp_path: Path) -> None:
    """24 signals at random points of a chain of runs of one command.

    Each run resumes what the one before left (so every interruption's journal
    is resumed by the next run), the final run must finish, and DEST must be
    exact whenever a run says 0 and untouched whenever it says 130.
    """
    rng = random.Random(20261201)
    ws = make_workspace(tmp_path / "ws", 1, blobs=3)
    dest, state = tmp_path / "out", tmp_path / "state"
    args = pull_argv(ws, dest, state, tmp_path / "stage", "128K")
    started = time.monotonic()
    clean = subprocess.run(
        pull_argv(ws, tmp_path / "probe", tmp_path / "s0", tmp_path / "stage0", "128K"),
        capture_output=True,
        text=True,
        env=env_with(),
        timeout=300,
    )
    span = time.monotonic() - started
    assert clean.returncode == 0, clean.stderr
    codes: list[int] = []
    for trial in range(24):
        signum = signal.SIGTERM if trial % 4 == 3 else signal.SIGINT
        before = dest.exists()
        proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env_with()
        )
        wait_guarded(proc)
        time.sleep(rng.uniform(0, span))
        if proc.poll() is not None:  # finished first: a plain successful pull
            assert proc.returncode == 0, proc.communicate()[1]
            proc.communicate()
            assert_exact(ws, dest)
            continue
        code, err = stop(proc, signum)
        codes.append(code)
        assert "Traceback" not in err, err
        assert code in (0, 130), (code, err, trial)
        if code == 0 or before:
            assert_exact(ws, dest)  # swapped in (exit 0), or a complete DEST left untouched
        else:
            assert not dest.exists(), err
    final = subprocess.run(args, capture_output=True, text=True, env=env_with(), timeout=300)
    assert final.returncode == 0, final.stderr
    assert_exact(ws, dest)
    assert codes.count(130) >= len(codes) // 2, codes  # the signals did land mid-pull


def _import_hook(directory: Path, marker: Path) -> Path:
    """A ``sitecustomize`` that makes importing :mod:`wsync.cli` take minutes.

    It stands for slow start-up imports (a cold disk, a loaded machine): the
    test signals the process while it is importing, deterministically.
    """
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(
        "import sys, time\n"
        "class SlowCli:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'wsync.cli':\n"
        f"            open({str(marker)!r}, 'w').close()\n"
        "            time.sleep(120)\n"
        "        return None\n"
        "sys.meta_path.insert(0, SlowCli())\n"
    )
    return directory


def _stopped_at_start(
    tmp_path: Path,
    hook: Path,
    marker: Path,
    signum: int,
    *,
    seed: int,
    pause: float = 0.0,
    script: Path | None = None,
) -> None:
    """A pull (``python -m wsync``, or the console ``script``) with ``hook`` on its path,
    sent ``signum`` once the hook wrote ``marker`` (and ``pause`` later): it exits 130
    with one line and no traceback, and writes neither DEST nor its state."""
    env = env_with()
    env["PYTHONPATH"] = os.pathsep.join([str(hook), env["PYTHONPATH"]])
    ws = make_workspace(tmp_path / "ws", seed, blobs=1)
    dest = tmp_path / "out"
    args = pull_argv(ws, dest, tmp_path / "state", tmp_path / "stage", "128K")
    if script is not None:
        assert args[1:3] == ["-m", "wsync"]
        args = [sys.executable, str(script), *args[3:]]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert marker.exists(), proc.communicate()[1]
    time.sleep(pause)
    code, err = stop(proc, signum)
    assert code == 130, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not dest.exists() and not (tmp_path / "state").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_start_up_imports_is_one_line_and_130(tmp_path: Path, signum: int) -> None:
    marker = tmp_path / "importing"
    hook = _import_hook(tmp_path / "hook", marker)
    _stopped_at_start(tmp_path, hook, marker, signum, seed=2)


def _console_script(path: Path) -> Path:
    """The launcher pip writes for the ``wsync`` entry point of pyproject.toml (what
    ``.venv/bin/wsync`` runs): it imports the entry's module before it calls it."""
    with (SRC.parent / "pyproject.toml").open("rb") as f:
        entry = tomllib.load(f)["project"]["scripts"]["wsync"]
    module, _, func = entry.partition(":")
    path.write_text(
        "import re\n"
        "import sys\n"
        f"from {module} import {func}\n"
        "if __name__ == '__main__':\n"
        "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
        f"    sys.exit({func}())\n"
    )
    return path


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_console_script_starts_is_one_line_and_130(
    tmp_path: Path, signum: int
) -> None:
    """``.venv/bin/wsync`` (the README's command), not ``python -m wsync``: its launcher
    imported :mod:`wsync.cli` before the signal policy was in place, so a Ctrl-C during
    that import was a KeyboardInterrupt traceback and a process killed by SIGINT."""
    marker = tmp_path / "importing"
    hook = _import_hook(tmp_path / "hook", marker)
    script = _console_script(tmp_path / "wsync")
    _stopped_at_start(tmp_path, hook, marker, signum, seed=6, script=script)


def test_the_console_script_pulls(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path / "ws", 7, blobs=1)
    script = _console_script(tmp_path / "wsync")
    args = pull_argv(ws, tmp_path / "out", tmp_path / "state", tmp_path / "stage", "128K")
    done = subprocess.run(
        [sys.executable, str(script), *args[3:]],
        capture_output=True,
        text=True,
        env=env_with(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert_exact(ws, tmp_path / "out")


def _slow_wind_down_pull(tmp_path: Path, **env: str) -> tuple[subprocess.Popen[str], Path]:
    """A pull whose end takes two minutes: its transport's close hangs in a worker
    thread (``--chaos close=120``, as a hung name lookup does), past the first
    signal's handling."""
    ws = make_workspace(tmp_path / "ws", 3, blobs=3)
    state = tmp_path / "state"
    args = pull_argv(ws, tmp_path / "out", state, tmp_path / "stage", "128K")
    errors = tmp_path / "stderr"
    with errors.open("w") as sink:
        proc = subprocess.Popen(
            [*args, "--chaos", "close=120"],
            stdout=subprocess.DEVNULL,
            stderr=sink,
            text=True,
            env=env_with(**env),
        )
    wait_for_chunks(proc, state, 2)
    assert proc.poll() is None, errors.read_text()
    return proc, errors


def test_a_second_signal_stops_at_once_while_the_first_is_handled(tmp_path: Path) -> None:
    # a grace far beyond the deadline: only the second signal can end this in time
    proc, errors = _slow_wind_down_pull(tmp_path, WSYNC_STOP_GRACE="600")
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 30
    while "stopping" not in errors.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # well into the wind-down
    assert proc.poll() is None, errors.read_text()  # the first signal is still being handled
    code, _ = stop(proc, signal.SIGINT)
    err = errors.read_text()
    assert code == 130, err
    assert "Traceback" not in err and "second SIGINT" in err, err
    assert not (tmp_path / "out").exists()
    # the journal an immediate exit leaves is resumable: the same pull completes
    ws = tmp_path / "ws"
    again = subprocess.run(
        pull_argv(ws, tmp_path / "out", tmp_path / "state", tmp_path / "stage", "128K"),
        capture_output=True,
        text=True,
        env=env_with(),
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert_exact(ws, tmp_path / "out")


def test_a_slow_wind_down_is_cut_at_the_grace_period(tmp_path: Path) -> None:
    proc, errors = _slow_wind_down_pull(tmp_path)  # the default grace: two seconds
    code, _ = stop(proc, signal.SIGTERM)
    err = errors.read_text()
    assert code == 130, err
    assert "Traceback" not in err and "stopped at once" in err, err
    assert not (tmp_path / "out").exists()


def test_an_ignored_sigint_stays_ignored(tmp_path: Path) -> None:
    """A command started with SIGINT ignored (a background job of a script) keeps
    it ignored, as Python itself does; SIGTERM still stops it."""
    ws = make_workspace(tmp_path / "ws", 4, blobs=2)
    state = tmp_path / "state"
    args = pull_argv(ws, tmp_path / "out", state, tmp_path / "stage", "128K")
    script = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.executable, sys.argv[1:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env_with(),
    )
    wait_guarded(proc)
    wait_for_chunks(proc, state, 2)
    proc.send_signal(signal.SIGINT)
    wait_for_chunks(proc, state, 6)  # ignored: the pull runs on (or finishes, exit 0)
    if proc.poll() is not None:
        assert proc.returncode == 0, proc.communicate()[1]
        return
    code, err = stop(proc, signal.SIGTERM)
    assert code == 130, err
    assert "Traceback" not in err and "SIGINT" not in err, err


def _slow_watcher_hook(directory: Path, marker: Path) -> Path:
    """A ``sitecustomize`` that makes starting wsync's signal watcher thread take two
    seconds (a loaded machine: a thread's start waits for the new thread to run)."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(
        "import threading, time\n"
        "_start = threading.Thread.start\n"
        "def start(self):\n"
        "    if self.name == 'wsync-signals':\n"
        f"        open({str(marker)!r}, 'w').close()\n"
        "        time.sleep(2)\n"
        "    return _start(self)\n"
        "threading.Thread.start = start\n"
    )
    return directory


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_watcher_starts_is_one_line_and_130(tmp_path: Path, signum: int) -> None:
    """The watcher was started before the handlers were put in place, and a thread's
    start waits for the thread: a Ctrl-C in that wait (seen 0.15 s into a pull on a
    loaded machine) met Python's default handler, a KeyboardInterrupt traceback from
    ``threading.py`` and a process killed by SIGINT (status -2)."""
    marker = tmp_path / "starting"
    hook = _slow_watcher_hook(tmp_path / "hook", marker)
    _stopped_at_start(tmp_path, hook, marker, signum, seed=5, pause=0.2)  # inside the start


def _on_a_terminal(
    args: list[str], signals: list[tuple[bytes, int]], env: dict[str, str]
) -> tuple[int, bytes]:
    """Run ``args`` on a pseudo-terminal (its live status line on), sending each signal
    once its output shows the bytes paired with it; (exit code, everything it wrote)."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.execve(args[0], args, env)  # noqa: S606 - the command under test, no shell
    out = b""
    pending = list(signals)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if pending and pending[0][0] in out:
                os.kill(pid, pending.pop(0)[1])
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: the child is gone
                    break
                if not data:
                    break
                out += data
    finally:
        os.close(fd)
    waited, status = os.waitpid(pid, 0 if time.monotonic() < deadline else os.WNOHANG)
    if waited == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"no exit: {out[-500:]!r}")
    return os.waitstatus_to_exitcode(status), out


HIDE_CURSOR, SHOW_CURSOR = b"\x1b[?25l", b"\x1b[?25h"


@pytest.mark.parametrize("second", [True, False], ids=["second-signal", "grace-cut"])
def test_a_stop_at_once_gives_the_terminal_its_cursor_back(tmp_path: Path, second: bool) -> None:
    """The live status line hides the cursor; the stops that exit at once (a second
    Ctrl-C, a wind-down past its grace) skipped rich's restore, and the shell was left
    with no cursor (until ``tput cnorm`` or ``reset``).  Their line also came glued to the
    end of the status line."""
    ws = make_workspace(tmp_path / "ws", 8, blobs=3)
    state = tmp_path / "state"
    args = pull_argv(ws, tmp_path / "out", state, tmp_path / "stage", "128K")
    args = [a for a in args if a != "--json"] + ["--chaos", "close=120"]
    env = env_with(TERM="xterm", COLUMNS="100")
    env["WSYNC_STOP_GRACE"] = "600" if second else "1"
    plan = [(b"\x1b[1mpull", signal.SIGINT)]  # the live line, in the pull phase
    if second:
        plan.append((b"again stops at once", signal.SIGINT))
    code, out = _on_a_terminal(args, plan, env)
    assert code == 130, out[-500:]
    assert HIDE_CURSOR in out, out[-500:]
    assert out.rfind(SHOW_CURSOR) > out.rfind(HIDE_CURSOR), out[-500:]
    last = out.replace(b"\r\n", b"\n").rsplit(b"\n", 2)[-2]  # the exit's line
    said = b"second SIGINT" if second else b"winding down took more than"
    assert said in last and last.split(b"\r")[-1].lstrip(b"\x1b[2K\x1b[?25h").startswith(
        b"wsync: "
    ), out[-500:]
