"""A harness that runs the real ``wsync daemon`` process, plus start-up and config tests.

The other ``test_daemon_*`` modules import :class:`DaemonProcess` and the tree
helpers from here (names only, so no test is collected twice).  The daemon is
always a separate process started as ``python -m wsync.daemon`` on a loopback
port chosen by the kernel (``listen = "127.0.0.1:0"``); the harness reads the
bound address from ``STATE_DIR/daemon.json`` and then talks HTTP only.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TOKEN = "test-token-0123456789abcdef"
START_TIMEOUT = 30.0


class DaemonProcess:
    """One ``python -m wsync.daemon`` child with its own config, state dir and log file."""

    def __init__(self, root: Path, config: str, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.config_path = root / "config.toml"
        self.state_dir = root / "state"
        self.log_path = root / "daemon.log"
        self.config_path.write_text(config, encoding="utf-8")
        self.env = {**os.environ, "WSYNC_API_TOKEN": TOKEN, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self, extra_args: tuple[str, ...] = ()) -> DaemonProcess:
        info = self.state_dir / "daemon.json"
        with contextlib.suppress(FileNotFoundError):
            info.unlink()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "wsync.daemon",
                    "--config",
                    str(self.config_path),
                    *extra_args,
                ],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(FileNotFoundError, ValueError):
                data = json.loads(info.read_text(encoding="utf-8"))
                if data.get("pid") == self.proc.pid:
                    self.address = data["listen"]
                    return self
            time.sleep(0.05)
        pytest.fail(f"daemon did not become ready in {START_TIMEOUT}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = TOKEN,
        raw: bytes | None = None,
        timeout: float = 20.0,
    ) -> tuple[int, Any]:
        host, _, port = self.address.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        try:
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            kind = response.getheader("Content-Type") or ""
        finally:
            conn.close()
        if "json" in kind:
            return response.status, json.loads(payload)
        return response.status, payload.decode("utf-8", "replace")

    def pull(self, sandbox: str, dest: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"sandbox": sandbox}
        if dest is not None:
            body["dest"] = dest
        status, job = self.request("POST", "/v1/pulls", body)
        assert status == 202, job
        return job  # type: ignore[no-any-return]

    def job(self, job_id: str) -> dict[str, Any]:
        status, job = self.request("GET", f"/v1/pulls/{job_id}")
        assert status == 200, job
        return job  # type: ignore[no-any-return]

    def wait_job(
        self, job_id: str, states: tuple[str, ...] = ("succeeded",), timeout: float = 60.0
    ) -> dict[str, Any]:
        """Poll until the job reaches one of ``states``; fail early if it ends elsewhere."""
        deadline = time.monotonic() + timeout
        job: dict[str, Any] = {}
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["state"] in states:
                return job
            if job["state"] in ("succeeded", "failed", "cancelled"):
                pytest.fail(f"job ended {job['state']}, wanted {states}: {job}\n{self.log()}")
            time.sleep(0.1)
        pytest.fail(f"job {job_id} not in {states} after {timeout}s: {job}")

    def wait_until(self, predicate: Any, timeout: float = 30.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        pytest.fail(f"timed out waiting for {what}\n{self.log()}")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"daemon did not exit within {timeout}s\n{self.log()}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def running(root: Path, config: str, env: dict[str, str] | None = None) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess(root, config, env)
    try:
        yield daemon.start()
    finally:
        daemon.close()


# -- trees ----------------------------------------------------------------


def make_tree(root: Path, *, seed: int = 1, big: int = 0) -> None:
    """A small workspace with nested dirs, an empty dir, modes, a symlink and a binary file."""
    rng = __import__("random").Random(seed)
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "README.md").write_text(f"workspace {seed}\n", encoding="utf-8")
    for i in range(20):
        (root / "src" / "pkg" / f"m{i}.py").write_text(f"X = {rng.random()}\n" * (i + 1))
    tool = root / "run.sh"
    tool.write_text("#!/bin/sh\necho hi\n", encoding="utf-8")
    tool.chmod(0o755)
    (root / "link").symlink_to("src/pkg/m1.py")
    (root / "blob.bin").write_bytes(rng.randbytes(300_000))
    if big:
        (root / "big.bin").write_bytes(os.urandom(big))


def tree_of(root: Path) -> dict[str, tuple[str, int, bytes]]:
    """Path → (kind, permission bits, content or link target): what "exact" compares."""
    out: dict[str, tuple[str, int, bytes]] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        st = path.lstat()
        perm = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", 0, os.readlink(path).encode())
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", perm, b"")
        else:
            out[rel] = ("file", perm, path.read_bytes())
    return out


def assert_same_tree(src: Path, dest: Path) -> None:
    want, got = tree_of(src), tree_of(dest)
    assert sorted(want) == sorted(got), "different sets of paths"
    for rel, item in want.items():
        assert got[rel] == item, f"{rel} differs"


def base_config(tmp: Path, extra: str = "", *, api: str = "", **limits: int) -> str:
    """A config with dest root ``tmp/roots``; ``api``: more lines for the [api] table."""
    lim = "\n".join(f"{k} = {v}" for k, v in limits.items())
    return f"""
