"""A fleet daemon's ``store`` URL and its start-up: a password never in the logs.

The daemons here are real processes (``python -m wsync.daemon``) pointed at the
PostgreSQL the other fleet tests use; the redaction test runs the daemon's own
set-up in-process, since a well-formed password is never echoed by libpq and a
log line carrying it has to be made by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_daemon_harness import TOKEN, base_config


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
