"""A token or secret file other users can read (found by a red-team review).

``head -c 32 /dev/urandom | base64 > /etc/wsync/api-token`` under the usual umask 022
leaves the token world-readable, and the daemon took it without a word: any local user
then held the API.  The API token file is now refused the way ssh refuses a private key
others can read (a config error, exit 2, one line saying ``chmod 600 FILE``); a ``file:``
secret of a sandbox is warned about (a Kubernetes secret volume is 0644 by default).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from test_daemon_harness import base_config
from wsync.daemon.client import status_main
from wsync.daemon.config import (
    ConfigError,
    SandboxConfig,
    load_config,
    resolve_transport_options,
)

TOKEN = "0123456789abcdef0123456789abcdef"


def token_config(tmp_path: Path, mode: int) -> tuple[Path, Path]:
    token = tmp_path / "api-token"
    token.write_text(TOKEN + "\n", encoding="utf-8")
    token.chmod(mode)
    config = tmp_path / "c.toml"
    text = base_config(tmp_path).replace("[api]\n", f'[api]\ntoken_file = "{token}"\n')
    config.write_text(text, encoding="utf-8")
    return token, config


def start(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The daemon with no token but the file's; it must stop at once (else: killed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_")}
    try:
        return subprocess.run(
            [sys.executable, "-m", "wsync.daemon", "--config", str(config), *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the daemon started with a token file other users can read")


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620, 0o666])
def test_a_token_file_other_users_can_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    token, config = token_config(tmp_path, mode)
    with pytest.raises(ConfigError, match=f"chmod 600 {token}"):
        load_config(config, {}).api_token_value()


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640])
def test_a_token_file_for_the_daemon_and_its_group_only_is_taken(tmp_path: Path, mode: int) -> None:
    """0640 is the documented systemd setup (root-owned, group wsync, umask 027)."""
    _token, config = token_config(tmp_path, mode)
    assert load_config(config, {}).api_token_value() == TOKEN


@pytest.mark.parametrize("dev", [False, True])
def test_the_daemon_refuses_a_world_readable_token_file_in_one_line_with_exit_2(
    tmp_path: Path, dev: bool
) -> None:
    """``--dev`` reads an existing token file the same way (it writes a new one 0600)."""
    token, config = token_config(tmp_path, 0o644)
    result = start(config, *(["--dev"] if dev else []))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"chmod 600 {token}" in lines[0], result.stderr
    assert TOKEN not in result.stderr


def test_a_file_secret_other_users_can_read_is_used_with_a_warning(tmp_path: Path) -> None:
    secret = tmp_path / "sprites-token"
    secret.write_text("a-backend-token\n", encoding="utf-8")
    box = SandboxConfig(uri="sprites://box/work", secrets={"token": f"file:{secret}"})
    for mode, warned in ((0o644, True), (0o600, False)):
        secret.chmod(mode)
        with structlog.testing.capture_logs() as logs:
            assert resolve_transport_options(box)["token"] == "a-backend-token"
        found = [e for e in logs if e["event"] == "secret.file_too_open"]
        assert bool(found) == warned, logs
        if warned:
            assert f"chmod 600 {secret}" in found[0]["problem"]
            assert "a-backend-token" not in str(found[0])


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o604, True), (0o600, False)])
def test_the_client_warns_of_a_token_file_others_can_read(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    mode: int,
    warned: bool,
) -> None:
    """``wsync status --token-file`` read the token whatever the file's mode, where the
    daemon refuses the same file.  It now says so, as the daemon would, and goes on (the
    token is out already; a Kubernetes Secret volume is 0644 unless told otherwise)."""
    monkeypatch.delenv("WSYNC_API_TOKEN", raising=False)
    token = tmp_path / "cli-token"
    token.write_text(TOKEN + "\n", encoding="utf-8")
    token.chmod(mode)
    assert status_main(["--url", "http://127.0.0.1:9", "--token-file", str(token)]) == 3
    err = capsys.readouterr().err
    assert "cannot reach" in err  # it went on to the daemon
    assert (f"wsync: warning: {token} can be read or written by" in err) == warned, err
    assert "chmod 600" in err if warned else TOKEN not in err
