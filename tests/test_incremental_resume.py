"""kill -9 during an incremental pull's manifest, transfer and apply: the same command again
finishes the pull exactly, and a killed transfer resumes its journaled chunks (issue 8)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import assert_exact, options, run_pull
from wsync.engine.api import PullOptions
from wsync.transports.local import LocalTransport


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


@pytest.mark.parametrize("how", ["size", "mtime-put-back", "listing-damaged", "listing-lost"])
def test_resumed_archive_older_than_the_fresh_manifest_is_repaired_next_time(
    tmp_path: Path, how: str
) -> None:
    """A first pull killed in its transfer leaves a finished snapshot in the guest; a file
    edited after that snapshot read it, before the rerun lists the workspace again.  The
    rerun resumes the old snapshot (its chunks are journaled) with the new listing: DEST
    gets the file as the snapshot read it, and the state must not record it as the
    listing's version, or no later pull would ever fetch the edit."""
    rng = random.Random(how)
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(8):
        (ws / f"blob{i}").write_bytes(rng.randbytes(256 * 1024))
    # and a listing too long to come whole with its admission (one that does removes its
    # own staging: tests/test_inline_clean.py), so that the guest still holds it
    (ws / "many").mkdir()
    for i in range(6000):
        (ws / "many" / f"{i}").touch()
    edited = ws / "blob0"
    dest, state, stage = tmp_path / "out", tmp_path / "state", tmp_path / "stage"
    args = argv(ws, dest, state, stage)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reached = wait_until(proc, lambda: len(list(state.glob("pulls/*/chunks/0*"))) >= 3)
    proc.kill()
    proc.communicate()
    assert reached, "the pull ended before its transfer was journaled"
    deadline = time.monotonic() + 120
    while not any(stage.glob("*/done")) and time.monotonic() < deadline:
        time.sleep(0.01)  # the guest's producer finishes the snapshot on its own
    assert any(stage.glob("*/done"))
    before = edited.stat()
    if how == "listing-damaged":  # the journal cannot give the listing back whole
        (listed,) = state.glob("pulls/*/phase-manifest/chunks/00000000.*")
        listed.write_bytes(b"\0" + listed.read_bytes()[1:])
    if how == "listing-lost":  # its record is gone: the guest is asked under its id
        (record,) = state.glob("pulls/*/phase-manifest/done.json")
        record.unlink()
    if how != "mtime-put-back":
        edited.write_bytes(rng.randbytes(300 * 1024))
    else:  # same size, the mtime put back (cp -p, touch -r): only ctime and content move
        edited.write_bytes(rng.randbytes(256 * 1024))
        os.utime(edited, ns=(before.st_atime_ns, before.st_mtime_ns))

    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    # a listing the journal cannot give back is taken afresh, and the snapshot admitted
    # after the old one is not resumed under it.  One whose record alone is lost is still
    # staged in the guest (a first pull leaves it for its last cleanup): the rerun adopts
    # that very listing and resumes the snapshot admitted after it
    resumed = json.loads(again.stdout)["resumed_chunks"]
    fresh = how == "listing-damaged"
    assert resumed == 0 if fresh else resumed >= 3
    if fresh:  # listed and read after the edit: exact at once
        assert_exact(ws, dest)
    final = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    assert_exact(ws, dest)


#: a pull in a process of its own that kills itself (SIGKILL, as ``kill -9``) at the
#: first guest call of a kind once a file exists (with a given text, if one is given);
#: ``local:`` without helpers, so that every guest call is an exec it sees
_KILLED_PULL = r"""
import asyncio, dataclasses, os, shlex, signal, sys
from pathlib import Path
from wsync.engine.api import PullOptions
from wsync.engine.pull import pull
from wsync.protocol import scripts
from wsync.transports.local import LocalTransport

kind, ws, dest, state, staging, ready, text = sys.argv[1:8]
keep_prev = "keep-prev" in sys.argv[8:]
# through guest helpers: killed 20 ms after the call's request went (mid-call)
helpers = "helpers" in sys.argv[8:]
# one exec per call, with the admission that answers the first status (else an
# admission and a status call, as where an exec's argv must stay short and the carried
# admission's URL would not fit: a deep workspace path)
long_argv = "long-argv" in sys.argv[8:]
if not long_argv:
    scripts.URL_ARGV_MAX = 0

def reached():
    found = sorted(Path("/").glob(ready.lstrip("/")))
    return bool(found) and (not text or found[0].read_text() == text)

class Killing(LocalTransport):
    if not helpers:
        capabilities = dataclasses.replace(
            LocalTransport.capabilities, channel=False, long_argv=long_argv
        )

    async def exec(self, argv, **kw):
        if scripts.SCRIPTS[kind] in argv and reached():
            if not long_argv:
                os.kill(os.getpid(), signal.SIGKILL)
            # killed 20 ms into the exec: the admission (and the status it carries) runs
            asyncio.get_running_loop().call_later(0.02, os.kill, os.getpid(), signal.SIGKILL)
        return await super().exec(argv, **kw)

    async def open_channel(self, argv, **kw):
        channel = await super().open_channel(argv, **kw)
        send = channel.send

        async def killing(data):
            await send(data)
            if shlex.quote(scripts.SCRIPTS[kind]).encode() in data and reached():
                loop = asyncio.get_running_loop()
                loop.call_later(0.02, os.kill, os.getpid(), signal.SIGKILL)

        channel.send = killing
        return channel

opts = PullOptions(
    state_dir=Path(state), staging_root=staging, call_timeout=30.0, keep_prev=keep_prev
)
asyncio.run(pull(Killing(), ws, Path(dest), opts))
"""


