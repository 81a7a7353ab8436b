#!/usr/bin/env python3
"""Execs and time of a pull through the Docker, Kubernetes and E2B emulators, with guest
helpers and with one exec per call, measured in one run, rounds interleaved.

    python3 bench/helper_execs.py [--runs N] [--mib N] [--exec-cost SECONDS]

Each round pulls a small workspace (20 files and a 300 KB one) and a bigger one (``--mib``
MiB of random files, default 8) into fresh DESTs, faults off.  Printed per row: the
median of the execs the pull counted and of its wall time.  The emulators run on this
machine: an emulated exec costs what a local process and, for Kubernetes, a TLS
WebSocket handshake cost, not what a real daemon's or cluster's does (a runtime's exec,
containerd and runc, takes tens of milliseconds more); ``--exec-cost`` starts every
exec's process that much later than its start was answered, as a busy runtime does (the
emulators' ``start_delay``; E2B's envd sends its first frame that much later), helpers'
execs included.  E2B reads chunks through its file API either way: its helpers carry the
other calls.

This is a script, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wsync.cli import setup_logging
from wsync.emulators.docker import DockerFaults
from wsync.emulators.docker import EmulatorThread as DockerEmulator
from wsync.emulators.e2b import E2BFaults
from wsync.emulators.e2b import EmulatorThread as E2BEmulator
from wsync.emulators.k8s import K8sEmulatorThread, K8sFaults
from wsync.engine.api import PullOptions
from wsync.engine.pull import pull_uri


def small(ws: Path) -> None:
    """20 small source files and a 300 KB random one."""
    (ws / "src").mkdir(parents=True)
    for i in range(20):
        (ws / "src" / f"f{i}.txt").write_text(f"file {i}\n" * (i + 1))
    (ws / "big.bin").write_bytes(os.urandom(300_000))


def bigger(ws: Path, mib: int) -> None:
    """The small tree and ``mib`` random files of 1 MiB (they do not compress)."""
    small(ws)
    for i in range(mib):
        (ws / f"blob{i}.bin").write_bytes(os.urandom(1024 * 1024))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--exec-cost", type=float, default=0.0)
    args = parser.parse_args()
    setup_logging(verbose=False, debug=False)
    root = Path(tempfile.mkdtemp(prefix="wsync-helper-bench-"))
    rows: dict[tuple[str, str, bool], list[tuple[int, float]]] = {}
    makers: dict[str, Callable[[Path], None]] = {
        "small": small,
        f"{args.mib} MiB": lambda ws: bigger(ws, args.mib),
    }
    late = {"start_delay": args.exec_cost, "slow_starts": 10**9}
    with (
        DockerEmulator(root / "docker", faults=DockerFaults(**late)) as dockerd,
        K8sEmulatorThread(root / "k8s") as k8s,
        E2BEmulator(root / "e2b", faults=E2BFaults(start_delay=args.exec_cost)) as envd,
    ):
        k8s.set_faults(K8sFaults(**late))
        backends: dict[str, tuple[Any, str]] = {}
        for key, (name, make) in enumerate(makers.items()):
            d_ws = dockerd.create_container(f"c{key}") / "ws"
            k_ws = k8s.create_pod(f"p{key}") / "ws"
            e_ws = envd.create_sandbox(f"s{key}") / "ws"
            for ws in (d_ws, k_ws, e_ws):
                make(ws)
            backends[f"docker {name}"] = (dockerd, f"docker://c{key}{d_ws}")
            backends[f"k8s {name}"] = (k8s, f"k8s://default/p{key}{k_ws}")
            backends[f"e2b {name}"] = (envd, f"e2b://s{key}{e_ws}")
        n = 0
        for _ in range(args.runs):
            for label, (emu, uri) in backends.items():
                for helpers in (True, False):
                    n += 1
                    opts = PullOptions(
                        state_dir=root / f"state{n}",
                        staging_root=str(root / f"staging{n}"),
                        helpers=helpers,
                    )
                    started = time.monotonic()
                    result = asyncio.run(
                        pull_uri(uri, root / f"out{n}", opts, emu.transport_options())
                    )
                    took = time.monotonic() - started
                    backend, _, name = label.partition(" ")
                    rows.setdefault((backend, name, helpers), []).append((result.execs, took))
    print("| backend | workspace | helpers | execs | time |")
    print("| --- | --- | --- | --- | --- |")
    for (backend, name, helpers), got in rows.items():
        execs = statistics.median(e for e, _ in got)
        took = statistics.median(t for _, t in got)
        yes = "yes" if helpers else "no"
        print(f"| {backend} | {name} | {yes} | {execs:g} | {took:.3f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
