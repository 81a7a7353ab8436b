"""``wsync daemon``: the long-running process, its signals, sd_notify and listener.

Why the process plumbing is hand-written around uvicorn rather than left to
it: uvicorn's own SIGTERM handling stops the HTTP server but knows nothing of
in-flight pulls, and it re-raises the signal at exit (so the exit status is
not 0).  Here SIGTERM first stops the job manager (no new jobs; running pulls
cancelled, their engine journals kept, their jobs re-queued for the next
start), *then* stops the HTTP server, all within ``shutdown_grace`` seconds,
and the process exits 0.  SIGHUP reloads the config, like ``POST /v1/reload``.

sd_notify is a single datagram to ``$NOTIFY_SOCKET`` (``READY=1`` once jobs
are restored and the socket listens, ``WATCHDOG=1`` every half
``$WATCHDOG_USEC``, ``STOPPING=1`` on the way out); a few lines instead of a
dependency.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import ipaddress
import json
import os
import secrets
import signal
import socket
import stat
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import prometheus_client
import structlog
import uvicorn

import wsync
from wsync.cliargs import Parser, path_arg
from wsync.daemon import logs, sighup_held
from wsync.daemon.api import AppState, create_app
from wsync.daemon.config import (
    ConfigError,
    DaemonConfig,
    load_config,
    parse_listen,
    secret_values,
    shadowed_keys,
)
from wsync.daemon.confine import find_root
from wsync.daemon.dsn import store_secrets
from wsync.daemon.httpconn import DeadlineH11, quiet_accept_errors, raise_fd_limit
from wsync.daemon.jobs import JobManager
from wsync.daemon.metrics import Metrics
from wsync.daemon.service import JobService, LocalJobs
from wsync.daemon.store import JobStore
from wsync.digits import ascii_digits
from wsync.errors import WsyncError

log = structlog.get_logger("wsync.daemon")

#: seconds uvicorn waits for open HTTP connections after the job manager stopped
HTTP_GRACE = 3


def sd_notify(message: str) -> bool:
    """Send one sd_notify datagram; False when not run under systemd (or it failed)."""
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    elif not addr.startswith("/"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)  # a stuck manager must never block the event loop
            sock.connect(addr)
            sock.sendall(message.encode())
    except OSError as err:
        log.warning("sd_notify.failed", error=err.strerror)
        return False
    return True


def watchdog_interval() -> float | None:
    """Half of ``$WATCHDOG_USEC`` in seconds, if the watchdog is meant for this process."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not ascii_digits(usec) or int(usec) <= 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2_000_000


class _Server(uvicorn.Server):
    """uvicorn without its signal capture: the daemon owns SIGTERM/SIGINT/SIGHUP."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


#: the unix sockets this process bound, by path: (device, inode) of the file it made
_BOUND: dict[str, tuple[int, int]] = {}


def _remove_stale(path: Path) -> None:
    """Remove the socket file at ``path`` if nobody listens on it (a killed daemon's);
    OSError EADDRINUSE if a process answers there (another daemon: taking its address
    would leave it running unreachable, as TCP refuses too)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    except OSError:
        return  # not ours to judge (no access, say): bind says what is wrong
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, "Address already in use (a process answers on it)")


