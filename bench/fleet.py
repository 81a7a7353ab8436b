#!/usr/bin/env python3
"""Throughput of a daemon fleet on one PostgreSQL, and how fast a kill -9 is taken over.

    PYTHONPATH=src python3 bench/fleet.py [--pulls 60] [--daemons 1,2,3] [--lease 5]

For each fleet size N: a scratch database (``wsync.testing.pg``, on the server
at ``WSYNC_TEST_PG`` or 127.0.0.1:5432), N real ``wsync daemon`` processes on
loopback sharing ``dest_roots`` and ``engine_dir``, and ``--pulls`` distinct
``local:`` sandboxes (small trees of 22 files, ~300 KB) submitted round-robin to
the daemons at once.  Printed: wall time from the first POST until every job
has succeeded, as pulls per minute.  Each daemon has ``max_concurrent = 2``, so
the fleet's capacity grows with N; on a machine whose cores are the bottleneck
it will not grow linearly.

Then the takeover: two daemons, lease ``--lease`` seconds, one pull of a 48 MiB
file (128 KiB chunks, one at a time); once 8 chunks are journaled the owner is
killed with SIGKILL, and the time from the kill until the survivor's claim (its
``wsync_attempts`` row) and until the job succeeded is printed, with how many
chunks the survivor resumed from the shared journal.  The claim comes at most
one lease plus one claim poll (1 s) after the owner's last renewal.

A script, not a test: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from wsync.testing.pg import scratch_database

TOKEN = secrets.token_hex(16)


def make_tree(root: Path, seed: int, big: int = 0) -> None:
    rng = random.Random(seed)
    (root / "src").mkdir(parents=True)
    for i in range(20):
        (root / "src" / f"m{i}.py").write_text(f"X = {rng.random()}\n" * (i + 1))
    (root / "README.md").write_text(f"workspace {seed}\n")
    (root / "blob.bin").write_bytes(rng.randbytes(300_000))
    if big:
        (root / "big.bin").write_bytes(os.urandom(big))


class Daemon:
    def __init__(self, root: Path, config: str) -> None:
        self.root = root
        root.mkdir(parents=True)
        (root / "config.toml").write_text(config)
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self) -> None:
        log = (self.root / "daemon.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wsync.daemon", "--config", str(self.root / "config.toml")],
            env={**os.environ, "WSYNC_API_TOKEN": TOKEN},
            stdout=log,
            stderr=log,
        )

    def wait_ready(self) -> None:
        info = self.root / "state" / "daemon.json"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                self.address = json.loads(info.read_text())["listen"]
                return
            time.sleep(0.05)
        raise SystemExit(f"daemon in {self.root} did not start")

    def request(self, method: str, path: str, body: Any = None) -> Any:
        host, _, port = self.address.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        conn.request(method, path, json.dumps(body) if body else None, headers)
        data = json.loads(conn.getresponse().read())
        conn.close()
        return data

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def config(tmp: Path, root: Path, dsn: str, boxes: str, lease: float) -> str:
    return f"""
