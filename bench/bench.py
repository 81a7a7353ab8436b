#!/usr/bin/env python3
"""Benchmark wsync against rsync and a plain tar|zstd stream, measured in one run.

    python3 bench/bench.py [--workdir DIR] [--quick] [--runs N] [--median]
        [--emulators-only] [--backend NAME]... [--blob-mib N]

Workspace: a copy of this Python's standard library directory (about 1 GB,
~60k files, site-packages included) plus a few large random files.  Every tool
copies it from a throwaway OpenSSH server on loopback (the same machine, so
the numbers measure the tools, not a network).  Reported per row: wall time
(best of N runs), the host-side CPU seconds of its command (the guest side under
the test sshd not counted), peak RSS of the host-side command tree, and the ratio to
rsync and to the plain stream.  Extra rows: wsync through the fault injector
(all field-report faults on) and through the Sprites emulator, clean and with
all faults, with the faulty/clean throughput ratio.  ``--quick --blob-mib 16
--emulators-only --runs 5 --median`` measures just the emulator rows on a ~50 MB tree,
each faulty run with its own fault seed (``bench/faultcost.py`` then says where a
faulty run lost its time).

Incremental rows (issue 8), over the same sshd, rounds interleaved, into DESTs that
a first (untimed) run of each tool filled: an unchanged re-pull beside ``rsync -a``'s
no-op, and a re-pull after 1% of the files changed (a new 1% each round) beside
``rsync -a``, by default and with ``--keep-prev``; wall time and bytes on the wire (``transferred_bytes`` from
``--json``; rsync's own ``--stats`` "Total bytes received").  Beside the 1% row, two
floors of any pull that keeps readers on the old tree or the new one (issue 8's rule)
on a filesystem without snapshots, timed in the same rounds: the guest's listing over
ssh (``find -printf`` of every entry, through ``zstd``, what a diff needs before anything
can move) and ``rm -rf`` of a hardlink copy of DEST (``cp -al``, untimed): the old tree
that such a pull removes after its swap, or keeps (``--keep-prev``).  Then
``bench/incr_state.py`` (``--state-entries``, default 1M; 0 skips it): the diff
time and peak RSS of the state code for a synthetic 1M-entry manifest against a
real 1M-entry DEST, and the hardlink farm for 8k and 100k files.

This is a script, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
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
from typing import Any, NamedTuple

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


def compile_wsync() -> None:
    """Write wsync's bytecode before anything is timed, as ``pip install`` does: from a
    source checkout under ``PYTHONDONTWRITEBYTECODE`` (set on some CI machines) every run
    would compile the package again, about 0.1 s of each pull that no user pays."""
    import compileall

    import wsync

    compileall.compile_dir(str(Path(wsync.__file__).parent), quiet=1)


class Ran(NamedTuple):
    """What :func:`run` measured of one pipeline."""

    wall: float
    #: peak summed RSS of its process tree, KiB
    rss: int
    out: bytes
    #: CPU seconds (user and system) of the pipeline's own processes on this host: wsync or
    #: rsync and their ssh client, not the guest side under the test sshd.  Steadier than
    #: the wall time where the VM's speed moves: a pull that does less work shows it here
    cpu: float


def run(command: str) -> Ran:
    """Run a shell pipeline and measure it (see :class:`Ran`)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
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
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return Ran(elapsed, peak, out, cpu)


