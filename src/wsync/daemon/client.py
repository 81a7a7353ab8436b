"""``wsync status [ID]`` and ``wsync jobs``: a small client of a running daemon's API.

Why the standard library (:mod:`http.client`) and not an HTTP package: these
commands make one or two requests, must work over a unix socket as well as
TCP, and should not pull an async stack into the CLI's start-up time.

Exit codes: 0 on success (``status --wait`` exits with the job's own exit
code instead), 2 for usage errors, a rejected token or an unknown job, 3 when
the daemon cannot be reached.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8477"
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


class ClientError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a unix stream socket (the daemon's ``listen = "unix:/path"``)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class DaemonClient:
    """Blocking JSON-over-HTTP calls to the daemon with the bearer token."""

    def __init__(self, url: str, unix: str | None, token: str, timeout: float = 10.0) -> None:
        self.url = url
        self.unix = unix
        self.token = token
        self.timeout = timeout

    @property
    def where(self) -> str:
        return f"unix:{self.unix}" if self.unix else self.url

    def _connection(self) -> http.client.HTTPConnection:
        if self.unix:
            return _UnixConnection(self.unix, self.timeout)
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ClientError(f"bad daemon URL {self.url!r} (expected http://HOST:PORT)", 2)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        return cls(parts.hostname, parts.port, timeout=self.timeout)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        conn = self._connection()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except OSError as err:
            reason = err.strerror or str(err) or type(err).__name__
            raise ClientError(
                f"cannot reach the wsync daemon at {self.where}: {reason}", 3
            ) from None
        except http.client.HTTPException as err:
            raise ClientError(f"bad answer from the daemon at {self.where}: {err!r}", 3) from None
        finally:
            conn.close()
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            raise ClientError(f"the daemon at {self.where} sent non-JSON", 3) from None
        if response.status >= 400:
            message = payload.get("error") if isinstance(payload, dict) else None
            raise ClientError(f"daemon: HTTP {response.status}: {message or raw[:200]!r}", 2)
        return payload


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get("WSYNC_URL", DEFAULT_URL),
        help=f"daemon API URL (env WSYNC_URL, default {DEFAULT_URL})",
    )
    parser.add_argument("--unix", metavar="PATH", help="talk to the daemon over a unix socket")
    parser.add_argument(
        "--token-file", type=Path, help="file holding the API token (default: $WSYNC_API_TOKEN)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request")


def _client(args: argparse.Namespace) -> DaemonClient:
    token = os.environ.get("WSYNC_API_TOKEN", "")
    if args.token_file is not None:
        try:
            token = args.token_file.read_text(encoding="utf-8").strip()
        except OSError as err:
            raise ClientError(f"cannot read {args.token_file}: {err.strerror}", 2) from None
    if not token:
        raise ClientError("no API token: set WSYNC_API_TOKEN or pass --token-file", 2)
    unix = args.unix
    if unix and unix.startswith("unix:"):
        unix = unix[len("unix:") :]
    return DaemonClient(args.url, unix, token, args.timeout)


def _age(ts: float | None) -> str:
    if not ts:
        return "-"
    secs = max(0, int(time.time() - ts))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit}"
    return f"{secs}s"


def _mib(n: Any) -> str:
    return f"{int(n or 0) / (1024 * 1024):.1f}MiB"


def _summary(job: dict[str, Any]) -> str:
    """One cell: progress while running, the outcome when done."""
    state = job["state"]
    if state == "running":
        prog = job.get("progress") or {}
        total = prog.get("chunks_total")
        chunks = f"{prog.get('chunks_done', 0)}/{total if total is not None else '?'}"
        return f"{prog.get('phase', '?')} {chunks} chunks {_mib(prog.get('bytes_fetched'))}"
    if state == "succeeded":
        res = job.get("result") or {}
        return (
            f"{res.get('files', 0)} files {_mib(res.get('bytes'))} "
            f"resumed={res.get('resumed_chunks', 0)} retries={res.get('retries', 0)}"
        )
    if job.get("error"):
        return f"exit {job.get('exit_code')}: {job['error']}"
    return ""


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _print_job(job: dict[str, Any]) -> None:
    keys = ("id", "state", "sandbox", "uri", "dest", "trigger", "attempts", "exit_code", "error")
    for key in keys:
        if job.get(key) is not None:
            print(f"{key:<10} {job[key]}")
    print(f"{'created':<10} {_age(job.get('created_at'))} ago")
    print(f"{'summary':<10} {_summary(job)}")
    faults = (job.get("result") or job.get("progress") or {}).get("faults") or {}
    if faults:
        print(f"{'faults':<10} " + ", ".join(f"{k}={v}" for k, v in sorted(faults.items())))


def status_main(argv: list[str]) -> int:
    """``wsync status [ID]``: the daemon's state, or one job's (``--wait`` for it to end)."""
    parser = argparse.ArgumentParser(prog="wsync status", description=status_main.__doc__)
    parser.add_argument("id", nargs="?", help="a job id (omit for the daemon's status)")
    parser.add_argument(
        "--wait", action="store_true", help="wait for the job to end; exit with its exit code"
    )
    _common(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        client = _client(args)
        if args.id is None:
            data = client.request("GET", "/v1/status")
            if args.json:
                print(json.dumps(data, indent=2))
            else:
                jobs = ", ".join(f"{k}={v}" for k, v in data["jobs"].items())
                print(f"wsync daemon {data['version']} on {data['listen']}")
                print(f"up {data['uptime_s']:.0f}s, ready={data['ready']}, jobs: {jobs}")
                print(f"sandboxes: {', '.join(data['sandboxes']) or '(none)'}")
            return 0
        path = f"/v1/pulls/{urllib.parse.quote(args.id, safe='')}"
        job = client.request("GET", path)
        while args.wait and job["state"] in ("queued", "running"):
            time.sleep(0.5)
            job = client.request("GET", path)
        if args.json:
            print(json.dumps(job, indent=2))
        else:
            _print_job(job)
        if args.wait:
            code = job.get("exit_code")
            return int(code) if code is not None else 1
        return 0
    except ClientError as err:
        print(f"wsync status: {err}", file=sys.stderr)
        return err.exit_code


def jobs_main(argv: list[str]) -> int:
    """``wsync jobs``: list the daemon's jobs, newest first."""
    parser = argparse.ArgumentParser(prog="wsync jobs", description=jobs_main.__doc__)
    parser.add_argument("--state", action="append", help="only jobs in this state (repeatable)")
    parser.add_argument("--sandbox", help="only jobs of this sandbox")
    parser.add_argument("--limit", type=int, default=50, help="at most this many jobs")
    _common(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    query: list[tuple[str, str]] = [("limit", str(args.limit))]
    query += [("state", s) for s in args.state or []]
    if args.sandbox:
        query.append(("sandbox", args.sandbox))
    try:
        data = _client(args).request("GET", "/v1/pulls?" + urllib.parse.urlencode(query))
    except ClientError as err:
        print(f"wsync jobs: {err}", file=sys.stderr)
        return err.exit_code
    jobs = data["jobs"]
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    if not jobs:
        print("no jobs")
        return 0
    rows = [["ID", "STATE", "SANDBOX", "DEST", "AGE", "SUMMARY"]]
    rows += [
        [j["id"], j["state"], j["sandbox"], j["dest"], _age(j["created_at"]), _summary(j)]
        for j in jobs
    ]
    print(_table(rows))
    return 0