state_dir = "{tmp}/state"
dest_roots = ["{tmp}/roots"]
shutdown_grace = 15

[api]
listen = "127.0.0.1:0"
{api}

[limits]
chunk_size = 65536
call_timeout = 20
{lim}
{extra}
"""


# -- tests of start-up and configuration ------------------------------------


def _run_daemon(
    args: list[str], env: dict[str, str], timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wsync.daemon", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_invalid_config_is_one_clear_error_with_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(
        '[limits]\nchunk_size = 1000\n[sandboxes.a]\nuri = "ftp://x/y"\n'
        'secrets = { token = "hunter2-inline-secret" }\n',
        encoding="utf-8",
    )
    result = _run_daemon(["--config", str(cfg)], {"WSYNC_API_TOKEN": TOKEN})
    assert result.returncode == 2
    err = result.stderr
    assert "limits.chunk_size" in err
    assert "sandboxes.a.uri" in err and "ftp" in err
    assert "sandboxes.a.secrets" in err
    assert "hunter2-inline-secret" not in err, "a config error must not echo a secret"
    assert "Traceback" not in err


def test_env_overrides_and_missing_token(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(base_config(tmp_path), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "WSYNC_API_TOKEN"}
    no_token = subprocess.run(
        [sys.executable, "-m", "wsync.daemon", "--config", str(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert no_token.returncode == 2
    assert "api.token_file" in no_token.stderr and "WSYNC_API_TOKEN" in no_token.stderr
    bad_env = _run_daemon(
        ["--config", str(cfg)], {"WSYNC_API_TOKEN": TOKEN, "WSYNC_LIMITS__MAX_CONCURRENT": "0"}
    )
    assert bad_env.returncode == 2
    assert "limits.max_concurrent" in bad_env.stderr
    bad_listen = _run_daemon(
        ["--config", str(cfg), "--listen", "nowhere"], {"WSYNC_API_TOKEN": TOKEN}
    )
    assert bad_listen.returncode == 2 and "api.listen" in bad_listen.stderr


def test_token_file_unix_socket_and_state_dir_lock(tmp_path: Path) -> None:
    """--listen unix:PATH and [api] token_file work; a second daemon on one state dir is refused."""
    token_file = tmp_path / "token"
    token_file.write_text("file-token-0123456789\n", encoding="utf-8")
    token_file.chmod(0o600)  # one others can read is refused
    sock = tmp_path / "run" / "api.sock"
    config = base_config(tmp_path).replace("[api]\n", f'[api]\ntoken_file = "{token_file}"\n')
    env = {k: v for k, v in os.environ.items() if k != "WSYNC_API_TOKEN"}
    daemon = DaemonProcess(tmp_path, config)
    daemon.env = env
    try:
        daemon.start(("--listen", f"unix:{sock}"))
        assert daemon.address == f"unix:{sock}"
        from wsync.daemon.client import DaemonClient, status_main

        client = DaemonClient("http://unused", str(sock), "file-token-0123456789")
        assert client.request("GET", "/v1/status")["listen"] == f"unix:{sock}"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("WSYNC_API_TOKEN", "wrong-token-000000000")
            assert status_main(["--unix", str(sock)]) == 2
        second = _run_daemon(
            ["--config", str(tmp_path / "config.toml"), "--listen", "127.0.0.1:0"],
            {"WSYNC_API_TOKEN": TOKEN},
        )
        assert second.returncode == 2 and "state_dir.locked" in second.stderr
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit() == 0
        assert not sock.exists(), "the unix socket is removed on a clean exit"
    finally:
        daemon.close()


def test_a_unix_socket_a_daemon_answers_on_is_not_taken_a_dead_ones_is(tmp_path: Path) -> None:
    """A second daemon (a state dir of its own) told to listen where a running one does is
    refused, as TCP refuses (it used to unlink the live socket as stale and take the
    address: the first ran on, unreachable; found by an independent review).  The socket
    a kill -9 left is taken over, and a clean exit removes only its own file."""
    from wsync.daemon.client import DaemonClient

    sock = tmp_path / "api.sock"
    first, second, third = (tmp_path / n for n in ("a", "b", "c"))
    daemons = []
    try:
        for home in (first, second, third):
            home.mkdir()
            daemons.append(DaemonProcess(home, base_config(home)))
        daemons[0].start(("--listen", f"unix:{sock}"))
        refused = _run_daemon(
            ["--config", str(second / "config.toml"), "--listen", f"unix:{sock}"],
            {"WSYNC_API_TOKEN": TOKEN},
        )
        assert refused.returncode == 2 and "in use" in refused.stderr, refused.stderr
        client = DaemonClient("http://unused", str(sock), TOKEN)
        assert client.request("GET", "/v1/status")["listen"] == f"unix:{sock}"
        daemons[0].kill9()  # its socket file stays, nobody answers
        assert sock.exists()
        daemons[2].start(("--listen", f"unix:{sock}"))
        assert client.request("GET", "/v1/status")["listen"] == f"unix:{sock}"
        sock.rename(tmp_path / "moved.sock")  # someone else's file at the path now
        sock.touch()
        daemons[2].signal(signal.SIGTERM)
        assert daemons[2].wait_exit() == 0
        assert sock.exists(), "a clean exit removes only the socket it bound"
    finally:
        for daemon in daemons:
            daemon.close()


def test_log_redaction_masks_secret_keys_registered_values_and_url_passwords() -> None:
    from wsync.daemon.logs import REDACTED, redact, register_secret

    register_secret("s3cr3t-backend-token")
    event = redact(
        None,
        "info",
        {
            "event": "pull.start",
            "token": "abc",
            "Authorization": "Bearer abc",
            "options": {"sprites_token": "x", "ssh_key": "/etc/wsync/key", "token_file": "/t"},
            "note": "sent s3cr3t-backend-token upstream",
            "uri": "ssh://agent:hunter2@host/work",
            "argv": ["x", "s3cr3t-backend-token"],
        },
    )
    assert event["token"] == REDACTED and event["Authorization"] == REDACTED
    assert event["options"] == {
        "sprites_token": REDACTED,
        "ssh_key": "/etc/wsync/key",
        "token_file": "/t",
    }
    assert event["note"] == f"sent {REDACTED} upstream"
    assert event["uri"] == f"ssh://agent:{REDACTED}@host/work"
    assert event["argv"] == ["x", REDACTED]
    assert event["event"] == "pull.start"


def test_log_redaction_masks_credential_headers_written_as_text() -> None:
    from wsync.daemon.logs import REDACTED, redact

    event = redact(
        None,
        "debug",
        {
            "event": "> Authorization: Bearer k8s-serviceaccount-0123",
            "lines": ["Cookie: session=abc123", "x-api-key=e2b_4567", "ok: 200"],
            "note": "authorized as bob",
        },
    )
    assert event["event"] == f"> Authorization: {REDACTED}"
    assert event["lines"] == [f"Cookie: {REDACTED}", f"x-api-key={REDACTED}", "ok: 200"]
    assert event["note"] == "authorized as bob"


_DEBUG_PULL = """
import asyncio, os, sys
from pathlib import Path
from wsync.daemon import logs
from wsync.emulators.sprites import EmulatorThread
from wsync.engine.api import PullOptions
from wsync.engine.pull import pull_uri

