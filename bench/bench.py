#!/usr/bin/env python3
"""Benchmark wsync against rsync and a plain tar|zstd stream, measured in one run.

    python3 bench/bench.py [--workdir DIR] [--quick] [--runs N] [--median]
        [--emulators-only] [--backend NAME]... [--blob-mib N]

Workspace: a copy of this Python's standard library directory (about 1 GB,
~60k files, site-packages included) plus a few large random files.  Every tool
copies it from a throwaway OpenSSH server on loopback (the same machine, so
the numbers measure the tools, not a network).  Reported per row: wall time
(best of N runs), peak RSS of the host-side command tree, and the ratio to
rsync and to the plain stream.  Extra rows: wsync through the fault injector
(all field-report faults on) and through the Sprites emulator, clean and with
all faults, with the faulty/clean throughput ratio.  ``--quick --blob-mib 16
--emulators-only --runs 5 --median`` measures just the emulator rows on a ~50 MB tree,
each faulty run with its own fault seed (``bench/faultcost.py`` then says where a
faulty run lost its time).

This is a script, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wsync.testing.sshd import SshdServer
from wsync.treediff import diff


def make_workspace(root: Path, quick: bool, blob_mib: int | None = None) -> Path:
    """The stdlib (only its ``json`` package when ``quick``) plus three random blobs of
    ``blob_mib`` MiB each (default 4 when quick, else 64)."""
    name = "ws-quick" if quick else "ws"
    ws = root / (f"{name}-{blob_mib}" if blob_mib else name)
    blob_mib = blob_mib or (4 if quick else 64)
    if ws.exists():
        return ws
    tmp = root / "ws.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    src = stdlib / "json" if quick else stdlib
    print(f"building workspace from {src} ...", file=sys.stderr)
    shutil.copytree(src, tmp / "lib", symlinks=True, ignore_dangling_symlinks=True)
    rng = random.Random(1)
    for i in range(3):
        size = blob_mib * 1024 * 1024
        (tmp / f"blob{i}.bin").write_bytes(rng.randbytes(size))
    tmp.rename(ws)
    return ws


def tree_rss_kib(root: int) -> int:
    """Summed VmRSS of ``root`` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total


def run(command: str) -> tuple[float, int, bytes]:
    """Run a shell pipeline; return (wall seconds, peak summed RSS KiB of its tree, stdout)."""
    started = time.perf_counter()
    proc = subprocess.Popen(  # noqa: S602 - fixed benchmark pipelines, no guest input
        command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    peak, stop = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, tree_rss_kib(proc.pid))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    elapsed = time.perf_counter() - started
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"benchmark command failed ({proc.returncode}): {command}\n{err.decode()}")
    return elapsed, peak, out


