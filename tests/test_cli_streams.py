"""A reader that went away, or a stream closed at the start, never costs a pull.

A red team saw each as "internal error" (exit 1): ``--json | true`` after a pull that
had swapped DEST in; progress into a pipe whose reader exited (the pull aborted); and
``2>&-`` (the first progress line raised, and error lines went into the ``--json``
object on stdout).  See :mod:`wsync.stdstreams`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_exact, make_tree


def argv(tmp_path: Path, dest: Path, *extra: str) -> list[str]:
    ws = tmp_path / "ws"
    if not ws.exists():
        make_tree(ws, seed=7)
    return [
        sys.executable, "-m", "wsync", "pull", f"local:{ws}", str(dest),
        "--state-dir", str(tmp_path / "state"), "--staging-dir", str(tmp_path / "stage"),
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_reader_that_went_away_costs_the_text_not_the_pull(tmp_path: Path, stream: str) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte: every write is EPIPE
    dest = tmp_path / "out"
    extra = ("--json",) if stream == "stdout" else ()
    other = subprocess.DEVNULL
    try:
        done = subprocess.run(
            argv(tmp_path, dest, *extra),
            stdout=write if stream == "stdout" else other,
            stderr=write if stream == "stderr" else other,
            timeout=300,
        )
    finally:
        os.close(write)
    assert done.returncode == 0
    assert_exact(tmp_path / "ws", dest)


def test_stderr_closed_at_the_start(tmp_path: Path) -> None:
    """``2>&-``: the pull runs (progress and all), and with ``--json`` stdout holds the
    result object alone, also for an error, whose line would have gone there."""
    dest = tmp_path / "out"
    close = ["bash", "-c", 'exec 2>&-; exec "$@"', "bash"]
    done = subprocess.run(close + argv(tmp_path, dest), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stdout
    assert done.stdout == b""
    assert_exact(tmp_path / "ws", dest)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep").write_text("mine\n")
    refused = subprocess.run(
        close + argv(tmp_path, theirs, "--json", "-v"), capture_output=True, text=True, timeout=300
    )
    assert refused.returncode == 2
    result = json.loads(refused.stdout)  # one object, nothing after it
    assert result["exit_code"] == 2 and "did not write" in result["error"]
    assert (theirs / "keep").read_text() == "mine\n"
