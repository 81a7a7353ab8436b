"""A token or secret file that is not UTF-8 text (found by a red-team review).

A token file saved as UTF-16 (Windows editors do, with a byte-order mark), or a
``file:`` secret that holds binary bytes, made the daemon die with a Python traceback
(exit 1, and the traceback quoted a byte of the secret: ``can't decode byte 0xff``)
instead of one ``config error`` line with exit 2; a ``POST /v1/reload`` that met such a
secret answered a bare 500 and left the reload half done (the daemon's config swapped,
its job manager still on the old one), and a pull of such a sandbox was reported as an
internal crash.  ``wsync status --token-file`` already said "not UTF-8 text".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_daemon_harness import DaemonProcess, base_config, make_tree

#: "secret-token-0123456789" as UTF-16 with its byte-order mark
UTF16 = "\ufeffsecret-token-0123456789".encode("utf-16-le")


def _start(config: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``wsync daemon --config CONFIG`` run to its end, with no ``WSYNC_`` setting of this
    environment but ``env``'s."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_")}
    return subprocess.run(
        [sys.executable, "-m", "wsync.daemon", "--config", str(config)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_token_file_that_is_not_utf8_is_one_config_error(tmp_path: Path) -> None:
    token = tmp_path / "api-token"
    token.write_bytes(UTF16)
    token.chmod(0o600)
    config = tmp_path / "c.toml"
    config.write_text(
        base_config(tmp_path).replace("[api]\n", f'[api]\ntoken_file = "{token}"\n'),
        encoding="utf-8",
    )
    result = _start(config)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "config error: api.token_file" in lines[0] and "UTF-8" in lines[0], lines
    assert "Traceback" not in result.stderr and "0xff" not in result.stderr


def test_a_file_secret_that_is_not_utf8_fails_its_pull_and_a_reload_plainly(
    tmp_path: Path,
) -> None:
    (tmp_path / "roots").mkdir()
    make_tree(tmp_path / "ws")
    secret = tmp_path / "backend-token"
    secret.write_text("good-backend-token\n", encoding="utf-8")
    secret.chmod(0o600)
    box = f"""
[sandboxes.ws]
uri = "local:{tmp_path}/ws"
dest = "{tmp_path}/roots/ws"
secrets = {{ token = "file:{secret}" }}
"""
    daemon = DaemonProcess(tmp_path, base_config(tmp_path, box))
    daemon.start()
    try:
        secret.write_bytes(UTF16)  # rotated, by someone who saved it as UTF-16
        job = daemon.pull("ws")
        failed = daemon.wait_job(job["id"], ("failed",))
        assert failed["exit_code"] == 2 and failed["error_kind"] == "usage", failed
        assert "not UTF-8" in failed["error"] and "0xff" not in failed["error"], failed
        assert "pull.crashed" not in daemon.log()

        # a reload meets the same file: it is applied whole (secrets are read when a
        # pull starts), never half, and answered in the API's shape
        daemon.config_path.write_text(
            base_config(tmp_path, box + f'\n[sandboxes.added]\nuri = "local:{tmp_path}/ws"\n'),
            encoding="utf-8",
        )
        status, answer = daemon.request("POST", "/v1/reload")
        assert status == 200 and "added" in answer["sandboxes"], answer
        status, added = daemon.request(
            "POST", "/v1/pulls", {"sandbox": "added", "dest": f"{tmp_path}/roots/added"}
        )
        assert status == 202, added
        daemon.wait_job(added["id"])
    finally:
        daemon.close()


#: 24 characters, two of them not ASCII
WIDE_TOKEN = "wsync-tökén-€-0123456789"


def test_a_token_no_client_can_send_is_refused_at_start(tmp_path: Path) -> None:
    """A token with characters outside ASCII passed the length check, and the daemon
    started with an API nobody could use: HTTP sends header bytes, the daemon compared
    them read as Latin-1 with the token's UTF-8, so ``curl -H "Authorization: Bearer
    $TOKEN"`` (UTF-8) got 401 with the right token, and Python's http.client cannot send
    ``€`` at all.  It is now refused like a short token, from either source."""
    config = tmp_path / "c.toml"
    config.write_text(base_config(tmp_path), encoding="utf-8")
    result = _start(config, WSYNC_API_TOKEN=WIDE_TOKEN)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "config error: WSYNC_API_TOKEN" in lines[0], result.stderr
    assert "ASCII" in lines[0] and WIDE_TOKEN not in result.stderr

    token = tmp_path / "api-token"
    token.write_text(WIDE_TOKEN + "\n", encoding="utf-8")
    token.chmod(0o600)
    config.write_text(
        base_config(tmp_path).replace("[api]\n", f'[api]\ntoken_file = "{token}"\n'),
        encoding="utf-8",
    )
    result = _start(config)
    assert result.returncode == 2, result.stderr
    assert "config error: api.token_file" in result.stderr and "ASCII" in result.stderr
    assert WIDE_TOKEN not in result.stderr