tmp = Path(sys.argv[1])
logs.configure("debug")
with EmulatorThread(tmp / "emu", token=os.environ["SPRITES_TOKEN"]) as emu:
    ws = emu.create_sprite("box") / "work"
    ws.mkdir()
    (ws / "a.txt").write_text("hello\\n")
    options = PullOptions(state_dir=tmp / "state", call_timeout=30.0)
    result = asyncio.run(
        pull_uri(f"sprites://box{ws}", tmp / "dest", options, {"sprites_url": emu.url})
    )
    print("exit", result.exit_code)
"""


def test_a_daemon_logging_at_debug_never_writes_a_token_the_transport_found_itself(
    tmp_path: Path,
) -> None:
    """A review found the Sprites (and Kubernetes) token in a daemon's debug log: the
    websockets library logs each handshake's headers, and a token taken from the
    environment or a kubeconfig is registered nowhere for redaction."""
    token = "sk-live-never-in-a-log-0123456789"
    env = {**os.environ, "SPRITES_TOKEN": token}
    script = tmp_path / "pull.py"
    script.write_text(_DEBUG_PULL)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.stdout.strip() == b"exit 0", done.stderr[-2000:]
    assert b'"level": "debug"' in done.stderr  # it did log at debug
    assert token.encode() not in done.stderr + done.stdout


@pytest.mark.parametrize("line", ["pull_timeout = inf", "call_timeout = nan", "call_timeout = inf"])
def test_endless_or_nan_limits_are_config_errors(tmp_path: Path, line: str) -> None:
    from wsync.daemon.config import ConfigError, load_config

    cfg = tmp_path / "c.toml"
    text = base_config(tmp_path)
    key = line.split()[0]
    text = text.replace("call_timeout = 20", line) if key == "call_timeout" else text + line
    cfg.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=line.split()[0]):
        load_config(cfg)


def _catches_sighup(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    return False


def test_a_sighup_while_the_daemon_starts_is_a_reload_not_its_end(tmp_path: Path) -> None:
    """SIGHUP's default action ends a process, and the daemon took the signal over only
    once its loop ran: a supervisor's reload right after a (re)start (0.2 s, 0.6 s in the
    red team's runs) ended it without a word.  Now the entry point holds the signal
    first, and the daemon reloads once it can."""
    daemon = DaemonProcess(tmp_path, base_config(tmp_path))
    daemon.state_dir.mkdir(parents=True, exist_ok=True)
    with daemon.log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "wsync.daemon", "--config", str(daemon.config_path)],
            env=daemon.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    try:
        deadline = time.monotonic() + 30
        while not _catches_sighup(proc.pid) and time.monotonic() < deadline:
            assert proc.poll() is None, daemon.log()
            time.sleep(0.002)
        info = daemon.state_dir / "daemon.json"
        # held before the server is even imported (that and loading the config took the
        # time in which a SIGHUP used to end the daemon)
        assert "daemon.config" not in daemon.log() and not info.exists()
        proc.send_signal(signal.SIGHUP)
        while not info.exists() and time.monotonic() < deadline:
            assert proc.poll() is None, f"the SIGHUP ended the daemon:\n{daemon.log()}"
            time.sleep(0.05)
        assert info.exists(), daemon.log()
        while "config.reloaded" not in daemon.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "config.reloaded" in daemon.log()
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)


_SQUATTER = """
import socket, sys
family, where, out = sys.argv[1], sys.argv[2], sys.argv[3]
s = socket.socket(socket.AF_UNIX if family == "unix" else socket.AF_INET)
s.bind(where if family == "unix" else ("127.0.0.1", 0))
s.listen(1)
print(where if family == "unix" else s.getsockname()[1], flush=True)
s.settimeout(20)
try:
    c, _ = s.accept()
    c.settimeout(2)
    got = b""
    try:
        while b"\\r\\n\\r\\n" not in got:
            more = c.recv(65536)
            if not more:
                break
            got += more
    except OSError:
        pass
    open(out, "wb").write(got)
    c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
