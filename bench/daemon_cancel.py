#!/usr/bin/env python3
"""How long does the daemon's API stall while a big pull is being cancelled?

    PYTHONPATH=src python3 bench/daemon_cancel.py [--files 200000] [--workdir DIR]

Builds a workspace of ``--files`` small files (in ``--workdir``, reused between
runs), starts a real ``wsync daemon`` on loopback, pulls the workspace through
a configured ``local:`` sandbox, and once half of the files are in DEST's
temporary tree (the extractor is still writing) sends
``DELETE /v1/pulls/ID``.  A second thread polls ``GET /healthz`` back to back
the whole time, on a kept-alive connection.  Printed: the healthz latency
before the cancel (baseline) and from the DELETE until the job is recorded
``cancelled`` and the temporary tree is gone (max and p99), and how long the
cancel took.

Issue 7 item 11 measured a 2.5 s freeze of ``/healthz`` here when the cancel's
clean-up ran on the daemon's event loop.  This is a script, not a test:
nothing here asserts a latency.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TOKEN = secrets.token_hex(16)
PER_DIR = 500


def make_workspace(root: Path, files: int) -> Path:
    ws = root / f"ws-{files}"
    if ws.exists():
        return ws
    tmp = root / "ws.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"building a workspace of {files} files ...", file=sys.stderr)
    for i in range(files):
        d = tmp / f"d{i // PER_DIR:04d}"
        if i % PER_DIR == 0:
            d.mkdir(parents=True)
        (d / f"f{i:07d}.txt").write_bytes(f"file {i}\n".encode() * 4)
    tmp.rename(ws)
    return ws


class Daemon:
    def __init__(self, root: Path, ws: Path) -> None:
        self.root = root
        (root / "roots").mkdir(parents=True, exist_ok=True)
        config = root / "config.toml"
        config.write_text(
            f"""
state_dir = "{root}/state"
dest_roots = ["{root}/roots"]
shutdown_grace = 30

[api]
listen = "127.0.0.1:0"

[limits]
chunk_size = 262144
parallel = 2
max_files = 10000000

[sandboxes.big]
uri = "local:{ws}"
dest = "{root}/roots/big"
""",
            encoding="utf-8",
        )
        self.log = (root / "daemon.log").open("wb")
        env = {**os.environ, "WSYNC_API_TOKEN": TOKEN}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wsync.daemon", "--config", str(config)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
        )
        info = root / "state" / "daemon.json"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                data = json.loads(info.read_text(encoding="utf-8"))
                if data.get("pid") == self.proc.pid:
                    self.host, _, port = data["listen"].rpartition(":")
                    self.port = int(port)
                    return
            if self.proc.poll() is not None:
                raise SystemExit(f"daemon exited with {self.proc.returncode}")
            time.sleep(0.05)
        raise SystemExit("daemon did not start")

    def request(self, method: str, path: str, body: Any = None) -> Any:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
            conn.request(method, path, body=data, headers=headers)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Poller(threading.Thread):
    """GET /healthz back to back; records (sent_at, latency) pairs."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(daemon=True)
        self.host, self.port = host, port
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        while not self.stop.is_set():
            sent = time.monotonic()
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            self.samples.append((sent, time.monotonic() - sent))
        conn.close()


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "wsync-bc")
    parser.add_argument(
        "--at", type=float, default=0.5, help="cancel once this fraction of files is extracted"
    )
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    ws = make_workspace(args.workdir, args.files)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))
    daemon = Daemon(run_dir, ws)
    try:
        job = daemon.request("POST", "/v1/pulls", {"sandbox": "big"})
        poller = Poller(daemon.host, daemon.port)
        poller.start()
        want_dirs = int(args.at * args.files / PER_DIR)
        while True:
            now = daemon.request("GET", f"/v1/pulls/{job['id']}")
            if now["state"] not in ("running", "queued"):
                raise SystemExit(f"the pull ended before the cancel: {now['state']}")
            trees = list((run_dir / "roots").glob(".big.wsync-tmp-*"))
            if trees and len(os.listdir(trees[0])) >= want_dirs:
                break
            time.sleep(0.05)
        phase = now["progress"].get("phase")
        tmp_trees = list((run_dir / "roots").glob(".big.wsync-tmp-*"))
        cancel_at = time.monotonic()
        daemon.request("DELETE", f"/v1/pulls/{job['id']}")
        while daemon.request("GET", f"/v1/pulls/{job['id']}")["state"] != "cancelled":
            time.sleep(0.01)
        recorded = time.monotonic()
        while any(t.exists() for t in tmp_trees):
            time.sleep(0.01)
        cleaned = time.monotonic()
        time.sleep(0.2)
        poller.stop.set()
        poller.join(30)
    finally:
        daemon.stop()
    before = [lat for sent, lat in poller.samples if sent < cancel_at]
    # every request that was waiting at some moment of the cancel
    during = [lat for sent, lat in poller.samples if sent + lat >= cancel_at and sent <= cleaned]
    print(
        f"workspace: {args.files} files; cancel sent in the {phase} phase with "
        f"~{want_dirs * PER_DIR} files extracted"
    )
    print(
        f"cancel: recorded after {recorded - cancel_at:.3f}s, "
        f"tree removed after {cleaned - cancel_at:.3f}s"
    )
    for name, values in (("before cancel", before), ("during cancel", during)):
        if values:
            print(
                f"/healthz {name}: n={len(values)} max={max(values) * 1000:.1f} ms "
                f"p99={p99(values) * 1000:.1f} ms"
            )
    shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
