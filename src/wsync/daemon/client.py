"""``wsync status [ID]`` and ``wsync jobs``: a small client of a running daemon's API.

Why the standard library (:mod:`http.client`) and not an HTTP package: these
commands make one or two requests, must work over a unix socket as well as
TCP, and should not pull an async stack into the CLI's start-up time.

Where the daemon is and which token to send: ``--url``/``--unix`` and
``--token-file`` win; else ``--config FILE`` (the same file the daemon was
started with: its ``[api] listen``, or the address the daemon actually bound
from ``STATE_DIR/daemon.json`` when readable, and its token from
``WSYNC_API_TOKEN`` or ``[api] token_file``); else ``$WSYNC_URL`` and
``$WSYNC_API_TOKEN``.  One source of truth, so ``wsync status --config FILE``
works wherever ``wsync daemon --config FILE`` does.

Exit codes: 0 on success (``status --wait`` exits with the job's own exit
code instead), 2 for usage errors, a rejected token or an unknown job, 3 when
the daemon cannot be reached.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import socket
import struct
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from wsync.cliargs import Parser, path_arg, socket_seconds
from wsync.daemon.secretfile import read_secret_file
from wsync.protocol.records import printable

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
    """Blocking JSON-over-HTTP calls to the daemon with the bearer token.

    ``owner``: the uid the daemon runs as (its state directory's owner), when the address
    came from its config.  Then the token goes only to a listener of that user or root:
    while the daemon is down any local user may listen on its address, and the next
    ``wsync status --config`` would hand them the token (found by a red-team review).  A
    unix socket's peer is asked (``SO_PEERCRED``); a TCP port's listener is looked up in
    ``/proc/net/tcp``; a remote host's cannot be, and is trusted as configured.
    """

    def __init__(
        self,
        url: str,
        unix: str | None,
        token: str,
        timeout: float = 10.0,
        owner: int | None = None,
    ) -> None:
        self.url = url
        self.unix = unix
        self.token = token
        self.timeout = timeout
        self.owner = owner

    @property
    def where(self) -> str:
        return f"unix:{self.unix}" if self.unix else self.url

    def _connection(self) -> http.client.HTTPConnection:
        if self.unix:
            return _UnixConnection(self.unix, self.timeout)
        try:  # an unclosed "[" of an IPv6 host, a port out of range or not a number
            parts = urllib.parse.urlsplit(self.url)
            port = parts.port
        except ValueError as err:
            raise ClientError(f"bad daemon URL {self.url!r}: {err}", 2) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ClientError(f"bad daemon URL {self.url!r} (expected http://HOST:PORT)", 2)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        return cls(parts.hostname, port, timeout=self.timeout)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        conn = self._connection()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.connect()
            if self.owner is not None:
                self._check_listener(conn)
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
            message = None
            if isinstance(payload, dict):  # our {"error"}, or a framework's {"detail"}
                message = payload.get("error") or payload.get("detail")
            shown = printable(str(message) if message else raw, 200)
            raise ClientError(f"daemon: HTTP {response.status}: {shown}", 2)
        return payload

    def _check_listener(self, conn: http.client.HTTPConnection) -> None:
        uid = _listener_uid(conn.sock)
        if uid is None or uid in (0, self.owner):
            return
        raise ClientError(
            f"{self.where} is held by a process of uid {uid}, not by the daemon's user "
            f"(uid {self.owner}): the token was not sent (is the daemon down, and another "
            "user's process listening on its address?)",
            3,
        )


def _listener_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of ``sock``: a unix socket's peer; for TCP,
    the owner of the listening socket of this host that took the connection (the most
    specific of ``/proc/net/tcp`` and ``tcp6`` for its address and port: the address
    itself, then a wildcard of its family), None for a peer that
    is not this host (a remote daemon, trusted as configured).  A listener is asked, not
    the connection's own socket: before it is accepted that one shows uid 0 on older
    kernels, and a squatter that waits to accept would pass (a review's finding).  A
    peer of this host whose listener cannot be found is a :class:`ClientError`."""
    if sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", creds)[1])
    (peer, port), (mine, _) = _endpoint(sock.getpeername()), _endpoint(sock.getsockname())
    best: tuple[int, int] | None = None  # (how specific, uid)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8 or fields[3] != "0A":  # LISTEN
                continue
            address, listening = _proc_endpoint(fields[1])
            if listening != port:
                continue
            if address == peer:
                rank = 2
            elif address.is_unspecified and address.version == peer.version:
                rank = 1
            else:
                continue  # (an IPv6 wildcard may be IPv6-only: /proc does not say)
            if best is None or rank > best[0]:
                best = rank, int(fields[7])
    if best is not None:
        return best[1]
    if peer == mine or peer.is_loopback:
        raise ClientError(f"cannot tell who listens on {peer}:{port}: the token was not sent", 3)
    return None


def _endpoint(name: tuple[Any, ...]) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """(address, port) of a socket name, an IPv4-mapped IPv6 address as the IPv4 one."""
    address = ipaddress.ip_address(name[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped, int(name[1])
    return address, int(name[1])


def _proc_endpoint(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``/proc/net/tcp``'s ``HEXADDR:HEXPORT`` (the address in 32-bit words of host order)."""
    addr, _, port = field.partition(":")
    raw = b"".join(bytes.fromhex(addr[i : i + 8])[::-1] for i in range(0, len(addr), 8))
    return _endpoint((str(ipaddress.ip_address(raw)), int(port, 16)))


#: the plain-text help of ``wsync status`` (argparse shows it as written)
STATUS_DESCRIPTION = (
    "Show a running wsync daemon's state, or one job's: its state, progress, "
    "outcome and faults. With --wait, block until the job ends and exit with "
    "the job's own exit code (the same codes as wsync pull)."
)
#: the plain-text help of ``wsync jobs``
JOBS_DESCRIPTION = "List a running wsync daemon's jobs, newest first."
#: how the daemon and the token are found, shown under both commands' --help
CLIENT_EPILOG = (
    "Finding the daemon and its token: --url/--unix and --token-file win; "
    "else --config FILE (the daemon's own config: its listen address, or the "
    "address it bound as recorded in STATE_DIR/daemon.json, and its token from "
    "WSYNC_API_TOKEN or [api] token_file); else $WSYNC_URL (default "
    f"{DEFAULT_URL}) and $WSYNC_API_TOKEN. "
    "Exit codes: 0 ok, 2 usage error / rejected token / unknown job, "
    "3 daemon unreachable."
)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=path_arg,
        metavar="FILE",
        help="the daemon's TOML config: take the address and the token from it",
    )
    parser.add_argument(
        "--url",
        default=None,
        help=f"daemon API URL (default: from --config, else $WSYNC_URL, else {DEFAULT_URL})",
    )
    parser.add_argument(
        "--unix",
        metavar="PATH",
        help="talk to the daemon over this unix socket (listen = unix:PATH)",
    )
    parser.add_argument(
        "--token-file",
        type=path_arg,
        metavar="FILE",
        help="file holding the API token (default: from --config, else $WSYNC_API_TOKEN)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--timeout",
        type=socket_seconds,
        default=10.0,
        metavar="S",
        help="seconds per request (10)",
    )


def _from_config(path: Path) -> tuple[str, str, int]:
    """(listen address, token, the daemon's uid) of the daemon configured by ``path``.

    The config is read exactly as the daemon reads it (environment overrides
    included), so both agree.  The address the daemon actually bound (port 0,
    or a ``--listen`` flag) is preferred when ``daemon.json`` is readable.  The
    daemon's uid is its state directory's owner (ours where there is none yet).
    """
    # imported here: pydantic is only worth its start-up time with --config
    from wsync.daemon.config import ConfigError, load_config

    try:
        config = load_config(path)
        token = config.api_token_value()
    except ConfigError as err:
        raise ClientError(f"{path}: {err}", 2) from None
    bound = _bound_address(config.state_dir)
    try:
        owner = config.state_dir.stat().st_uid
    except OSError:
        owner = os.geteuid()
    return bound or config.api.listen, token, owner


def _bound_address(state_dir: Path) -> str | None:
    """The address in ``STATE_DIR/daemon.json``, if the file can be trusted.

    The token is sent to this address, so a file that someone other than the
    state directory's owner could have written (or planted in a directory
    others can write to), or a state directory owned by neither us nor root,
    is ignored: the configured address is used instead.
    """
    try:
        fd = os.open(state_dir / "daemon.json", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None  # not running, or not readable by this user
    try:
        dir_st = os.stat(state_dir)
        file_st = os.fstat(fd)
        loose = (dir_st.st_mode | file_st.st_mode) & 0o022
        # owned by us or root: another local user who created the state dir first
        # (somewhere shared) must not choose where our token goes
        trusted = dir_st.st_uid in (0, os.geteuid())
        if loose or file_st.st_uid != dir_st.st_uid or not trusted:
            return None
        with os.fdopen(os.dup(fd), encoding="utf-8") as fh:
            info = json.loads(fh.read(65536))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    listen = info.get("listen") if isinstance(info, dict) else None
    return listen if isinstance(listen, str) else None


def _url_for(listen: str) -> tuple[str, str | None]:
    """A listen address (``HOST:PORT`` or ``unix:PATH``) as (URL, unix socket path)."""
    if listen.startswith("unix:"):
        return DEFAULT_URL, listen[len("unix:") :]
    host, _, port = listen.rpartition(":")
    wildcard = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}  # noqa: S104
    return f"http://{wildcard.get(host, host)}:{port}", None


def _client(args: argparse.Namespace) -> DaemonClient:
    url = os.environ.get("WSYNC_URL", DEFAULT_URL)
    unix: str | None = None
    token = os.environ.get("WSYNC_API_TOKEN", "")
    owner: int | None = None
    if args.config is not None:
        listen, token, owner = _from_config(args.config)
        url, unix = _url_for(listen)
    if args.url is not None:
        url, unix, owner = args.url, None, None  # the address the caller named
    if args.unix:
        unix, owner = args.unix.removeprefix("unix:"), None
    if args.token_file is not None:
        try:
            text, too_open = read_secret_file(args.token_file)
        except OSError as err:
            raise ClientError(f"cannot read {args.token_file}: {err.strerror}", 2) from None
        except UnicodeDecodeError:
            raise ClientError(f"{args.token_file}: not UTF-8 text", 2) from None
        if too_open:
            # a warning, not a refusal: the token is out already, and a Kubernetes
            # Secret volume is 0644 unless its defaultMode says otherwise
            print(f"wsync: warning: {printable(too_open, 1000)}", file=sys.stderr)
        token = text.strip()
    if not token:
        raise ClientError(
            "no API token: pass --config (the daemon's config), --token-file, "
            "or set WSYNC_API_TOKEN",
            2,
        )
    if any(c in token for c in "\r\n\x00") or not token.isascii():
        # never echo it: it goes into a header, and a bad one would surface in a traceback
        raise ClientError("the API token contains a line break, NUL or non-ASCII text", 2)
    return DaemonClient(url, unix, token, args.timeout, owner)


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
    # a job's dest, sandbox and error come from whoever called the API: no terminal
    # escapes, no line breaks
    rows = [[printable(cell, 1000) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _print_job(job: dict[str, Any]) -> None:
    keys = ("id", "state", "sandbox", "uri", "dest", "trigger", "attempts", "exit_code", "error")
    for key in keys:
        if job.get(key) is not None:
            print(f"{key:<10} {printable(str(job[key]), 1000)}")
    print(f"{'created':<10} {_age(job.get('created_at'))} ago")
    print(f"{'summary':<10} {printable(_summary(job), 1000)}")
    faults = (job.get("result") or job.get("progress") or {}).get("faults") or {}
    if faults:
        print(f"{'faults':<10} " + ", ".join(f"{k}={v}" for k, v in sorted(faults.items())))


def status_main(argv: list[str]) -> int:
    """``wsync status [ID]``: the daemon's state, or one job's (``--wait`` for it to end)."""
    parser = status_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return _status(args)


def status_parser() -> Parser:
    """The parser of ``wsync status`` (also walked for completion and the man page)."""
    parser = Parser(prog="wsync status", description=STATUS_DESCRIPTION, epilog=CLIENT_EPILOG)
    parser.add_argument(
        "id", nargs="?", metavar="ID", help="a job id (omit for the daemon's own status)"
    )
    parser.add_argument(
        "--wait", action="store_true", help="wait for the job to end; exit with its exit code"
    )
    _common(parser)
    return parser


def _status(args: argparse.Namespace) -> int:
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


def jobs_parser() -> Parser:
    """The parser of ``wsync jobs`` (also walked for completion and the man page)."""
    parser = Parser(prog="wsync jobs", description=JOBS_DESCRIPTION, epilog=CLIENT_EPILOG)
    parser.add_argument(
        "--state",
        action="append",
        choices=("queued", "running", "succeeded", "failed", "cancelled"),
        help="only jobs in this state (repeatable)",
    )
    parser.add_argument("--sandbox", metavar="NAME", help="only jobs of this sandbox")
    parser.add_argument(
        "--limit", type=int, default=50, metavar="N", help="at most this many jobs (50)"
    )
    _common(parser)
    return parser


def jobs_main(argv: list[str]) -> int:
    """``wsync jobs``: list the daemon's jobs, newest first."""
    parser = jobs_parser()
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