def _emulators() -> list[tuple[str, Any, Any]]:
    """(scheme, emulator thread class, faults class) of every backend emulator."""
    from wsync.emulators.cloudflare import CloudflareFaults
    from wsync.emulators.cloudflare import EmulatorThread as CloudflareThread
    from wsync.emulators.daytona import DaytonaEmulatorThread, DaytonaFaults
    from wsync.emulators.e2b import E2BFaults
    from wsync.emulators.e2b import EmulatorThread as E2BThread
    from wsync.emulators.sprites import EmulatorThread as SpritesThread
    from wsync.emulators.sprites import SpritesFaults

    return [
        ("sprites", SpritesThread, SpritesFaults),
        ("e2b", E2BThread, E2BFaults),
        ("daytona", DaytonaEmulatorThread, DaytonaFaults),
        ("cloudflare", CloudflareThread, CloudflareFaults),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "wsync-bench")
    parser.add_argument("--quick", action="store_true", help="small workspace (smoke run)")
    parser.add_argument("--runs", type=int, default=1, help="runs per row; the best is kept")
    parser.add_argument(
        "--median",
        action="store_true",
        help="keep each row's median run, and give each run of a faulty emulator row "
        "its own fault seed (3, 4, ...): a best-of-N would keep the luckiest schedule",
    )
    parser.add_argument(
        "--emulators-only", action="store_true", help="skip the ssh, rsync and plain rows"
    )
    parser.add_argument(
        "--backend", action="append", help="only this emulator (repeatable; default: all)"
    )
    parser.add_argument(
        "--blob-mib", type=int, help="size of each of the three random blobs (default 4/64)"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()
    root = args.workdir.resolve()
    root.mkdir(parents=True, exist_ok=True)
    ws = make_workspace(root, args.quick, args.blob_mib)
    subprocess.run(["tar", "-cf", "/dev/null", "-C", str(ws), "."], check=True)  # warm cache
    files = sum(len(d) + len(f) for _, d, f in os.walk(ws))
    size = sum(p.stat().st_size for p in ws.rglob("*") if p.is_file() and not p.is_symlink())
    print(f"workspace {ws}: {files} entries, {size / 2**20:.0f} MiB", file=sys.stderr)

    rows: list[dict[str, object]] = []
    with SshdServer(root / "sshd") as sshd:
        opts = sshd.transport_options()
        key, kh = str(opts["ssh_key"]), str(opts["known_hosts"])
        ssh = (
            f"ssh -i {shlex.quote(key)} -o UserKnownHostsFile={shlex.quote(kh)} "
            f"-o StrictHostKeyChecking=yes -o BatchMode=yes -p {sshd.port}"
        )
        target = f"{sshd.user}@{sshd.host}"
        py = shlex.quote(sys.executable)

        def dest(name: str) -> Path:
            """A fresh destination, with the filesystem quiet again.

            Deleting the previous 1 GB tree leaves seconds of journal and
            writeback work behind; without the sync the next row pays for it.
            """
            d = root / "out" / name
            if d.exists():
                subprocess.run(["rm", "-rf", str(d)], check=True)
            d.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["sync"], check=True)
            time.sleep(2)
            return d

        def measure_once(name: str, build: Callable[[Path], str]) -> dict[str, object]:
            d = dest(name)
            wall, rss, out = run(build(d))
            row: dict[str, object] = {
                "name": name,
                "wall_s": round(wall, 2),
                "rss_mib": round(rss / 1024, 1),
            }
            if out.strip().startswith(b"{"):
                row["retries"] = json.loads(out).get("retries")
            row["exact"] = not diff(ws, d)
            print(f"  {row}", file=sys.stderr)
            return row

        def rounds(
            specs: list[tuple[str, Callable[[Path], str], Callable[[], None]]],
            enabled: bool = True,
        ) -> list[dict[str, object]]:
            """Best of ``--runs``, with the rows interleaved round by round.

            This VM's filesystem slows down with every 1 GB tree written and
            deleted, so measuring one tool's runs back to back favours whoever
            goes first; interleaving spreads that drift over every row.
            """
            runs: dict[str, list[dict[str, object]]] = {}
            if not enabled:
                return []
            for _ in range(args.runs):
                for name, build, before in specs:
                    before()
                    runs.setdefault(name, []).append(measure_once(name, build))
            out = []
            for name, _, _ in specs:
                ordered = sorted(runs[name], key=lambda row: float(row["wall_s"]))  # type: ignore[arg-type]
                out.append(ordered[len(ordered) // 2] if args.median else ordered[0])
            rows.extend(out)
            return out

        def nothing() -> None:
            pass

        state = root / "state"
        wsync_common = f"--json --state-dir {shlex.quote(str(state))} --ssh-key {shlex.quote(key)} --known-hosts {shlex.quote(kh)}"
        ssh_rows = rounds(
            [
                (
                    "rsync -a over ssh",
                    lambda d: (
                        f"rsync -a -e {shlex.quote(ssh)} {target}:{shlex.quote(str(ws))}/ {shlex.quote(str(d))}/"
                    ),
                    nothing,
                ),
                (
                    "plain ssh tar|zstd stream",
                    lambda d: (
                        f"mkdir -p {shlex.quote(str(d))} && {ssh} {target} "
                        f"{shlex.quote(f'tar -cf - -C {shlex.quote(str(ws))} . | zstd -q -c -T0')} "
                        f"| zstd -q -d -c | tar -xf - -C {shlex.quote(str(d))}"
                    ),
                    nothing,
                ),
                (
                    "wsync pull over ssh",
                    lambda d: (
                        f"{py} -m wsync pull {shlex.quote(sshd.uri(str(ws)))} {shlex.quote(str(d))} {wsync_common}"
                    ),
                    nothing,
                ),
                (
                    "wsync pull over ssh, all faults",
                    lambda d: (
                        f"{py} -m wsync pull {shlex.quote(sshd.uri(str(ws)))} {shlex.quote(str(d))} {wsync_common} --chaos all"
                    ),
                    nothing,
                ),
            ],
            enabled=not args.emulators_only,
        )

    emulated: dict[str, tuple[dict[str, object], dict[str, object]]] = {}
    for name, thread, faults in _emulators():
        if args.backend and name not in args.backend:
            continue
        seeds = itertools.count(3)  # each backend's faulty runs: seeds 3, 4, ... (--median)
        with thread(root / name) as emu:
            create = getattr(emu, "create_sandbox", None) or emu.create_sprite
            create("bench")
            opts = emu.transport_options()
            token_file = root / f"{name}.token"
            token_file.write_text(str(opts.get(f"{name}_token") or opts.get("token") or ""))
            common = (
                f"--json --state-dir {shlex.quote(str(state))} "
                f"--{name}-url {shlex.quote(str(opts[f'{name}_url']))} "
                f"--{name}-token-file {shlex.quote(str(token_file))}"
            )
            uri = shlex.quote(f"{name}://bench{ws}")

            def pull_cmd(d: Path, uri: str = uri, common: str = common) -> str:
                return f"{py} -m wsync pull {uri} {shlex.quote(str(d))} {common}"

            emulated[name] = tuple(  # type: ignore[assignment]
                rounds(
                    [
                        (f"wsync pull {name} emulator, clean", pull_cmd,
                         lambda emu=emu, f=faults: emu.set_faults(f.off())),
                        (f"wsync pull {name} emulator, all faults", pull_cmd,
                         lambda emu=emu, f=faults, seeds=seeds: emu.set_faults(
                             f.all_on(seed=next(seeds) if args.median else 3))),
                    ]
                )
            )  # fmt: skip

    def ratio(a: dict[str, object], b: dict[str, object]) -> float:
        return round(float(a["wall_s"]) / float(b["wall_s"]), 2)  # type: ignore[arg-type]

    print(f"\n{'row':<42} {'wall s':>8} {'RSS MiB':>8} {'exact':>6} {'retries':>8}")
    for row in rows:
        print(
            f"{row['name']:<42} {row['wall_s']:>8} {row['rss_mib']:>8} "
            f"{row.get('exact', '-')!s:>6} {row.get('retries', '-')!s:>8}"
        )
    summary = {}
    if ssh_rows:
        rsync, plain, clean, faulty = ssh_rows
        summary = {
            "wsync/rsync wall": ratio(clean, rsync),
            "wsync/plain-stream wall": ratio(clean, plain),
            "ssh: clean/faulty throughput (faulty ÷ clean speed)": ratio(clean, faulty),
        }
    for name, (e_clean, e_faulty) in emulated.items():
        summary[f"{name}: clean/faulty throughput (faulty ÷ clean speed)"] = ratio(
            e_clean, e_faulty
        )
    print()
    for k, v in summary.items():
        print(f"{k:<58} {v}")
    if args.json:
        print(json.dumps({"rows": rows, "ratios": summary, "files": files, "bytes": size}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
