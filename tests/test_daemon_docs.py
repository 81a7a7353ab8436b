"""docs/daemon.md works as written, and the daemon's first-hour UX (issue 11).

The shell examples are taken out of the Markdown and run, unchanged and in
order, as one bash script (``set -euo pipefail``) from a copy of the
checkout's ``config.dev.toml`` and ``docs/``, with ``wsync`` on ``PATH``.
The docs talk to ``127.0.0.1:8477``; so that no other daemon on this machine
can hold that port, the script runs in a fresh network namespace of its own
when the kernel allows one (root, as in CI), else only if the port is free.
Every ``sh`` block must either run or carry a ``<!-- not run: REASON -->``
line right above it, so an example cannot quietly escape the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tests.test_daemon_harness import DaemonProcess

from wsync.daemon.client import status_main
from wsync.daemon.config import load_config, shadowed_keys

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "daemon.md"
SCRIPT_TIMEOUT = 240
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*$")

#: brings the namespace's loopback up (no iproute2 needed), then runs the script
_NETNS_BOOT = """
import fcntl, os, socket, struct, sys
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sh", b"lo", 0)))[1]
    fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))
os.execvp("bash", ["bash", sys.argv[1]])
"""


def doc_blocks() -> list[tuple[str, str | None]]:
    """Every ```sh block of docs/daemon.md with its not-run reason (None: it runs)."""
    blocks: list[tuple[str, str | None]] = []
    lines = DOC.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            above = lines[i - 1] if i else ""
            match = NOT_RUN.search(above)
            end = lines.index("```", i + 1)
            blocks.append(("\n".join(lines[i + 1 : end]), match.group(1) if match else None))
            i = end
        i += 1
    return blocks


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _netns_works() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run([unshare, "-n", "true"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """What the docs' commands touch of a checkout, plus a ``wsync`` on PATH."""
    root = tmp_path / "wsync"
    root.mkdir()
    shutil.copy(REPO / "config.dev.toml", root / "config.dev.toml")
    shutil.copytree(REPO / "docs", root / "docs")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "wsync"
    shim.write_text(
        f'#!/bin/sh\nPYTHONPATH={REPO / "src"} exec {sys.executable} -m wsync "$@"\n',
        encoding="utf-8",
    )
    shim.chmod(0o755)
    return root


def test_every_shell_block_runs_or_says_why_not() -> None:
    blocks = doc_blocks()
    assert len([b for b in blocks if b[1] is None]) >= 5
    for text, reason in blocks:
        assert reason is None or reason.strip(), text
    text = DOC.read_text(encoding="utf-8")
    # -f hides the JSON error body; every example uses --fail-with-body
    assert not re.search(r"curl[^\n]*\s-f[sSN]*\s", text)


def test_daemon_doc_examples_run_as_written(checkout: Path) -> None:
    for tool in ("curl", "jq"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (the docs' examples use it)")
    script = checkout.parent / "doc.sh"
    body = "\n\n".join(text for text, reason in doc_blocks() if reason is None)
    # the trap is the harness's, not the docs': no daemon outlives a failed example
    script.write_text(
        f"set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n"
        f"cd {checkout}\n{body}\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_")}
    env["PATH"] = f"{checkout.parent / 'bin'}:{env['PATH']}"
    if _netns_works():
        argv = ["unshare", "-n", sys.executable, "-c", _NETNS_BOOT, str(script)]
    elif _port_free(8477):
        argv = ["bash", str(script)]
    else:
        pytest.skip("no network namespace here and 127.0.0.1:8477 is taken")
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=SCRIPT_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and every daemon it started
        out, err = proc.communicate()
        pytest.fail(f"the examples did not finish in {SCRIPT_TIMEOUT}s:\n{out}\n{err[-6000:]}")
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err[-6000:]}"
    # the dev token was generated, never printed
    token = (checkout / ".wsync-dev" / "api-token").read_text(encoding="utf-8").strip()
    assert len(token) >= 32 and token not in out + err
    assert "--dev: wrote a new API token" in err
    # status and jobs found the daemon and its token through --config
    assert "sandboxes: docs, docs-chaos" in out
    # the second daemon: one plain line, exit 2
    assert re.search(r"wsync daemon: state dir \S+ is in use by another wsync daemon \(pid", err)
    assert "exit code 2" in out
    # the pulls landed exact trees, the chaos one after surviving faults
    for name in ("docs", "docs-chaos"):
        _assert_same_tree(checkout / "docs", checkout / ".wsync-dev" / "workspaces" / name)
    assert re.search(r"^faults\s+\S+=\d", out, re.M)
    assert re.search(r'wsync_integrity_faults_total\{kind="[^"]+",sandbox="docs-chaos"\}', out)
    assert "/v1/pulls" in out  # openapi.json's paths
    # the error examples printed their JSON bodies
    for kind in ('"kind":"usage"', '"kind":"forbidden"', '"kind":"auth"'):
        assert kind in out, kind
    assert out.count("(curl exit 22)") == 4
    # the unix socket restart: status found the socket through daemon.json
    assert re.search(r"wsync daemon \S+ on unix:\S+api\.sock", out)


def _assert_same_tree(src: Path, dst: Path) -> None:
    def listing(root: Path) -> dict[str, bytes]:
        return {
            str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(root.rglob("*"))
        }

    assert listing(src) == listing(dst)


# -- the pieces, one at a time ----------------------------------------------------------


def test_dev_config_paths_are_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WSYNC_API_TOKEN", "x" * 20)
    config = load_config(REPO / "config.dev.toml")
    assert config.state_dir == REPO / ".wsync-dev" / "state"
    assert config.dest_roots == [REPO / ".wsync-dev" / "workspaces"]
    assert config.api.token_file == REPO / ".wsync-dev" / "api-token"
    assert config.sandboxes["docs"].uri == f"local:{REPO / 'docs'}"
    assert config.sandboxes["docs"].dest == REPO / ".wsync-dev" / "workspaces" / "docs"


def test_shadowed_keys_name_what_the_environment_and_flags_override(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        'state_dir = "/var/lib/x"\n[api]\nlisten = "127.0.0.1:1"\n[limits]\nmax_concurrent = 3\n',
        encoding="utf-8",
    )
    env = {
        "WSYNC_STATE_DIR": "/var/lib/wsync",
        "WSYNC_LIMITS__MAX_CONCURRENT": "2",
        "WSYNC_LIMITS__PARALLEL": "2",  # not in the file: nothing shadowed
        "WSYNC_URL": "http://x",  # the client's variable, not a config key
    }
    got = shadowed_keys(path, {"api": {"listen": "127.0.0.1:2"}}, env)
    assert got == [
        "limits.max_concurrent (WSYNC_LIMITS__MAX_CONCURRENT)",
        "state_dir (WSYNC_STATE_DIR)",
        "api.listen (--listen)",
    ]


def test_start_up_log_line_shows_the_state_dir_override(tmp_path: Path) -> None:
    """The systemd unit's WSYNC_STATE_DIR silently beat the file's state_dir."""
    real_state = tmp_path / "from-env"
    daemon = DaemonProcess(
        tmp_path,
        f'state_dir = "{tmp_path / "from-file"}"\n[api]\nlisten = "127.0.0.1:0"\n',
        env={"WSYNC_STATE_DIR": str(real_state)},
    )
    daemon.state_dir = real_state
    daemon.start()
    try:
        lines = [json.loads(x) for x in daemon.log().splitlines() if x.startswith("{")]
        (config_line,) = [x for x in lines if x.get("event") == "daemon.config"]
        assert config_line["level"] == "warning"
        assert config_line["state_dir"] == str(real_state)
        assert config_line["overridden_in_file"] == ["state_dir (WSYNC_STATE_DIR)"]
    finally:
        daemon.close()
    unit = (REPO / "systemd" / "wsync.service").read_text(encoding="utf-8")
    assert re.search(r"#.*WSYNC_STATE_DIR.*\n(#.*\n)*#.*state_dir", unit)


def test_status_reads_address_and_token_from_the_daemon_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("a-token-for-the-client-0123\n", encoding="utf-8")
    token_file.chmod(0o600)  # one others can read is refused
    daemon = DaemonProcess(
        tmp_path,
        f'state_dir = "state"\n[api]\nlisten = "127.0.0.1:0"\ntoken_file = "{token_file}"\n',
        env={"WSYNC_API_TOKEN": ""},
    )
    daemon.start()
    try:
        for name in ("WSYNC_API_TOKEN", "WSYNC_URL"):
            monkeypatch.delenv(name, raising=False)
        # port 0 in the file: the bound port comes from state/daemon.json
        assert status_main(["--config", str(daemon.config_path)]) == 0
        assert f"on {daemon.address}" in capsys.readouterr().out
        # without --config there is no token: a clear hint, exit 2
        assert status_main([]) == 2
        assert "--config" in capsys.readouterr().err
    finally:
        daemon.close()


def test_dev_refuses_a_non_loopback_listen_address(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_")}
    config = tmp_path / "c.toml"
    config.write_text('state_dir = "state"\n[api]\nlisten = "0.0.0.0:0"\n', encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "wsync", "daemon", "--dev", "--config", str(config)],
        env={**env, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "--dev listens on loopback or a unix socket only" in proc.stderr
    assert not (tmp_path / "state" / "api-token").exists()


def test_missing_token_file_says_how_to_get_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_")}
    shutil.copy(REPO / "config.dev.toml", tmp_path / "config.dev.toml")
    proc = subprocess.run(
        [sys.executable, "-m", "wsync", "daemon", "--config", "config.dev.toml"],
        env={**env, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "api-token does not exist" in proc.stderr and "--dev" in proc.stderr
    assert not (tmp_path / ".wsync-dev" / "api-token").exists()


def test_status_ignores_a_daemon_json_others_could_have_written(tmp_path: Path) -> None:
    """The client sends its token to the address in daemon.json: trust only the owner's."""
    from wsync.daemon.client import _bound_address

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    info = state / "daemon.json"
    info.write_text('{"pid": 1, "listen": "127.0.0.1:9"}', encoding="utf-8")
    info.chmod(0o644)
    assert _bound_address(state) == "127.0.0.1:9"
    info.chmod(0o666)
    assert _bound_address(state) is None
    info.chmod(0o644)
    state.chmod(0o777)
    assert _bound_address(state) is None
    state.chmod(0o700)
    info.unlink()
    info.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text('{"listen": "127.0.0.1:9"}', encoding="utf-8")
    assert _bound_address(state) is None


def test_no_docs_page_and_the_open_openapi_document_holds_no_data(tmp_path: Path) -> None:
    """The docs say: no /docs (404), and /openapi.json (no token) describes routes only."""
    from tests.test_daemon_harness import TOKEN, base_config

    secret_dir = tmp_path / "secret-workspace-name"
    extra = f'[sandboxes.hidden-box]\nuri = "local:{secret_dir}"\n'
    daemon = DaemonProcess(tmp_path, base_config(tmp_path, extra)).start()
    try:
        for path in ("/docs", "/redoc"):
            status, _ = daemon.request("GET", path, token=None)
            assert status == 404
        status, doc = daemon.request("GET", "/openapi.json", token=None)
        assert status == 200 and "/v1/pulls" in doc["paths"]
        text = json.dumps(doc)
        for private in (TOKEN, "hidden-box", str(secret_dir), str(tmp_path)):
            assert private not in text
    finally:
        daemon.close()