state_dir = "{root}/state"
dest_roots = ["{tmp}/roots"]
engine_dir = "{tmp}/engine"
store = "{dsn}"
lease_seconds = {lease}
[api]
listen = "127.0.0.1:0"
[limits]
max_concurrent = 2
chunk_size = 131072
{boxes}
"""


def fleet(tmp: Path, dsn: str, boxes: str, n: int, lease: float) -> list[Daemon]:
    daemons = [
        Daemon(tmp / f"d{i}", config(tmp, tmp / f"d{i}", dsn, boxes, lease)) for i in range(n)
    ]
    for d in daemons:
        d.start()
    for d in daemons:
        d.wait_ready()
    return daemons


def wait_done(daemon: Daemon, ids: list[str], timeout: float = 600) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = [daemon.request("GET", f"/v1/pulls/{i}") for i in ids]
        if all(j.get("state") in ("succeeded", "failed", "cancelled") for j in jobs):
            return jobs
        time.sleep(0.1)
    raise SystemExit("jobs did not finish")


def throughput(work: Path, n: int, pulls: int, lease: float) -> float:
    tmp = Path(tempfile.mkdtemp(dir=work, prefix=f"fleet{n}-"))
    (tmp / "roots").mkdir()
    boxes = ""
    for i in range(pulls):
        make_tree(tmp / f"ws{i}", seed=i)
        boxes += f'[sandboxes.s{i}]\nuri = "local:{tmp}/ws{i}"\ndest = "{tmp}/roots/s{i}"\n'
    with scratch_database() as dsn:
        daemons = fleet(tmp, dsn, boxes, n, lease)
        try:
            started = time.monotonic()
            ids = [
                daemons[i % n].request("POST", "/v1/pulls", {"sandbox": f"s{i}"})["id"]
                for i in range(pulls)
            ]
            jobs = wait_done(daemons[0], ids)
            elapsed = time.monotonic() - started
        finally:
            for d in daemons:
                d.kill()
    bad = [j for j in jobs if j["state"] != "succeeded"]
    if bad:
        raise SystemExit(f"{len(bad)} pulls did not succeed: {bad[0]}")
    return pulls / elapsed * 60


def takeover(work: Path, lease: float) -> None:
    tmp = Path(tempfile.mkdtemp(dir=work, prefix="takeover-"))
    (tmp / "roots").mkdir()
    make_tree(tmp / "ws", seed=1, big=48 * 1024 * 1024)
    boxes = f'[sandboxes.big]\nuri = "local:{tmp}/ws"\ndest = "{tmp}/roots/big"\nparallel = 1\n'
    with scratch_database() as dsn:
        import psycopg

        daemons = fleet(tmp, dsn, boxes, 2, lease)
        try:
            job = daemons[0].request("POST", "/v1/pulls", {"sandbox": "big"})["id"]
            while True:
                state = daemons[0].request("GET", f"/v1/pulls/{job}")
                if state["state"] == "running" and (state["progress"].get("chunks_done") or 0) >= 8:
                    break
                time.sleep(0.05)
            with psycopg.connect(dsn) as conn:
                row = conn.execute("SELECT owner FROM wsync_jobs WHERE id = %s", (job,)).fetchone()
            assert row is not None
            pid = int(str(row[0]).split(":")[1])
            owner = next(d for d in daemons if d.proc and d.proc.pid == pid)
            other = next(d for d in daemons if d is not owner)
            os.kill(pid, signal.SIGKILL)
            killed = time.time()
            owner.proc.wait() if owner.proc else None
            done = wait_done(other, [job])[0]
            finished = time.time()
            with psycopg.connect(dsn) as conn:
                claims = conn.execute(
                    "SELECT extract(epoch FROM started_at)::float8 FROM wsync_attempts "
                    "WHERE job_id = %s AND takeover",
                    (job,),
                ).fetchall()
        finally:
            for d in daemons:
                d.kill()
    result = done["result"]
    print(
        f"takeover after kill -9 (lease {lease:g}s): claimed {claims[0][0] - killed:.2f}s after "
        f"the kill, succeeded {finished - killed:.2f}s after; resumed {result['resumed_chunks']} "
        f"of {result['chunks']} chunks (reconciled snapshot: {result['reconciled']})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pulls", type=int, default=60)
    parser.add_argument("--daemons", default="1,2,3")
    parser.add_argument("--lease", type=float, default=5.0)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="wsync-bench-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"cores: {os.cpu_count()}, load: {os.getloadavg()[0]:.1f}")
    for n in (int(x) for x in args.daemons.split(",")):
        rate = throughput(work, n, args.pulls, args.lease)
        print(f"{n} daemon(s): {rate:.0f} pulls/minute ({args.pulls} pulls, max_concurrent 2 each)")
    takeover(work, args.lease)


if __name__ == "__main__":
    main()