def _emulators() -> list[tuple[str, Any, Any]]:
    """(scheme, emulator thread class, faults class) of every backend emulator."""
    from wsync.emulators.cloudflare import CloudflareFaults
    from wsync.emulators.cloudflare import EmulatorThread as CloudflareThread
    from wsync.emulators.daytona import DaytonaEmulatorThread, DaytonaFaults
    from wsync.emulators.docker import DockerFaults
    from wsync.emulators.docker import EmulatorThread as DockerThread
    from wsync.emulators.e2b import E2BFaults
    from wsync.emulators.e2b import EmulatorThread as E2BThread
    from wsync.emulators.sprites import EmulatorThread as SpritesThread
    from wsync.emulators.sprites import SpritesFaults

    return [
        ("sprites", SpritesThread, SpritesFaults),
        ("e2b", E2BThread, E2BFaults),
        ("daytona", DaytonaEmulatorThread, DaytonaFaults),
        ("cloudflare", CloudflareThread, CloudflareFaults),
        ("docker", DockerThread, DockerFaults),
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
    parser.add_argument(
        "--incremental-only",
        action="store_true",
        help="only the incremental rows (issue 8): skip full pulls and emulators",
    )
    parser.add_argument(
        "--state-entries",
        type=int,
        default=None,
        help="entries of the synthetic manifest row (default 1M, 100k with --quick; 0: skip)",
    )
    args = parser.parse_args()
    compile_wsync()
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
            wall, rss, out, cpu = run(build(d))
            row: dict[str, object] = {
                "name": name,
                "wall_s": round(wall, 2),
                "rss_mib": round(rss / 1024, 1),
                "cpu_s": round(cpu, 2),
            }
            if out.strip().startswith(b"{"):
                row["retries"] = json.loads(out).get("retries")
            row["exact"] = not diff(ws, d)
            print(f"  {row}", file=sys.stderr)
            return row

        def rounds(
            specs: list[tuple[str, Callable[[Path], str], Callable[[], None]]],
        ) -> list[dict[str, object]]:
            """Best of ``--runs``, with the rows interleaved round by round.

            This VM's filesystem slows down with every 1 GB tree written and
            deleted, so measuring one tool's runs back to back favours whoever
            goes first; interleaving spreads that drift over every row.
            """
            runs: dict[str, list[dict[str, object]]] = {}
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
        full_specs: list[tuple[str, Callable[[Path], str], Callable[[], None]]] = [
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
        ]
        full_rows = [] if args.incremental_only or args.emulators_only else rounds(full_specs)

        incremental = (
            {}
            if args.emulators_only
            else incremental_rows(
                args.runs, root, ws, ssh, target, py, sshd.uri(str(ws)), wsync_common
            )
        )
        for pair in incremental.values():
            rows.extend(row for row in pair if row not in rows)

    emulated: dict[str, tuple[dict[str, object], dict[str, object]]] = {}
    for name, thread, faults in [] if args.incremental_only else _emulators():
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
                if f"{name}_url" in opts
                # docker: no token, and the endpoint is a socket (--docker-host)
                else f"--json --state-dir {shlex.quote(str(state))} "
                f"--{name}-host {shlex.quote(str(opts[f'{name}_host']))}"
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

    # k8s: the cluster is reached through the kubeconfig the emulator writes (CA, token)
    from wsync.emulators.k8s import K8sEmulatorThread, K8sFaults

    k8s_seeds = itertools.count(3)  # as for the others: seeds 3, 4, ... (--median)
    if not args.incremental_only and (not args.backend or "k8s" in args.backend):
        with K8sEmulatorThread(root / "k8s") as cluster:
            cluster.create_pod("bench")
            k8s_uri = shlex.quote(f"k8s://default/bench{ws}")
            k8s_common = (
                f"--json --state-dir {shlex.quote(str(state))} "
                f"--kubeconfig {shlex.quote(str(cluster.kubeconfig))}"
            )

            def k8s_pull(d: Path) -> str:
                return f"{py} -m wsync pull {k8s_uri} {shlex.quote(str(d))} {k8s_common}"

            emulated["k8s"] = tuple(  # type: ignore[assignment]
                rounds(
                    [
                        ("wsync pull k8s emulator, clean", k8s_pull,
                         lambda: cluster.set_faults(K8sFaults.off())),
                        ("wsync pull k8s emulator, all faults", k8s_pull,
                         lambda: cluster.set_faults(K8sFaults.all_on(
                             seed=next(k8s_seeds) if args.median else 3))),
                    ]
                )
            )  # fmt: skip

    def ratio(a: dict[str, object], b: dict[str, object]) -> float:
        return round(float(a["wall_s"]) / float(b["wall_s"]), 2)  # type: ignore[arg-type]

    print(
        f"\n{'row':<42} {'wall s':>8} {'CPU s':>6} {'RSS MiB':>8} {'exact':>6} {'retries':>8} "
        f"{'wire bytes':>12} {'mode':>12}"
    )
    for row in rows:
        print(
            f"{row['name']:<42} {row['wall_s']:>8} {row.get('cpu_s', '-')!s:>6} "
            f"{row['rss_mib']:>8} "
            f"{row.get('exact', '-')!s:>6} {row.get('retries', '-')!s:>8} "
            f"{row.get('wire_bytes', '-')!s:>12} {row.get('mode', '-')!s:>12}"
        )
    summary: dict[str, float] = {}
    if full_rows:
        rsync, plain, clean, faulty = full_rows
        summary["wsync/rsync wall"] = ratio(clean, rsync)
        summary["wsync/plain-stream wall"] = ratio(clean, plain)
        summary["ssh: clean/faulty throughput (faulty ÷ clean speed)"] = ratio(clean, faulty)
    for name, (e_clean, e_faulty) in emulated.items():
        summary[f"{name}: clean/faulty throughput (faulty ÷ clean speed)"] = ratio(
            e_clean, e_faulty
        )
    for label, (r_row, w_row) in incremental.items():
        if "floor:" in label:  # a floor's time against rsync's whole pull
            summary[f"{label}: floor/rsync wall"] = ratio(w_row, r_row)
            continue
        summary[f"{label}: wsync/rsync wall"] = ratio(w_row, r_row)
        summary[f"{label}: wsync/rsync host CPU"] = round(
            float(w_row["cpu_s"]) / max(float(r_row["cpu_s"]), 0.01),  # type: ignore[arg-type]
            2,
        )
        summary[f"{label}: wsync/rsync bytes"] = round(
            float(w_row["wire_bytes"]) / max(float(r_row["wire_bytes"]), 1.0),  # type: ignore[arg-type]
            2,
        )
    state_entries = args.state_entries
    if state_entries is None:
        state_entries = 100_000 if args.quick else 1_000_000
    if state_entries:
        script = Path(__file__).with_name("incr_state.py")
        farm = ["8000"] if args.quick else ["8000", "100000"]
        done = subprocess.run(
            [sys.executable, str(script), "--entries", str(state_entries),
             "--workdir", str(root), "--farm", *farm],
            check=True, capture_output=True,
        )  # fmt: skip
        print(
            f"\n{'state code, synthetic manifest':<42} {'entries':>9} {'diff s':>7} {'RSS MiB':>8}"
        )
        for item in json.loads(done.stdout):
            rows.append({"name": f"state {item['phase']}", **item})
            secs = item.get("diff_s", item.get("farm_s"))
            print(f"{item['phase']:<42} {item['entries']:>9} {secs!s:>7} {item['peak_rss_mib']:>8}")
    print()
    for k, v in summary.items():
        print(f"{k:<58} {v}")
    if args.json:
        print(json.dumps({"rows": rows, "ratios": summary, "files": files, "bytes": size}))
    return 0


def _rsync_received(out: bytes) -> int:
    """ "Total bytes received: 1,234" from ``rsync --stats``."""
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("Total bytes received:"):
            return int(line.split(":", 1)[1].strip().replace(",", ""))
    return 0


def _change_one_percent(ws: Path, round_no: int) -> int:
    """Append a line to every 100th file of the stdlib part of the workspace (a different
    1% each round): source edits.  The three 64 MiB random blobs are left alone: appending
    to one costs wsync the whole file (it has no delta transfer) and rsync a few bytes, a
    difference of design that would drown what this row measures."""
    files = sorted(p for p in (ws / "lib").rglob("*") if p.is_file() and not p.is_symlink())
    picked = files[round_no % 100 :: 100]
    for path in picked:
        with path.open("ab") as f:
            f.write(f"# changed in round {round_no}\n".encode())
    return len(picked)


def incremental_rows(
    runs: int,
    root: Path,
    ws: Path,
    ssh: str,
    target: str,
    py: str,
    uri: str,
    wsync_common: str,
) -> dict[str, tuple[dict[str, object], dict[str, object]]]:
    """Unchanged and 1%-changed re-pulls into kept DESTs, wsync beside rsync (issue 8); the
    1% row also with ``--keep-prev`` into a DEST of its own (its first round builds the
    farm from scratch, as every default pull does; best-of-N keeps a round that reused)."""
    r_dest, w_dest = root / "out" / "incr-rsync", root / "out" / "incr-wsync"
    k_dest = root / "out" / "incr-wsync-keep"
    for d in (r_dest, w_dest, k_dest):
        if d.exists():
            subprocess.run(["rm", "-rf", str(d)], check=True)
        prev = d.parent / f".{d.name}.wsync-prev"
        if prev.exists():
            subprocess.run(["rm", "-rf", str(prev)], check=True)
    r_dest.parent.mkdir(parents=True, exist_ok=True)
    rsync = f"rsync -a --stats -e {shlex.quote(ssh)} {target}:{shlex.quote(str(ws))}/ {shlex.quote(str(r_dest))}/"
    wsync = f"{py} -m wsync pull {shlex.quote(uri)} {shlex.quote(str(w_dest))} {wsync_common}"
    keep = f"{py} -m wsync pull {shlex.quote(uri)} {shlex.quote(str(k_dest))} {wsync_common} --keep-prev"
    for command in (rsync, wsync, keep):
        run(command)  # the first, full copies are not timed
    out: dict[str, tuple[dict[str, object], dict[str, object]]] = {}

    def timed(name: str, command: str, dest: Path, kind: str) -> dict[str, object]:
        wall, rss, stdout, cpu = run(command)
        row: dict[str, object] = {
            "name": name,
            "wall_s": round(wall, 2),
            "rss_mib": round(rss / 1024, 1),
            "cpu_s": round(cpu, 2),
        }
        if kind == "rsync":
            row["wire_bytes"] = _rsync_received(stdout)
        else:
            result = json.loads(stdout)
            row["wire_bytes"] = result.get("transferred_bytes", 0)
            row["mode"] = result.get("mode", "full")
            row["changed"] = result.get("changed_files")
        row["exact"] = not diff(ws, dest)
        print(f"  {row}", file=sys.stderr)
        return row

    for label, change in (("unchanged re-pull", False), ("1% of files changed", True)):
        best: dict[str, dict[str, object]] = {}
        commands = [
            (f"rsync -a, {label}", rsync, r_dest, "rsync"),
            (f"wsync pull, {label}", wsync, w_dest, "wsync"),
        ]
        if change:
            commands.append((f"wsync pull --keep-prev, {label}", keep, k_dest, "wsync"))
        for round_no in range(runs):
            if change:
                n = _change_one_percent(ws, round_no)
                print(f"  changed {n} files", file=sys.stderr)
            for name, command, dest, kind in commands:
                row = timed(name, command, dest, kind)
                if name not in best or float(row["wall_s"]) < float(best[name]["wall_s"]):  # type: ignore[arg-type]
                    best[name] = row
        if change:
            # after the rounds: a removal of 59k entries slows the file creation of
            # whatever runs in the minute after it (see bench/firstpull.py's ``--settle``)
            for _ in range(runs):
                for row in _floors(ws, ssh, target, w_dest):
                    name = str(row["name"])
                    if name not in best or float(row["wall_s"]) < float(best[name]["wall_s"]):  # type: ignore[arg-type]
                        best[name] = row
        r_row = best[f"rsync -a, {label}"]
        out[label] = (r_row, best[f"wsync pull, {label}"])
        if change:
            out[f"{label}, --keep-prev"] = (r_row, best[f"wsync pull --keep-prev, {label}"])
            for name in (FLOOR_LISTING, FLOOR_REMOVAL):
                out[f"{label}, {name}"] = (r_row, best[name])
    return out


FLOOR_LISTING = "floor: the guest's listing over ssh"
FLOOR_REMOVAL = "floor: rm -rf of a cp -al of DEST"


def _floors(ws: Path, ssh: str, target: str, dest: Path) -> list[dict[str, object]]:
    """One round of the two floors of an atomic incremental pull (see the module
    docstring): the listing, and the removal of an old tree of hard links."""
    listing = shlex.quote(
        f"cd {shlex.quote(str(ws))} && find . -printf '%y %m %s %T@ %C@ %i %p\\0' | zstd -q -c"
    )
    wall, _, out, _ = run(f"{ssh} {target} {listing}")
    rows: list[dict[str, object]] = [
        {"name": FLOOR_LISTING, "wall_s": round(wall, 2), "rss_mib": 0, "wire_bytes": len(out)}
    ]
    farm = dest.with_name(dest.name + ".floor")
    subprocess.run(["rm", "-rf", str(farm)], check=True)
    subprocess.run(["cp", "-al", str(dest), str(farm)], check=True)
    subprocess.run(["sync"], check=True)
    wall, _, _, _ = run(f"rm -rf {shlex.quote(str(farm))}")
    rows.append({"name": FLOOR_REMOVAL, "wall_s": round(wall, 2), "rss_mib": 0, "wire_bytes": 0})
    for row in rows:
        print(f"  {row}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
