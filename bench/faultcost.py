#!/usr/bin/env python3
"""Where a faulty pull through a backend emulator loses its time, fault kind by fault kind.

    PYTHONPATH=src python3 bench/faultcost.py [--backend cloudflare] [--seeds 3,4,5] [--mib 16]

For each backend and seed: one clean pull and one pull with every fault on
(``Faults.all_on(seed)``, as ``bench.py`` does), each a ``python -m wsync pull -v``
subprocess against the emulator running in this process.  From the ``-v`` log it
sums, per fault kind, how many attempts failed and the seconds those attempts
took (worker-seconds: reads run ``--parallel`` at a time, so they overlap), and
prints the emulator's own fault counters beside them.  The workspace is
``bench.py``'s small one with three random blobs of ``--mib`` MiB each.

A diagnostic, not a benchmark: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import _emulators, make_workspace

from wsync.treediff import diff

_RETRY = re.compile(r"\bretry\b.*?\bfault=(\S+).*?\bseconds=([\d.]+)")
_FILE_API = re.compile(r"file API read (failed|damaged).*?\bfault=(\S+)(?:.*?\bseconds=([\d.]+))?")


def lost_time(log: str) -> dict[str, tuple[int, float]]:
    """Per fault kind: (failed attempts, seconds those attempts took), from a ``-v`` log."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for line in log.splitlines():
        m = _RETRY.search(line)
        if m:
            out[m[1]][0] += 1
            out[m[1]][1] += float(m[2])
            continue
        m = _FILE_API.search(line)
        if m:
            out[m[2]][0] += 1
            out[m[2]][1] += float(m[3] or 0.0)
    return {k: (int(v[0]), round(v[1], 2)) for k, v in sorted(out.items())}


def slowest_failures(log: str, n: int = 3) -> list[str]:
    """The ``n`` failed attempts that took longest, as ``call fault seconds``."""
    found = []
    for line in log.splitlines():
        if " retry " not in f" {line} ":
            continue
        fields = dict(re.findall(r"(\w+)=('[^']*'|\S+)", line))
        with contextlib.suppress(KeyError, ValueError):
            found.append((float(fields["seconds"]), f"{fields['call']} {fields['fault']}"))
    return [f"{what} {secs}s" for secs, what in sorted(found, reverse=True)[:n]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "wsync-faultcost"
    )
    parser.add_argument(
        "--backend", action="append", help="scheme (repeatable); default: all three"
    )
    parser.add_argument("--seeds", default="3", help="comma-separated fault seeds")
    parser.add_argument("--mib", type=int, default=16, help="size of each of the three blobs")
    parser.add_argument("--extra", default="", help="extra arguments for wsync pull")
    args = parser.parse_args()
    root = args.workdir.resolve()
    root.mkdir(parents=True, exist_ok=True)
    ws = make_workspace(root, True, blob_mib=args.mib)
    wanted = args.backend or ["e2b", "daytona", "cloudflare"]
    py = shlex.quote(sys.executable)
    (root / "out").mkdir(exist_ok=True)
    report: list[dict[str, object]] = []
    for name, thread, faults in _emulators():
        if name not in wanted:
            continue
        with thread(root / name) as emu:
            (getattr(emu, "create_sandbox", None) or emu.create_sprite)("bench")
            opts = emu.transport_options()
            token_file = root / f"{name}.token"
            token_file.write_text(str(opts.get(f"{name}_token") or opts.get("token") or ""))
            for seed in [int(s) for s in args.seeds.split(",")]:
                walls = {}
                for label, config in (
                    ("clean", faults.off()),
                    ("faulty", faults.all_on(seed=seed)),
                ):
                    emu.set_faults(config)
                    before = collections.Counter(emu.stats)
                    dest = root / "out" / f"{name}-{label}"
                    subprocess.run(["rm", "-rf", str(dest), str(root / "state")], check=True)
                    command = (
                        f"{py} -m wsync pull -v {shlex.quote(f'{name}://bench{ws}')} "
                        f"{shlex.quote(str(dest))} --json --state-dir {shlex.quote(str(root / 'state'))} "
                        f"--{name}-url {shlex.quote(str(opts[f'{name}_url']))} "
                        f"--{name}-token-file {shlex.quote(str(token_file))} {args.extra}"
                    )
                    started = time.perf_counter()
                    proc = subprocess.run(  # noqa: S602 - a fixed command line
                        command, shell=True, capture_output=True, text=True, check=False
                    )
                    wall = time.perf_counter() - started
                    walls[label] = wall
                    result = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
                    emulated = {
                        k: v - before.get(k, 0)
                        for k, v in emu.stats.items()
                        if v - before.get(k, 0) and k not in ("requests", "execs")
                    }
                    row = {
                        "backend": name,
                        "seed": seed,
                        "run": label,
                        "rc": proc.returncode,
                        "wall_s": round(wall, 2),
                        "exact": proc.returncode == 0 and not diff(ws, dest),
                        "retries": result.get("retries"),
                        "requests": emu.stats["requests"] - before.get("requests", 0),
                        "lost": lost_time(proc.stderr),
                        # the slowest failed attempts: which call, which fault, how long
                        "worst": slowest_failures(proc.stderr),
                        "emulator": emulated,
                    }
                    if proc.returncode:
                        row["stderr_tail"] = proc.stderr[-600:]
                    report.append(row)
                    print(json.dumps(row), flush=True)
                print(
                    f"{name} seed {seed}: faulty/clean speed "
                    f"{walls['clean'] / walls['faulty']:.2f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
