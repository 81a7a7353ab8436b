"""A fleet daemon's ``store`` URL and its start-up: a password never in the logs, a store
that is down at start-up waited for (and a stop honoured meanwhile).

The daemons here are real processes (``python -m wsync.daemon``) pointed at the
PostgreSQL the other fleet tests use; the redaction test runs the daemon's own
set-up in-process, since a well-formed password is never echoed by libpq and a
log line carrying it has to be made by hand.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from test_daemon_fleet import pg_dsn
from test_daemon_harness import TOKEN, DaemonProcess, assert_same_tree, base_config, make_tree
from wsync.testing.pg import with_address
from wsync.testing.tcpproxy import TcpProxy

__all__ = ["pg_dsn"]  # the fixture, used by name


def _fleet_env(tmp: Path, store: str) -> dict[str, str]:
    return {
        "WSYNC_API_TOKEN": TOKEN,
        "WSYNC_STORE": store,
        "WSYNC_ENGINE_DIR": str(tmp / "engine"),
    }


@pytest.mark.parametrize("password", ["S3cr%zzPass", "p4ss w0rd-Qx", "pa/ss-w0rd", "p@ss-w0rd"])
def test_a_store_url_libpq_cannot_read_is_a_config_error_that_never_shows_the_password(
    tmp_path: Path, password: str
) -> None:
    """Before: the daemon started and psycopg_pool logged libpq's complaint, quoting the
    password, about once a second (and gave up after a minute with exit 8).  Now: exit 2 at
    once, one line naming ``store`` and saying to percent-encode, and no part of the value."""
    config = tmp_path / "config.toml"
    config.write_text(base_config(tmp_path), encoding="utf-8")
    store = f"postgresql://postgres:{password}@127.0.0.1:5432/postgres"
    proc = subprocess.Popen(
        [sys.executable, "-m", "wsync.daemon", "--config", str(config)],
        env={**_environ(), **_fleet_env(tmp_path, store)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the daemon kept running with a malformed store URL:\n{out[-3000:]}")
    assert proc.returncode == 2, out
    assert "config error: store:" in out and "percent-encode" in out, out
    for part in (password, *password.replace("%", " ").replace("/", " ").replace("@", " ").split()):
        if len(part) >= 3:
            assert part not in out, out


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_")}


def test_the_store_password_is_masked_in_log_lines_in_both_of_its_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The password of a good URL is registered with the log redaction as written
    (``p%40ss…``) and decoded (``p@ss…``): a line of psycopg_pool's own naming either
    form (the daemon's log processor handles stdlib loggers too) shows neither."""
    from wsync.daemon.config import load_config
    from wsync.daemon.logs import REDACTED, redact
    from wsync.daemon.server import Daemon

    config = tmp_path / "config.toml"
    config.write_text(base_config(tmp_path), encoding="utf-8")
    for key, value in _fleet_env(
        tmp_path, "postgresql://wsync:p%40ss-Zq7-w0rd@127.0.0.1:5432/wsync?password=qry%20Pw-91x"
    ).items():
        monkeypatch.setenv(key, value)
    Daemon(config, {}, load_config(config))
    line = (
        "error connecting in 'wsync-store': password 'p%40ss-Zq7-w0rd' or 'p@ss-Zq7-w0rd' "
        "or 'qry%20Pw-91x' or 'qry Pw-91x' rejected"
    )
    event = redact(None, "warning", {"event": line, "logger": "psycopg.pool"})
    shown = str(event["event"])
    for secret in ("p%40ss-Zq7-w0rd", "p@ss-Zq7-w0rd", "qry%20Pw-91x", "qry Pw-91x", "Zq7", "91x"):
        assert secret not in shown, shown
    assert shown.count(REDACTED) == 4, shown