def bind(listen: str) -> tuple[socket.socket, str]:
    """Create the listening socket; returns it and the address actually bound."""
    target = parse_listen(listen)
    if isinstance(target, str):
        path = Path(target)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                _remove_stale(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        path.chmod(0o660)
        sock.listen(128)
        st = path.lstat()
        _BOUND[str(path)] = (st.st_dev, st.st_ino)
        return sock, f"unix:{path}"
    host, port = target
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
    return sock, f"{shown}:{bound_port}"


class Daemon:
    """One daemon process: config, lock, job manager, HTTP server, signals."""

    def __init__(self, config_path: Path | None, overrides: dict[str, Any], config: DaemonConfig):
        self.config_path = config_path
        self.overrides = overrides
        self.config = config
        self.token = config.api_token_value()
        self._stop = asyncio.Event()
        #: pull threads still busy at exit (they outlived shutdown_grace)
        self.abandoned = 0
        self._register_secrets(config)

    def _register_secrets(self, config: DaemonConfig) -> None:
        logs.register_secret(self.token)
        # psycopg_pool logs its connection errors itself, beyond wsync's own care
        for value in store_secrets(config.store):
            logs.register_secret(value)
        for box in config.sandboxes.values():
            for value in secret_values(box):
                logs.register_secret(value)

    def reload(self) -> dict[str, Any]:
        """Re-read the config; on error keep the old one and raise ConfigError."""
        try:
            new = load_config(self.config_path, self.overrides)
            token = new.api_token_value()
        except ConfigError as err:
            self.metrics.reloads.labels("failed").inc()
            log.error("config.reload_failed", error=str(err))
            raise
        fixed = ("state_dir", "store", "engine_dir", "lease_seconds")
        if new.api.listen != self.config.api.listen or any(
            getattr(new, key) != getattr(self.config, key) for key in fixed
        ):
            log.warning(
                "config.reload_partial",
                note="api.listen, state_dir, store, engine_dir and lease_seconds need a restart",
            )
            new = new.model_copy(update={key: getattr(self.config, key) for key in fixed})
        self.config = new
        self.token = token
        self._register_secrets(new)
        self.app_state.token = token
        self.manager.reload(new)
        logs.configure(new.log_level)
        self.metrics.reloads.labels("ok").inc()
        log.info("config.reloaded", sandboxes=sorted(new.sandboxes))
        self._warn_outside_roots(new)
        return {"reloaded": True, "sandboxes": sorted(new.sandboxes)}

    def _warn_outside_roots(self, config: DaemonConfig) -> None:
        """Name the running pulls whose DEST the new ``dest_roots`` no longer hold.

        New requests and queued jobs are checked against the new roots, but a
        pull already running was confined when it started and goes on writing
        (and swaps DEST) where it is; saying so is the least an operator who
        just removed a root needs, to cancel those jobs if they must not land.
        """
        outside = [
            {"job_id": job.id, "sandbox": job.sandbox, "dest": job.dest}
            for job in self.manager.running_jobs()
            if find_root(Path(job.dest), config.dest_roots, strict=True) is None
        ]
        if outside:
            log.warning(
                "config.reload_running_outside_roots",
                jobs=outside,
                note="these pulls started under the old dest_roots and keep writing there "
                "until they end; cancel them (DELETE /v1/pulls/ID) if they must not land",
            )

    def _on_sighup(self) -> None:
        with contextlib.suppress(ConfigError):
            self.reload()

    async def run(self) -> int:
        state_dir = self.config.state_dir
        try:
            state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            lock_fd = os.open(state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            log.error("state_dir.unusable", state_dir=str(state_dir), error=err.strerror)
            _say(f"cannot use state dir {state_dir}: {err.strerror}")
            return 8
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            log.error("state_dir.locked", state_dir=str(state_dir), note="another daemon runs")
            _say(
                f"state dir {state_dir} is in use by another wsync daemon{_holder(state_dir)}; "
                "stop that one first, or give this one its own --state-dir"
            )
            return 2
        try:
            return await self._run_locked(state_dir)
        finally:
            os.close(lock_fd)

    async def _run_locked(self, state_dir: Path) -> int:
        self.metrics = Metrics()
        self.manager = self._service()
        try:
            sock, address = bind(self.config.api.listen)
        except OSError as err:
            await self.manager.close()
            reason = err.strerror or str(err) or type(err).__name__  # (a too-long unix path)
            log.error("listen.failed", listen=self.config.api.listen, error=reason)
            _say(f"cannot listen on {self.config.api.listen}: {reason}")
            return 2
        self.app_state = AppState(self.manager, self.metrics, self.token, self.reload, address)
        raise_fd_limit()
        quiet_accept_errors()
        uv = uvicorn.Config(
            create_app(self.app_state),
            http=DeadlineH11,
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            proxy_headers=False,
            timeout_graceful_shutdown=HTTP_GRACE,
        )
        server = _Server(uv)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        if sighup_held():  # one came while starting: reload now that it can
            self._on_sighup()
        serving = loop.create_task(server.serve(sockets=[sock]), name="http")
        while not server.started and not serving.done():  # noqa: ASYNC110 - uvicorn has no event
            await asyncio.sleep(0.01)
        if serving.done():
            await self.manager.close()
            log.error("http.start_failed")
            return 1
        # a fleet daemon waits here up to a minute for its store: a stop must end that wait
        starting = loop.create_task(self.manager.start(), name="start")
        stop = loop.create_task(self._stop.wait(), name="stop")
        await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            log.info("daemon.stopped_while_starting")
            await self._stop_http(server, serving)
            await self.manager.close()
            _unlink_socket(address)
            return 0
        try:
            resumed = starting.result()
        except WsyncError:
            stop.cancel()
            await self._stop_http(server, serving)
            await self.manager.close()
            raise
        self.app_state.ready = True
        info = state_dir / "daemon.json"
        _write_json(info, {"pid": os.getpid(), "listen": address, "started": time.time()})
        log.info("daemon.ready", listen=address, resumed_jobs=resumed, version=wsync.__version__)
        status = f"listening on {address}; {resumed} job(s) resumed"
        sd_notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")
        watchdog = loop.create_task(self._watchdog(), name="watchdog")
        await asyncio.wait({serving, stop}, return_when=asyncio.FIRST_COMPLETED)

        log.info("daemon.stopping")
        sd_notify("STOPPING=1")
        self.app_state.ready = False
        await self.manager.shutdown(self.config.shutdown_grace)
        await self._stop_http(server, serving)
        for task in (watchdog, stop, serving):
            task.cancel()
        await asyncio.gather(watchdog, stop, serving, return_exceptions=True)
        # every job task has recorded its job by now (shutdown waited for them),
        # so nothing writes to the store after this
        await self.manager.close()
        self.abandoned = self.manager.busy_threads()
        if self.abandoned:
            log.warning(
                "shutdown.abandoned_pulls",
                threads=self.abandoned,
                note="still stopping after shutdown_grace; their journals resume next start",
            )
        with contextlib.suppress(OSError):
            info.unlink()
        _unlink_socket(address)
        log.info("daemon.stopped")
        return 0

    @staticmethod
    async def _stop_http(server: _Server, serving: asyncio.Task[None]) -> None:
        """Ask uvicorn to stop and give open connections :data:`HTTP_GRACE` seconds."""
        server.should_exit = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(serving), HTTP_GRACE + 2)

    def _service(self) -> JobService:
        """SQLite in the state dir (one daemon), or a fleet on PostgreSQL (``store``)."""
        if self.config.store is None:
            store = JobStore(self.config.state_dir / "jobs.db")
            return LocalJobs(JobManager(self.config, store, self.metrics))
        from wsync.daemon.fleet import FleetManager  # psycopg only when a fleet is configured

        return FleetManager(self.config, self.metrics)

    async def _watchdog(self) -> None:
        interval = watchdog_interval()
        if interval is None:
            return
        while True:
            sd_notify("WATCHDOG=1")
            await asyncio.sleep(interval)


def _say(message: str) -> None:
    """One plain line on stderr for a person at a terminal, beside the JSON log line."""
    print(f"wsync daemon: {message}", file=sys.stderr, flush=True)


def _unlink_socket(address: str) -> None:
    """Remove our unix socket on the way out, if the file there is still the one we bound
    (a TCP address has nothing to remove)."""
    if address.startswith("unix:"):
        path = address[len("unix:") :]
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if _BOUND.get(path) == (st.st_dev, st.st_ino):
                os.unlink(path)


def _holder(state_dir: Path) -> str:
    """`` (pid N, listening on ADDR)`` of the daemon holding ``state_dir``, if recorded."""
    try:
        info = json.loads((state_dir / "daemon.json").read_text(encoding="utf-8"))
        return f" (pid {int(info['pid'])}, listening on {info['listen']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""  # still starting, or an old file: the lock alone is the truth


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Written 0644 whatever the umask: clients trust it only when no one else can write it."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        os.fchmod(fd, 0o644)
        fh.write(json.dumps(data))
    tmp.replace(path)


def build_parser() -> Parser:
    parser = Parser(
        prog="wsync daemon",
        description="Run the wsync host daemon / sidecar (HTTP API, scheduled pulls).",
    )
    parser.add_argument(
        "--config",
        type=path_arg,
        metavar="FILE",
        help="TOML config file (config.example.toml: production; config.dev.toml: trying it)",
    )
    parser.add_argument(
        "--listen",
        metavar="ADDR",
        help="HOST:PORT or unix:PATH (overrides [api] listen and WSYNC_API__LISTEN)",
    )
    parser.add_argument(
        "--state-dir",
        type=path_arg,
        metavar="DIR",
        help="state directory (overrides state_dir and WSYNC_STATE_DIR)",
    )
    parser.add_argument(
        "--dev",
        action="store_true",
        help="for trying wsync out, never production: refuse any listen address but "
        "loopback or a unix socket, and when no token is set, generate one into "
        "[api] token_file (default STATE_DIR/api-token, mode 0600)",
    )
    return parser


def dev_token(config: DaemonConfig, overrides: dict[str, Any]) -> DaemonConfig:
    """``--dev``: loopback only, and a generated token file when no token is set.

    The token is written to a file (0600), never printed or logged: the
    clients read it from there (``wsync status --config FILE``, or
    ``$(cat FILE)`` for curl), and it survives restarts.
    """
    target = parse_listen(config.api.listen)
    if not isinstance(target, str):
        host = target[0]
        loopback = host == "localhost"
        with contextlib.suppress(ValueError):
            loopback = loopback or ipaddress.ip_address(host).is_loopback
        if not loopback:
            raise ConfigError(
                f"api.listen: --dev listens on loopback or a unix socket only, not {host}"
            )
    if config.api_token is not None and config.api_token.get_secret_value().strip():
        return config
    path = config.api.token_file or config.state_dir / "api-token"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(secrets.token_urlsafe(32) + "\n")
        except OSError as err:
            raise ConfigError(f"--dev: cannot write a token to {path}: {err.strerror}") from None
        _say(f"--dev: wrote a new API token to {path}")
    if config.api.token_file is None:
        # through the overrides, so a reload (SIGHUP) keeps using the same file
        overrides.setdefault("api", {})["token_file"] = path
        api = config.api.model_copy(update={"token_file": path})
        config = config.model_copy(update={"api": api})
    return config


def main(argv: list[str]) -> int:
    """Entry point for ``wsync daemon``; returns the process exit code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    overrides: dict[str, Any] = {}
    if args.listen:
        overrides["api"] = {"listen": args.listen}
    if args.state_dir:
        overrides["state_dir"] = args.state_dir.absolute()
    try:
        config = load_config(args.config, overrides)
        if args.dev:
            config = dev_token(config, overrides)
        daemon = Daemon(args.config, overrides, config)
        shadowed = shadowed_keys(args.config, overrides)
    except ConfigError as err:
        print(f"wsync daemon: {err}", file=sys.stderr)
        return err.exit_code
    logs.configure(config.log_level)
    # one line that says which config is in force and what overrode the file
    # (the systemd unit's WSYNC_STATE_DIR wins over the file's state_dir)
    (log.warning if shadowed else log.info)(
        "daemon.config",
        config=str(args.config.absolute()) if args.config else None,
        state_dir=str(config.state_dir),
        listen=config.api.listen,
        overridden_in_file=shadowed,
        precedence="flags > WSYNC_* environment > config file > defaults",
    )
    # *_created series only add noise here
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    try:
        code = asyncio.run(daemon.run())
    except WsyncError as err:
        log.error("daemon.failed", error=str(err), kind=err.kind)
        _say(str(err))
        return err.exit_code
    if daemon.abandoned:
        # interpreter exit would join the pulls' worker threads (thread pools
        # are joined at exit) and overrun the grace; their jobs are recorded
        # and their journals are as safe as after kill -9, so leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