except OSError:
    pass
"""


def _status_of(tmp_path: Path, listen: str) -> int:
    """``wsync status --config`` of a daemon configured to listen on ``listen`` (state
    directory root's, token in a file), without ``WSYNC_API_TOKEN``."""
    from wsync.daemon.client import status_main

    (tmp_path / "token").write_text(TOKEN + "\n", encoding="utf-8")
    (tmp_path / "token").chmod(0o600)  # one others can read is refused
    (tmp_path / "state").mkdir()  # the daemon's (root's, as the test runs)
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path}/state"\ndest_roots = ["{tmp_path}/roots"]\n'
        f'[api]\nlisten = "{listen}"\ntoken_file = "{tmp_path}/token"\n',
        encoding="utf-8",
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WSYNC_API_TOKEN", raising=False)
        return status_main(["--config", str(cfg), "--json"])


@pytest.mark.parametrize("family", ["tcp", "unix"])
def test_status_sends_no_token_to_another_users_listener(
    tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a red-team review: while the daemon is down any local user may listen on
    its address, and ``wsync status --config`` sent them the token.  The listener must be
    the daemon's user (its state directory's owner) or root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the listener as another user")

    shared = Path(tempfile.mkdtemp(prefix="wsync-squat-"))
    shared.chmod(0o1777)
    try:
        got = shared / "got"
        where = str(shared / "api.sock")
        squatter = subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             sys.executable, "-c", _SQUATTER, family, where, str(got)],
            stdout=subprocess.PIPE, text=True, cwd="/",
        )  # fmt: skip
        try:
            assert squatter.stdout is not None
            bound = squatter.stdout.readline().strip()
            listen = f"unix:{bound}" if family == "unix" else f"127.0.0.1:{bound}"
            assert _status_of(tmp_path, listen) == 3
            assert "uid 65534" in capsys.readouterr().err
        finally:
            squatter.kill()
            squatter.wait()
            if squatter.stdout is not None:
                squatter.stdout.close()
        assert not got.exists() or TOKEN.encode() not in got.read_bytes()
    finally:
        shutil.rmtree(shared)


