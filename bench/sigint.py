#!/usr/bin/env python3
"""Ctrl-C latency: random SIGINTs against real ``wsync pull`` processes.

    PYTHONPATH=src python3 bench/sigint.py [--trials 200] [--seed 1] [--signal INT]

Each trial starts ``python -m wsync pull local:WS DEST`` from scratch (a fresh
DEST and state directory, so start-up imports are in range too), sends one
signal after a random delay drawn over the whole life of a pull, and measures
the time from the signal to the process's exit (through a pidfd, so the figure
is not rounded to a polling interval).  Every trial is then checked the way a
user would: exit 0 only with DEST exactly the workspace, exit 130 with DEST
untouched and the same command resuming to an exact tree (every --verify-every
trials; the rest only check DEST), never a traceback on stderr.

Signals that land before the process has installed wsync's signal policy
(the interpreter's own start-up: ``site`` and the ``.pth`` hooks of
site-packages, before any wsync code runs) get Python's default behaviour;
they are counted apart, as is every exit code.  Printed: exit code counts,
latency max/p50/p99 over all signals, and every anomaly.  This is a script,
not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from wsync.treediff import diff

#: a pull that has not exited this long after its signal counts as a hang
HANG_AFTER = 120.0


def make_workspace(root: Path, seed: int, blobs: int) -> Path:
    """Big enough to take a few seconds with one read in flight and small chunks."""
    rng = random.Random(seed)
    ws = root / "ws"
    for d in range(20):
        sub = ws / f"dir{d:02d}"
        sub.mkdir(parents=True)
        for f in range(100):
            (sub / f"f{f}.txt").write_bytes(rng.randbytes(rng.randrange(10, 3000)))
    for i in range(blobs):
        (ws / f"blob{i}.bin").write_bytes(rng.randbytes(3 * 1024 * 1024))
    (ws / "link").symlink_to("blob0.bin")
    return ws


def argv(ws: Path, dest: Path, state: Path, stage: Path) -> list[str]:
    return [
        sys.executable, "-m", "wsync", "pull", f"local:{ws}", str(dest),
        "--state-dir", str(state), "--staging-dir", str(stage),
        "--chunk-size", "256K", "--parallel", "1",
    ]  # fmt: skip


def is_guarded(pid: int) -> bool:
    """Has the process installed wsync's signal policy?  (It catches SIGTERM; Python
    by itself does not.)"""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    except OSError:
        pass
    return False


def wait_exit(proc: subprocess.Popen[bytes], deadline: float) -> float | None:
    """Block until ``proc`` exits (monotonic time of the exit) or ``deadline``."""
    fd = os.pidfd_open(proc.pid)
    try:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, left))
        return time.monotonic() if ready else None
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--signal", choices=("INT", "TERM"), default="INT")
    ap.add_argument("--verify-every", type=int, default=5, help="resume-check every Nth trial")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--blobs", type=int, default=8, help="3 MiB random files in the workspace")
    args = ap.parse_args()
    signum = getattr(signal, f"SIG{args.signal}")
    # the pulls must meet signals as a foreground command does: a shell without
    # job control starts a background job (this bench, say) with SIGINT ignored,
    # its children inherit that, and wsync then rightly leaves SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="wsync-sigint-", dir=args.workdir))
    try:
        ws = make_workspace(work, args.seed, args.blobs)
        # one clean pull measures the span the signals are spread over
        t0 = time.monotonic()
        clean = subprocess.run(
            argv(ws, work / "d0", work / "s0", work / "stage0"), capture_output=True, check=False
        )
        span = time.monotonic() - t0
        assert clean.returncode == 0, clean.stderr.decode()
        assert diff(ws, work / "d0") == []
        print(f"a clean pull takes {span:.2f}s; signals land in [0, {span:.2f}s]", flush=True)

        codes: collections.Counter[int] = collections.Counter()
        early: collections.Counter[int] = collections.Counter()
        early_tracebacks = 0
        latencies: list[float] = []
        anomalies: list[str] = []
        after_exit = 0
        for trial in range(args.trials):
            dest, state = work / f"dest{trial}", work / f"state{trial}"
            stage = work / f"stage{trial}"
            cmd = argv(ws, dest, state, stage)
            delay = rng.uniform(0, span)
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            guarded = False
            at = time.monotonic() + delay
            while (now := time.monotonic()) < at:
                guarded = guarded or is_guarded(proc.pid)
                time.sleep(min(0.0005, at - now) if not guarded else at - now)
            guarded = guarded or is_guarded(proc.pid)
            if proc.poll() is not None:
                after_exit += 1  # finished before the signal: not a signal trial
                proc.communicate()
                for path in (dest, state, stage):
                    shutil.rmtree(path, ignore_errors=True)
                continue
            sent = time.monotonic()
            proc.send_signal(signum)
            ended = wait_exit(proc, sent + HANG_AFTER)
            if ended is None:
                anomalies.append(f"trial {trial}: no exit {HANG_AFTER:.0f}s after the signal")
                proc.kill()
                ended = sent + HANG_AFTER
            _, err = proc.communicate()
            stderr = err.decode("utf-8", "replace")
            latencies.append(ended - sent)
            if not guarded:
                # the interpreter's own start-up (site, .pth hooks) before any wsync
                # code ran: Python's default handling, reported apart
                early[proc.returncode] += 1
                if "Traceback" in stderr:
                    early_tracebacks += 1
                for path in (dest, state, stage):
                    shutil.rmtree(path, ignore_errors=True)
                continue
            codes[proc.returncode] += 1
            what = f"trial {trial} (signal at {delay:.2f}s, exit {proc.returncode})"
            if "Traceback" in stderr:
                anomalies.append(f"{what}: traceback: {stderr.strip().splitlines()[-1]}")
            if proc.returncode == 0:
                problems = diff(ws, dest)
                if problems:
                    anomalies.append(f"{what}: exit 0 but DEST differs: {problems[:3]}")
            elif proc.returncode == 130:
                if dest.exists():
                    anomalies.append(f"{what}: exit 130 but DEST was created")
                if trial % args.verify_every == 0:
                    again = subprocess.run(cmd, capture_output=True, check=False)
                    if again.returncode != 0 or diff(ws, dest):
                        anomalies.append(
                            f"{what}: resume failed ({again.returncode}): "
                            f"{again.stderr.decode(errors='replace').strip()[-300:]}"
                        )
            else:
                anomalies.append(f"{what}: unexpected exit: {stderr.strip()[-300:]}")
            for path in (dest, state, stage):
                shutil.rmtree(path, ignore_errors=True)
            for leftover in work.glob(f".dest{trial}.*"):
                shutil.rmtree(leftover, ignore_errors=True)
            if (trial + 1) % 20 == 0:
                print(f"  {trial + 1} trials, exits {dict(codes)}", flush=True)

        latencies.sort()
        n = len(latencies)
        print(f"signals: {n} ({after_exit} more trials finished before their signal)")
        print(
            f"  of which {sum(early.values())} before wsync's signal policy was installed "
            f"(interpreter start-up): exits {dict(early)}, {early_tracebacks} with a traceback"
        )
        print(
            "exit codes (policy installed): "
            + ", ".join(f"{c}: {k}" for c, k in sorted(codes.items()))
        )
        if n:
            p50 = latencies[n // 2]
            p99 = latencies[min(n - 1, int(n * 0.99))]
            print(f"latency signal→exit: max {latencies[-1]:.3f}s  p50 {p50:.3f}s  p99 {p99:.3f}s")
        print(f"anomalies: {len(anomalies)}")
        for line in anomalies:
            print("  " + line)
        return 1 if anomalies else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
