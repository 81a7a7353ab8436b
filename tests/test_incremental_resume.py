"""kill -9 during an incremental pull's manifest, transfer and apply: the same command again
finishes the pull exactly, and a killed transfer resumes its journaled chunks (issue 8)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import assert_exact


def argv(ws: Path, dest: Path, state: Path, stage: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "wsync", "pull", f"local:{ws}", str(dest), "--json",
        "--state-dir", str(state), "--staging-dir", str(stage),
        "--chunk-size", "64K", "--parallel", "1", *extra,
    ]  # fmt: skip


def phase_chunks(state: Path, phase: str) -> int:
    return sum(
        1
        for p in state.glob(f"pulls/*/phase-{phase}/chunks/*")
        if re.fullmatch(r"\d{8}\.[0-9a-f]+", p.name)
    )


def wait_until(proc: subprocess.Popen[Any], ready: Any) -> bool:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            return True
        time.sleep(0.002)
    return False


@pytest.mark.parametrize("phase", ["manifest", "select", "apply"])
def test_kill_9_in_each_phase_then_resume(tmp_path: Path, phase: str) -> None:
    rng = random.Random(phase)
    ws = tmp_path / "ws"
    (ws / "many").mkdir(parents=True)
    for i in range(3000 if phase == "manifest" else 50):
        (ws / "many" / f"file-{i:05d}-{rng.randrange(10**9)}").write_bytes(b"x" * (i % 7))
    for i in range(6):
        (ws / f"blob{i}").write_bytes(rng.randbytes(512 * 1024))
    dest, state, stage = tmp_path / "out", tmp_path / "state", tmp_path / "stage"
    args = argv(ws, dest, state, stage)
    first = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    for i in range(4):
        (ws / f"blob{i}").write_bytes(rng.randbytes(512 * 1024))
    (ws / "many" / "added").write_bytes(b"new\n")

    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if phase == "manifest":
        reached = wait_until(proc, lambda: any(state.glob("pulls/*/phase-manifest/meta.json")))
    elif phase == "select":
        reached = wait_until(proc, lambda: phase_chunks(state, "select") >= 3)
    else:
        reached = wait_until(
            proc, lambda: any(p.name.startswith(".out.wsync-tmp") for p in tmp_path.iterdir())
        )
    proc.kill()
    proc.communicate()
    assert reached, "the pull ended before the phase was reached"
    killed_with = phase_chunks(state, "select")

    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)
    assert_exact(ws, dest)
    assert result["mode"] == "incremental"
    if phase == "select":
        assert result["resumed_chunks"] == killed_with >= 3
    # and the state it committed is right: nothing to do now
    final = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=300).stdout)
    assert final["mode"] == "incremental" and final["changed_files"] == 0
    assert_exact(ws, dest)
