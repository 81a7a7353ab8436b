#!/usr/bin/env python3
"""Incremental state at scale: diff time and peak RSS for a synthetic N-entry workspace.

    PYTHONPATH=src python3 bench/incr_state.py [--entries 1000000] [--workdir DIR]

A real DEST tree of N entries (empty files, 1,000 per directory) is created on disk, and a
synthetic manifest describing it is *generated* (not read from a guest: a million-file guest
and transfer would take far longer than the state code this measures).  Three phases, each
in a fresh child process so its peak RSS (``ru_maxrss``) is its own:

- ``first``: load the manifest, diff without a baseline (everything new), commit (scans DEST);
- ``unchanged``: load again, diff: nothing to do (the daemon's steady state);
- ``changed``: 1% of the records changed in the manifest: diff, list the fetch paths.

Also the farm: link an N-file tree into an empty one (``build_farm``) for the 8k and 100k
rows.  This is a script, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PER_DIR = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """The fields of wsync.protocol.manifest.Entry."""

    path: bytes
    kind: str
    mode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    target: bytes
    digest: str = ""
    record: bytes = b""  # no fingerprints: every load here parses every record


def entries(n: int, changed_every: int = 0) -> Iterator[Entry]:
    """The manifest of the synthetic tree: ``d{i}/f{j}``, N entries including directories."""
    yield Entry(b".", "d", 0o755, 0, 1_700_000_000_000_000_000, 0, 1, b"")
    made, d = 1, 0
    while made < n:
        dname = b"d%05d" % d
        yield Entry(dname, "d", 0o755, 0, 1_700_000_000_000_000_000, 0, 2 + made, b"")
        made += 1
        for j in range(min(PER_DIR, n - made)):
            mtime = 1_700_000_000_000_000_000 + made
            if changed_every and made % changed_every == 0:
                mtime += 1
            yield Entry(dname + b"/f%04d" % j, "f", 0o644, 0, mtime, mtime, 10 + made, b"")
            made += 1
        d += 1


def make_tree(root: Path, n: int) -> None:
    root.mkdir(parents=True)
    made, d = 1, 0
    while made < n:
        sub = root / f"d{d:05d}"
        sub.mkdir()
        made += 1
        fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
        for j in range(min(PER_DIR, n - made)):
            os.close(os.open(f"f{j:04d}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
            made += 1
        os.close(fd)
        d += 1


def phase(name: str, workdir: Path, n: int) -> dict[str, object]:
    """Run in the child: one phase, printing its figures as JSON."""
    from wsync.engine.excludes import Excludes
    from wsync.engine.farm import build_farm
    from wsync.engine.incstate import PullState

    dest = workdir / "dest"
    started = time.perf_counter()
    out: dict[str, object] = {"phase": name, "entries": n}
    if name == "farm":
        tmp = workdir / "farm"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        keep = [(e.path, e.kind) for e in entries(n) if e.path != b"."]
        dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        tfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        t0 = time.perf_counter()
        out["linked"] = build_farm(dfd, tfd, keep, lambda: None)
        out["farm_s"] = round(time.perf_counter() - t0, 2)
        os.close(dfd)
        os.close(tfd)
        shutil.rmtree(tmp)
    else:
        with PullState.open(workdir / "state", dest, "bench") as state:
            every = 100 if name == "changed" else 0
            state.load_manifest(entries(n, every), Excludes.none())
            out["load_s"] = round(time.perf_counter() - started, 2)
            fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
            t0 = time.perf_counter()
            diff = state.diff(fd)
            out["diff_s"] = round(time.perf_counter() - t0, 2)
            out["changed"], out["deleted"] = diff.changed, diff.deleted
            out["fetch"] = sum(1 for _ in diff.fetch_paths())
            if name == "first":
                t0 = time.perf_counter()
                state.commit(fd, {})
                out["commit_s"] = round(time.perf_counter() - t0, 2)
            os.close(fd)
    out["total_s"] = round(time.perf_counter() - started, 2)
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--farm", type=int, nargs="*", default=[8_000, 100_000])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.workdir, args.entries)))
        return 0
    base = Path(tempfile.mkdtemp(prefix="wsync-incr-bench-", dir=args.workdir))
    rows: list[dict[str, object]] = []

    def child(name: str, workdir: Path, n: int) -> None:
        cmd = [sys.executable, __file__, "--phase", name, "--workdir", str(workdir)]
        done = subprocess.run([*cmd, "--entries", str(n)], check=True, capture_output=True)
        rows.append(json.loads(done.stdout))
        print(json.dumps(rows[-1]), file=sys.stderr)

    try:
        for n in args.farm:
            work = base / f"farm-{n}"
            make_tree(work / "dest", n)
            child("farm", work, n)
            shutil.rmtree(work)
        work = base / "state"
        t0 = time.perf_counter()
        make_tree(work / "dest", args.entries)
        print(f"made {args.entries} entries in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        for name in ("first", "unchanged", "changed"):
            child(name, work, args.entries)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