def _killed(
    tmp_path: Path, ws: Path, dest: Path, kind: str, ready: Path, text: str = "", *extra: str
) -> None:
    """Run :data:`_KILLED_PULL` with :func:`helpers.options`' state and staging."""
    opts = options(tmp_path)
    argv = [sys.executable, "-c", _KILLED_PULL, kind, str(ws), str(dest)]
    argv += [str(opts.state_dir), opts.staging_root, str(ready), text, *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr


def _pulled_then_a_changed(tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    """Files a, b, c pulled once; then a changes in the guest."""
    ws = tmp_path / "ws"
    ws.mkdir()
    for name in "abc":
        (ws / name).write_text(f"{name} one\n")
    dest = tmp_path / "out"
    opts = options(tmp_path)
    run_pull(LocalTransport(), ws, dest, opts)
    (ws / "a").write_text("a two\n")
    return ws, dest, opts


def test_a_pull_killed_after_its_swap_lists_afresh_next_time(tmp_path: Path) -> None:
    """Killed between the swap and the journal's removal (the state is committed, the
    guest staging is being removed), a pull must not leave its listing to be replayed:
    the rerun would find the state it committed and call the workspace unchanged,
    although a file changed since."""
    ws, dest, opts = _pulled_then_a_changed(tmp_path)
    _killed(tmp_path, ws, dest, "cleanup", dest / "a", "a two\n")
    (ws / "b").write_text("b three, longer\n")
    run_pull(LocalTransport(), ws, dest, opts)
    assert_exact(ws, dest)


def _journal_files(tmp_path: Path) -> dict[str, bytes | None]:
    """Every path of the host journals, with a file's bytes (None: a directory)."""
    return {
        str(p.relative_to(tmp_path)): None if p.is_dir() else p.read_bytes()
        for p in sorted((tmp_path / "state/pulls").rglob("*"))
    }


def test_a_dry_run_after_a_killed_pull_previews_the_workspace_as_it_is_now(
    tmp_path: Path,
) -> None:
    """A pull killed in its transfer leaves a listing that a real rerun replays; a dry
    run must not: it shows what a pull would change now.  Nor may it take that pull's
    journal or staging away: a dry run writes nothing, so the real rerun after it still
    finishes the interrupted pull (and a second dry run previews the same)."""
    ws, dest, opts = _pulled_then_a_changed(tmp_path)
    _killed(tmp_path, ws, dest, "status", tmp_path / "state/pulls/*/phase-select/meta.json")
    journal = _journal_files(tmp_path)
    # the killed run's snapshots (its producer may still be at work in them)
    staged = sorted(p.name for p in Path(opts.staging_root).iterdir())
    (ws / "b").write_text("b three, longer\n")
    dry = dataclasses.replace(opts, dry_run=True)
    for _ in range(2):
        preview = run_pull(LocalTransport(), ws, dest, dry)
        assert any(line.endswith(" b") for line in preview.changes), preview.changes
        assert any(line.endswith(" a") for line in preview.changes), preview.changes
        assert not preview.reconciled
        assert _journal_files(tmp_path) == journal
        assert sorted(p.name for p in Path(opts.staging_root).iterdir()) == staged
    again = run_pull(LocalTransport(), ws, dest, opts)
    assert again.ok and again.reconciled, again
    assert (dest / "a").read_text() == "a two\n"
    run_pull(LocalTransport(), ws, dest, opts)
    assert_exact(ws, dest)


def test_a_pull_killed_while_it_reuses_the_kept_tree_finishes_exactly(tmp_path: Path) -> None:
    """Killed in its transfer, after the tree kept by the last pull became its tmp tree:
    the rerun starts from that tree as it was left, and DEST ends exact."""
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    for i in range(30):
        (ws / "sub" / f"f{i}").write_text(f"{i} one\n")
    dest = tmp_path / "out"
    prev = tmp_path / ".out.wsync-prev"
    opts = options(tmp_path, keep_prev=True)
    run_pull(LocalTransport(), ws, dest, opts)
    (ws / "sub" / "f0").write_text("0 two\n")
    run_pull(LocalTransport(), ws, dest, opts)
    kept = os.stat(prev).st_ino
    (ws / "sub" / "f1").write_text("1 three, longer\n")
    (ws / "sub" / "f2").unlink()
    (ws / "new").mkdir()
    (ws / "new" / "n").write_text("n\n")
    ready = tmp_path / "state/pulls/*/phase-select/meta.json"
    _killed(tmp_path, ws, dest, "status", ready, "", "keep-prev")
    assert not prev.exists()
    result = run_pull(LocalTransport(), ws, dest, opts)
    assert result.ok, result.error
    assert_exact(ws, dest)
    assert os.stat(dest).st_ino == kept
    assert os.stat(prev).st_ino != kept


@pytest.mark.parametrize(
    "at", ["manifest", "content-admission", "exec-admission-status", "helper-admission"]
)
def test_a_rerun_that_delivers_the_killed_runs_listing_says_so(tmp_path: Path, at: str) -> None:
    """The rerun of a killed pull finishes that pull: DEST is the workspace as the killed
    run listed it (a change made after the kill comes with the next pull).  Whether the
    listing comes back adopted from the guest (killed in the manifest run) or replayed
    from the journal (killed in the content run's admission, before the guest launched
    it), the result must say so (``reconciled``: the CLI's "finished an interrupted
    pull"), as a fresh one would not; a red team saw 7 of 60 such reruns without it."""
    ws, dest, opts = _pulled_then_a_changed(tmp_path)
    if at == "manifest":  # the manifest producer runs on: the rerun adopts it
        _killed(tmp_path, ws, dest, "status", ws / "a")
    elif at == "content-admission":  # the content run's journal is written, its
        # admission never answered
        _killed(tmp_path, ws, dest, "admit", tmp_path / "state/pulls/*/phase-select/meta.json")
    elif at == "exec-admission-status":  # the same by exec, where the admission carries
        # the first status, killed while it runs in the guest
        ready = tmp_path / "state/pulls/*/phase-select/meta.json"
        _killed(tmp_path, ws, dest, "admit_status", ready, "", "long-argv")
    else:  # the same through a guest helper, killed while the admission (and the status
        # it carries) runs in the guest
        ready = tmp_path / "state/pulls/*/phase-select/meta.json"
        _killed(tmp_path, ws, dest, "admit_status", ready, "", "helpers")
    time.sleep(0.01)  # a new mtime for c, whatever the filesystem's granularity
    (ws / "c").write_text("c two, after the kill\n")
    again = run_pull(LocalTransport(), ws, dest, opts)
    assert again.ok and again.reconciled, again
    assert (dest / "a").read_text() == "a two\n"
    final = run_pull(LocalTransport(), ws, dest, opts)
    assert final.ok and not final.reconciled, final
    assert_exact(ws, dest)


def test_a_journal_that_fails_after_the_swap_is_a_warning_not_the_pulls_error(
    tmp_path: Path,
) -> None:
    """Once DEST is swapped, an error promises what is false ("DEST untouched"): the
    journal's listing, cleared right after the swap, is gone with the state dir here (a
    red team removed it mid-pull), and the pull must end ok, with a warning."""
    ws, dest, opts = _pulled_then_a_changed(tmp_path)

    def gone() -> None:  # just before the swap, as a tmp cleaner would
        for phase in opts.state_dir.glob("pulls/*/phase-manifest"):
            shutil.rmtree(phase)

    result = run_pull(LocalTransport(), ws, dest, dataclasses.replace(opts, fence=gone))
    assert result.ok, result.error
    assert any("listing was not cleared" in w for w in result.warnings), result.warnings
    assert_exact(ws, dest)
    (ws / "b").write_text("b two, longer\n")
    assert run_pull(LocalTransport(), ws, dest, opts).ok
    assert_exact(ws, dest)


@pytest.mark.parametrize("change", [["--chunk-size", "128K"], ["--exclude", "*.tmp"]])
def test_a_rerun_that_cannot_resume_the_killed_runs_snapshot_removes_its_staging(
    tmp_path: Path, change: list[str]
) -> None:
    """A pull killed in its transfer, run again with an option that changes what must be
    archived (another chunk size, an exclude): the killed run's snapshot cannot be resumed,
    a fresh one is admitted.  The old one was left staged in the guest (the whole archive)
    until the staging's 24-hour GC: a guest staging that filled up with such archives
    refused the next pulls (exit 5)."""
    rng = random.Random(7)
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(8):
        (ws / f"blob{i}").write_bytes(rng.randbytes(256 * 1024))
    (ws / "x.tmp").write_bytes(b"scratch\n")
    dest, state, stage = tmp_path / "out", tmp_path / "state", tmp_path / "stage"
    args = argv(ws, dest, state, stage)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reached = wait_until(proc, lambda: len(list(state.glob("pulls/*/chunks/0*"))) >= 3)
    proc.kill()
    proc.communicate()
    assert reached, "the pull ended before its transfer was journaled"
    killed = {p.name for p in stage.iterdir() if p.name.startswith("s")}
    assert killed

    again = subprocess.run([*args, *change], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["resumed_chunks"] == 0  # (a fresh snapshot)
    if "--exclude" in change:
        (ws / "x.tmp").unlink()
    assert_exact(ws, dest)
    # the killed run's producer may still be finishing its snapshot: give it a moment
    deadline = time.monotonic() + 30
    while not all((stage / s / "done").exists() or not (stage / s).exists() for s in killed):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [p.name for p in stage.iterdir() if p.name.startswith("s")] == []