def _closed_port() -> int:
    """A loopback port nothing listens on (connections are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(daemon: DaemonProcess, prelude: str = "") -> subprocess.Popen[bytes]:
    """Start ``daemon`` without waiting for it to be ready; ``prelude``: Python run first."""
    daemon.state_dir.mkdir(parents=True, exist_ok=True)
    code = f"{prelude}\nimport runpy\nrunpy.run_module('wsync.daemon', run_name='__main__')"
    with daemon.log_path.open("ab") as log:
        daemon.proc = subprocess.Popen(
            [sys.executable, "-c", code, "--config", str(daemon.config_path)],
            env=daemon.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    return daemon.proc


def _catches(pid: int, sig: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (sig - 1)))
    return False


def _store_daemon(tmp: Path, store: str, sandboxes: str = "") -> DaemonProcess:
    """A daemon in ``tmp/d`` (its state dir ``tmp/d/state``, dest root ``tmp/d/roots``)."""
    root = tmp / "d"
    (root / "roots").mkdir(parents=True, exist_ok=True)
    return DaemonProcess(root, base_config(root, sandboxes), _fleet_env(tmp, store))


def test_a_store_down_longer_than_one_connect_wait_at_start_up_is_joined_when_back(
    tmp_path: Path, pg_dsn: str
) -> None:
    """PostgreSQL (behind a proxy that refuses every connection) is unreachable for
    13 s from the daemon's first attempt, longer than one 10 s connect wait.  Before:
    that wait closed the pool for good and every retry failed with ``PoolClosed`` until
    the daemon gave up (exit 8).  Now each attempt has a pool of its own, and the daemon
    joins once the store is back.  (The 13 s are counted from the first refused
    connection, not from the launch: on a loaded machine the daemon's start took 3 s
    of them, and the store came back inside the first wait.)"""
    make_tree(tmp_path / "ws", seed=90)
    server = urllib.parse.urlsplit(pg_dsn)
    box = f'[sandboxes.ws]\nuri = "local:{tmp_path}/ws"\ndest = "{tmp_path}/d/roots/ws"\n'
    with TcpProxy(server.hostname or "127.0.0.1", server.port or 5432) as proxy:
        proxy.cut()
        through = with_address(pg_dsn, "127.0.0.1", proxy.port)
        daemon = _store_daemon(tmp_path, through, box)
        restore = threading.Timer(13.0, proxy.restore)
        try:
            _launch(daemon)
            daemon.wait_until(
                lambda: proxy.refused > 0, timeout=45, what="the daemon's first connect"
            )
            restore.start()
            info = daemon.state_dir / "daemon.json"
            daemon.wait_until(info.exists, timeout=45, what="the daemon joining the fleet")
            assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()
            daemon.address = json.loads(info.read_text())["listen"]
            done = daemon.wait_job(daemon.pull("ws")["id"], timeout=60)
            log = daemon.log()
        finally:
            restore.cancel()
            daemon.close()
    assert done["state"] == "succeeded"
    assert_same_tree(tmp_path / "ws", tmp_path / "d" / "roots" / "ws")
    assert "PoolTimeout" in log and "PoolClosed" not in log, log


def test_sigterm_while_waiting_for_the_store_at_start_up_stops_the_daemon_at_once(
    tmp_path: Path,
) -> None:
    """Before: SIGTERM was only looked at once the store wait (up to a minute) was over,
    past systemd's stop timeout; the daemon then exited 8.  Now it ends the wait: exit 0."""
    daemon = _store_daemon(tmp_path, f"postgresql://wsync@127.0.0.1:{_closed_port()}/wsync")
    proc = _launch(daemon)
    try:
        daemon.wait_until(
            lambda: proc.poll() is not None or _catches(proc.pid, signal.SIGTERM),
            what="the daemon's SIGTERM handler",
        )
        assert proc.poll() is None, daemon.log()
        time.sleep(1.0)  # well inside the first connect wait
        proc.send_signal(signal.SIGTERM)
        code = daemon.wait_exit(timeout=25)
    finally:
        daemon.close()
    assert code == 0, daemon.log()
    assert "daemon.stopped_while_starting" in daemon.log()


def test_a_store_unreachable_for_the_whole_start_up_wait_says_so_plainly(tmp_path: Path) -> None:
    """The start-up wait (cut to 3 s here) runs out: the error names the store, not a
    "host write failed", and a plain ``wsync daemon:`` line is on stderr."""
    daemon = _store_daemon(tmp_path, f"postgresql://wsync@127.0.0.1:{_closed_port()}/wsync")
    _launch(daemon, "import wsync.daemon.fleet as fleet\nfleet.START_TIMEOUT = 3.0")
    try:
        code = daemon.wait_exit(timeout=60)
    finally:
        daemon.close()
    log = daemon.log()
    assert code == 8, log
    assert "host write failed" not in log, log
    assert "wsync daemon: job store: unreachable at start-up, gave up after 3 s" in log, log