def test_status_asks_about_the_socket_it_reached_not_its_port(tmp_path: Path) -> None:
    """The daemon (here a stand-in of root's) on ``[::1]:P`` and another user's process on
    ``0.0.0.0:P``: the client that reaches ``[::1]`` talks to the daemon, and the other
    listener, on the same port in the other family, neither gets the token nor makes the
    client refuse (found by a review: any listener on the port was taken)."""
    if os.geteuid() != 0 or not socket.has_ipv6:
        pytest.skip("needs root to run a listener as another user, and IPv6")

    daemon = socket.socket(socket.AF_INET6)
    try:
        daemon.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        daemon.bind(("::1", 0))
    except OSError as err:
        daemon.close()
        pytest.skip(f"no ::1 here: {err}")
    daemon.listen(1)
    port = daemon.getsockname()[1]
    got = tmp_path / "got"
    tmp_path.chmod(0o755)
    # (the wildcard: the old lookup took any unspecified IPv4 listener for the port's; it
    # only listens, for a moment, and nothing but ::1 is connected to)
    code = _SQUATTER.replace('("127.0.0.1", 0)', f'("0.0.0.0", {port})')
    squatter = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, "-c", code, "tcp", "-", "/dev/null"],
        stdout=subprocess.PIPE, text=True, cwd="/",
    )  # fmt: skip

    def serve() -> None:
        conn, _ = daemon.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    server = threading.Thread(target=serve, daemon=True)
    try:
        assert squatter.stdout is not None
        assert squatter.stdout.readline().strip() == str(port)
        server.start()
        assert _status_of(tmp_path, f"[::1]:{port}") == 0
        server.join(10)
    finally:
        squatter.kill()
        squatter.wait()
        if squatter.stdout is not None:
            squatter.stdout.close()
        daemon.close()
    assert not got.exists()


def test_status_sends_nothing_when_it_cannot_tell_who_listens_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A listener on this host whose owner cannot be looked up (``/proc/net`` unreadable)
    gets no token: the client fails closed (a review found it trusted such a one)."""
    from wsync.daemon import client

    real_open = open

    def no_proc_net(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).startswith("/proc/net/"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(client, "open", no_proc_net, raising=False)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        assert _status_of(tmp_path, f"127.0.0.1:{listener.getsockname()[1]}") == 3
    finally:
        listener.close()
    assert "cannot tell who listens" in capsys.readouterr().err
