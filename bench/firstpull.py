#!/usr/bin/env python3
"""First-pull benchmark (issue 13): wsync beside rsync and a plain ``tar|zstd`` stream.

    python3 bench/firstpull.py [--workdir DIR] [--runs N] [--quick] [--only SCENARIO]...

Workspace: this Python's standard library without ``site-packages`` (about 250 MB,
8k entries), copied from a throwaway OpenSSH server on loopback.  Scenarios, each
with its rows measured in rounds interleaved and the median of ``--runs`` kept:

* ``loopback``: the link is the loopback device;
* ``100mbit`` and ``20mbit``: every byte goes through a throttling TCP proxy
  (:class:`wsync.testing.tcpproxy.TcpProxy` with a rate) in front of the sshd;
* ``small``: a workspace of one small file (what a pull costs when there is
  nothing to move: the execs and the start-up);
* ``slowrc``: ``loopback`` and ``small`` again with a shell profile (``~/.bashrc``)
  that sleeps 100 ms, as real sandboxes' profiles take time: every exec pays it.

``--floor`` adds to ``loopback`` two rows that move no byte over any link: the host side
of the plain stream alone, ``zstd -d | tar -x`` of the same archive (made once, beforehand,
at the stream's level) from a local file, and the same followed by ``sync -f`` (the
durable tree that docs/design.md asks for before the swap; ``rsync`` syncs nothing).
They are floors of every pull that receives the workspace as one tar stream (wsync's
design), on this machine's disk and cores.

Each row prints wall time, peak RSS of the host-side command tree and, for
wsync, the execs it ran and the bytes it read (``--json``); the ratios print
the per-round ratio's median against ``rsync`` (``-az`` on the slow links,
where it is what users would run) and against the plain stream.

This is a script, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import compile_wsync, run  # the sibling script's measuring helpers

from wsync.testing.sshd import SshdServer
from wsync.testing.tcpproxy import TcpProxy
from wsync.treediff import diff

MBIT = 1_000_000 / 8
SCENARIOS = ("loopback", "100mbit", "20mbit", "small", "slowrc")
#: the rows of ``--floor``
FLOORS = ("tar -x, local file", "tar -x, local, synced")


def stdlib_tree(root: Path, quick: bool) -> Path:
    ws = root / ("fp-quick" if quick else "fp-stdlib")
    if not ws.exists():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        src = stdlib / "json" if quick else stdlib
        tmp = root / "fp.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(
            src,
            tmp,
            symlinks=True,
            ignore_dangling_symlinks=True,
            ignore=shutil.ignore_patterns("site-packages"),
        )
        tmp.rename(ws)
    return ws


def small_tree(root: Path) -> Path:
    ws = root / "fp-small"
    ws.mkdir(exist_ok=True)
    (ws / "notes.txt").write_text("one small file\n")
    return ws


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "wsync-fp")
    parser.add_argument("--runs", type=int, default=3, help="rounds; each row keeps its median")
    parser.add_argument("--quick", action="store_true", help="the stdlib's json package only")
    parser.add_argument("--only", action="append", choices=SCENARIOS, help="repeatable")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument(
        "--per-call",
        action="store_true",
        help="add a row of wsync --exec-per-call (one exec per guest call, no helper)",
    )
    parser.add_argument(
        "--openssh",
        action="store_true",
        help="add a row of wsync --ssh-client openssh (OpenSSH's client, one master)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="add to loopback a row of zstd -d | tar -x from a local archive (no link)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=65.0,
        help="seconds between removing a scenario's trees and the next scenario",
    )
    parser.add_argument(
        "--fresh-state",
        action="store_true",
        help="a new --state-dir for every wsync run: each is wsync's first contact with "
        "the link (no remembered link rate; see --compress-level in wsync pull --help)",
    )
    args = parser.parse_args()
    root = args.workdir.resolve()
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["rm", "-rf", str(root / "out")], check=True)
    big, small = stdlib_tree(root, args.quick), small_tree(root)
    compile_wsync()
    subprocess.run(["tar", "-cf", "/dev/null", "-C", str(big), "."], check=True)  # warm cache
    results: list[dict[str, object]] = []
    ratios: dict[str, float] = {}
    py = shlex.quote(sys.executable)
    archive = root / "floor.tar.zst"  # the stream's own bytes, for --floor
    if args.floor and "loopback" in (args.only or SCENARIOS):
        run(
            f"tar -cf - -C {shlex.quote(str(big))} . | zstd -q -c -T0 > {shlex.quote(str(archive))}"
        )
    with SshdServer(root / "sshd") as sshd:
        assert sshd.session_home is not None
        opts = sshd.transport_options()
        key = str(opts["ssh_key"])
        state = root / "state"
        stage = root / "guest-staging"
        subprocess.run(["rm", "-rf", str(stage)], check=True)

        def commands(port: int, ws: Path) -> dict[str, Callable[[Path], str]]:
            kh = str(root / f"known_hosts-{port}")  # the host key, pinned at this port
            Path(kh).write_text(f"[127.0.0.1]:{port} {sshd.host_public_key}\n")
            ssh = (
                f"ssh -i {shlex.quote(key)} -o UserKnownHostsFile={shlex.quote(kh)} "
                f"-o StrictHostKeyChecking=yes -o BatchMode=yes -p {port}"
            )
            src = f"{sshd.user}@127.0.0.1:{shlex.quote(str(ws))}/"
            remote = shlex.quote(f"tar -cf - -C {shlex.quote(str(ws))} . | zstd -q -c -T0")
            uri = shlex.quote(f"ssh://{sshd.user}@127.0.0.1:{port}{ws}")
            # the guest's staging root is the bench's own, emptied at the start: the
            # default (/tmp/wsync-UID) is shared with whatever else ran here, and each
            # admission looks at every leftover snapshot in it (a test suite's run left
            # 20 to 40 here, which cost a small pull about 0.1 s)
            wsync = (
                f"--json --ssh-key {shlex.quote(key)} --known-hosts {shlex.quote(kh)} "
                f"--staging-dir {shlex.quote(str(stage))}"
            )

            def state_of(d: Path) -> str:
                return shlex.quote(
                    str(d.with_name(d.name + ".state") if args.fresh_state else state)
                )

            return {
                "rsync -a": lambda d: (
                    f"rsync -a -e {shlex.quote(ssh)} {src} {shlex.quote(str(d))}/"
                ),
                "rsync -az": lambda d: (
                    f"rsync -az -e {shlex.quote(ssh)} {src} {shlex.quote(str(d))}/"
                ),
                "tar|zstd stream": lambda d: (
                    f"mkdir -p {shlex.quote(str(d))} && {ssh} 127.0.0.1 {remote} "
                    f"| zstd -q -d -c | tar -xf - -C {shlex.quote(str(d))}"
                ),
                "tar -x, local file": lambda d: (
                    f"mkdir -p {shlex.quote(str(d))} && zstd -q -d -c {shlex.quote(str(archive))} "
                    f"| tar -xf - -C {shlex.quote(str(d))}"
                ),
                "tar -x, local, synced": lambda d: (
                    f"mkdir -p {shlex.quote(str(d))} && zstd -q -d -c {shlex.quote(str(archive))} "
                    f"| tar -xf - -C {shlex.quote(str(d))} && sync -f {shlex.quote(str(d))}"
                ),
                "wsync": lambda d: (
                    f"{py} -m wsync pull {uri} {shlex.quote(str(d))} {wsync} "
                    f"--state-dir {state_of(d)}"
                ),
                "wsync openssh": lambda d: (
                    f"{py} -m wsync pull {uri} {shlex.quote(str(d))} {wsync} "
                    f"--state-dir {state_of(d)} --ssh-client openssh"
                ),
                "wsync per-call": lambda d: (
                    f"{py} -m wsync pull {uri} {shlex.quote(str(d))} {wsync} "
                    f"--state-dir {state_of(d)} --exec-per-call"
                ),
            }

        deleted_at = [0.0]

        def scenario(label: str, ws: Path, port: int, names: list[str], base: str) -> None:
            """Rounds of ``names``; every run writes a new DEST, all removed at the end.

            No tree is deleted between the runs of a scenario, and a scenario starts
            ``--settle`` seconds after the last one's trees went: for a minute after
            many deletions ext4's inode allocator skips the recently freed inodes one by
            one (``recently_deleted``), which made each file created then cost several
            times more (40% of a first pull's CPU in a profile), for whichever tool
            happened to run next.
            """
            cmds = commands(port, ws)
            if args.per_call:
                names = [*names, "wsync per-call"]
            if args.openssh:
                names = [*names, "wsync openssh"]
            walls: dict[str, list[float]] = {n: [] for n in names}
            extra: dict[str, list[dict[str, object]]] = {n: [] for n in names}
            time.sleep(max(0.0, deleted_at[0] + args.settle - time.monotonic()))
            outdir = root / "out" / label.replace(" ", "_")
            for round_no in range(args.runs):
                for name in names:
                    d = outdir / f"{name.replace(' ', '_').replace('|', '')}-{round_no}"
                    d.parent.mkdir(parents=True, exist_ok=True)
                    subprocess.run(["sync"], check=True)
                    time.sleep(0.5)
                    wall, rss, out, _ = run(cmds[name](d))
                    row: dict[str, object] = {"wall_s": round(wall, 3), "rss_mib": rss // 1024}
                    if name.startswith("wsync"):
                        res = json.loads(out)
                        row |= {
                            "execs": res.get("execs"),
                            "wire": res["transferred_bytes"],
                            "level": res.get("compress_level"),
                        }
                    row["exact"] = not diff(ws, d)
                    walls[name].append(wall)
                    extra[name].append(row)
                    print(f"  {label} {name}: {row}", file=sys.stderr)
            subprocess.run(["rm", "-rf", str(outdir)], check=True)
            subprocess.run(["sync"], check=True)
            deleted_at[0] = time.monotonic()
            for name in names:
                med = statistics.median(walls[name])
                picked = min(extra[name], key=lambda r: abs(float(r["wall_s"]) - med))  # type: ignore[arg-type]
                results.append({"scenario": label, "row": name, **picked, "wall_s": round(med, 3)})
            for ours in ("wsync", "wsync openssh", *FLOORS):
                for other in (base, "tar|zstd stream"):
                    if ours in names and other in names:
                        pairs = zip(walls[ours], walls[other], strict=True)
                        per_round = [w / o for w, o in pairs]
                        ratios[f"{label}: {ours}/{other}"] = round(statistics.median(per_round), 2)

        only = args.only or list(SCENARIOS)
        everything = ["rsync -a", "tar|zstd stream", "wsync"]
        if "loopback" in only:
            floor = list(FLOORS) if args.floor else []
            scenario("loopback", big, sshd.port, [*everything, *floor], "rsync -a")
        for label, mbit in (("100mbit", 100), ("20mbit", 20)):
            if label in only:
                with TcpProxy("127.0.0.1", sshd.port, rate=mbit * MBIT) as proxy:
                    names = ["rsync -az", "tar|zstd stream", "wsync"]
                    if mbit == 100:
                        names.insert(0, "rsync -a")
                    scenario(label, big, proxy.port, names, "rsync -az")
        if "small" in only:
            scenario("small", small, sshd.port, ["rsync -a", "wsync"], "rsync -a")
        if "slowrc" in only:
            rc = sshd.session_home / ".bashrc"
            rc.write_text("sleep 0.1\n")
            try:
                scenario("slowrc loopback", big, sshd.port, everything, "rsync -a")
                scenario("slowrc small", small, sshd.port, ["rsync -a", "wsync"], "rsync -a")
            finally:
                rc.unlink()
    print(
        f"\n{'scenario':<16} {'row':<22} {'wall s':>7} {'RSS MiB':>8} {'execs':>6} {'wire MB':>8}"
        f" {'level':>5}"
    )
    for r in results:
        wire = f"{int(r['wire']) / 1e6:.1f}" if "wire" in r else "-"  # type: ignore[call-overload]
        print(
            f"{r['scenario']!s:<16} {r['row']!s:<22} {r['wall_s']!s:>7} {r['rss_mib']!s:>8} "
            f"{r.get('execs', '-')!s:>6} {wire:>8} {r.get('level', '-')!s:>5}"
        )
    print()
    for k, v in ratios.items():
        print(f"{k:<44} {v}")
    if args.json:
        print(json.dumps({"rows": results, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
