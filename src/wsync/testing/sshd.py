"""A throwaway OpenSSH ``sshd`` on a loopback port, for tests and benchmarks.

wsync's ``ssh://`` transport is only worth what it does against the server
users actually run, so tests talk to a real ``/usr/sbin/sshd`` rather than to
an in-process imitation.  Everything lives in one directory the caller owns:

* a fresh ed25519 host key and client key (generated with asyncssh, so no
  ``ssh-keygen`` subprocess and no dependence on the user's ``~/.ssh``),
* ``authorized_keys`` holding the client key,
* ``known_hosts`` pinning the host key as ``[127.0.0.1]:PORT``, so the client
  verifies the host exactly as a user's client would,
* ``sshd_config`` and ``sshd.log`` (``LogLevel VERBOSE``; read it when a
  test fails).

Sessions get ``HOME=<workdir>/home`` (empty) through ``SetEnv``, which
overrides sshd's default environment: the account's shell rc files (root's
``~/.bashrc`` here runs ``pyenv init``, ~100 ms per exec, and prints rehash
warnings on stderr under concurrency) must not add latency or noise to tests
that compare stderr byte for byte.  Pass ``isolate_home=False`` to see the
account exactly as users' sandboxes do.

The server listens on 127.0.0.1 only, logs in the current user by public key
only, and allows 64 sessions per connection so the transport's concurrency is
exercised rather than sshd's default limit of 10.  :meth:`SshdServer.restart`
keeps port and keys, which lets tests cut connections and check reconnects.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from wsync.digits import ascii_digits
from wsync.transports.sshlib import asyncssh

#: where Debian's sshd wants its privilege-separation directory when run as root
_PRIVSEP_DIR = Path("/run/sshd")
_DEFAULT_SSHD = "/usr/sbin/sshd"


class SshdUnavailable(RuntimeError):
    """``sshd`` is not installed (or not executable) on this machine."""


def write_keypair(private_path: Path) -> str:
    """Generate an ed25519 key at ``private_path`` (mode 0600) and return its public line.

    The public key is also written next to it as ``<name>.pub``.
    """
    key = asyncssh.generate_private_key("ssh-ed25519", comment="wsync-throwaway")
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.export_private_key())
    public = key.export_public_key().decode("ascii").strip()
    private_path.with_name(private_path.name + ".pub").write_text(public + "\n")
    return public


def _free_port(host: str) -> int:
    """A port the kernel just considered free.  Racy by nature; callers retry."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (sshd's per-connection processes)."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not ascii_digits(entry.name):
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the comm field may contain spaces and parentheses: split after the last ")"
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry.name))
    return found


def _quote(value: Path | str) -> str:
    """sshd_config takes double-quoted arguments; our paths never contain quotes."""
    text = str(value)
    if '"' in text or "\n" in text:
        raise ValueError(f"unsupported character in sshd path: {text!r}")
    return f'"{text}"'


class SshdServer:
    """A real sshd for one test session or one benchmark run.

    Usage::

        with SshdServer(tmp_dir) as sshd:
            uri = sshd.uri("/work")            # ssh://root@127.0.0.1:PORT/work
            opts = sshd.transport_options()    # ssh_key, known_hosts, ssh_config
    """

    def __init__(
        self,
        workdir: Path | str,
        *,
        sshd_path: str | None = None,
        host: str = "127.0.0.1",
        start_timeout: float = 30.0,
        log_level: str = "VERBOSE",
        isolate_home: bool = True,
        extra_config: Sequence[str] = (),
    ) -> None:
        self.workdir = Path(workdir)
        #: more ``sshd_config`` lines (``MaxAuthTries 1``, say)
        self.extra_config = tuple(extra_config)
        self.host = host
        self.user = pwd.getpwuid(os.getuid()).pw_name
        self.start_timeout = start_timeout
        self.log_level = log_level
        self.sshd_path = sshd_path or shutil.which("sshd") or _DEFAULT_SSHD
        self.port = 0
        self.host_key = self.workdir / "ssh_host_ed25519_key"
        self.client_key = self.workdir / "id_ed25519"
        self.authorized_keys = self.workdir / "authorized_keys"
        self.known_hosts = self.workdir / "known_hosts"
        self.config_path = self.workdir / "sshd_config"
        self.log_path = self.workdir / "sshd.log"
        #: HOME of every session (None: the account's real home directory)
        self.session_home: Path | None = self.workdir / "home" if isolate_home else None
        self.host_public_key = ""
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> SshdServer:
        """Generate keys (once), pick a free port and wait until sshd answers."""
        if self._proc is not None:
            return self
        if not (Path(self.sshd_path).is_absolute() and os.access(self.sshd_path, os.X_OK)):
            raise SshdUnavailable(
                f"sshd not found at {self.sshd_path!r} (install openssh-server to run ssh tests)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.host_key.exists():
            self.host_public_key = write_keypair(self.host_key)
            self.authorized_keys.write_text(write_keypair(self.client_key) + "\n")
        if os.getuid() == 0:
            _PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        if self.port:
            self._spawn(self.port)  # restart: same port, or fail loudly
            return self
        last_error: Exception | None = None
        for _ in range(8):
            try:
                self._spawn(_free_port(self.host))
                return self
            except _PortTaken as exc:
                last_error = exc
        raise RuntimeError(f"sshd could not find a free port: {last_error}")

    def stop(self, *, kill_sessions: bool = True) -> None:
        """Stop the listener and reap it; by default also end its open connections.

        sshd's per-connection processes outlive the listener; killing them
        (they are children of the sshd this object started) is what a test
        means by "the server went away".
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        sessions = self.connection_pids(proc.pid) if kill_sessions else []
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in sessions:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def restart(self) -> None:
        """Stop (cutting all connections) and start again on the same port with the same keys."""
        self.stop()
        self.start()

    def kill_connections(self) -> int:
        """SIGKILL every per-connection sshd process; the listener keeps running.

        Returns how many were killed.  Clients see their TCP connection reset,
        as when a sandbox's network drops mid-command.
        """
        if self._proc is None:
            return 0
        pids = self.connection_pids(self._proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def connection_pids(self, listener_pid: int | None = None) -> list[int]:
        """Pids of sshd's per-connection processes (direct children of the listener)."""
        if listener_pid is None:
            if self._proc is None:
                return []
            listener_pid = self._proc.pid
        return _children_of(listener_pid)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> SshdServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- what clients need ---------------------------------------------------

    def uri(self, path: str) -> str:
        """``ssh://USER@127.0.0.1:PORT/PATH`` for this server."""
        if not self.port:
            raise RuntimeError("sshd is not started")
        user = urllib.parse.quote(self.user, safe="")
        path = path if path.startswith("/") else "/" + path
        return f"ssh://{user}@{self.host}:{self.port}{urllib.parse.quote(path)}"

    def transport_options(self) -> dict[str, Any]:
        """Options for :class:`~wsync.transports.ssh.SshTransport`: our key, our known_hosts.

        ``ssh_config`` is ``"none"`` so a developer's ``~/.ssh/config`` cannot
        change what the tests connect to.
        """
        return {
            "ssh_key": str(self.client_key),
            "known_hosts": str(self.known_hosts),
            "ssh_config": "none",
        }

    # -- internals -----------------------------------------------------------

    def _write_config(self, port: int) -> None:
        lines = [
            f"Port {port}",
            f"ListenAddress {self.host}",
            f"HostKey {_quote(self.host_key)}",
            f"AuthorizedKeysFile {_quote(self.authorized_keys)}",
            "PidFile none",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            "PrintMotd no",
            "X11Forwarding no",
            "AllowTcpForwarding no",
            "MaxSessions 64",
            "MaxStartups 64",
            f"LogLevel {self.log_level}",
            *self.extra_config,
        ]
        if self.session_home is not None:
            self.session_home.mkdir(exist_ok=True)
            lines.append(f"SetEnv {_quote(f'HOME={self.session_home}')}")
        self.config_path.write_text("\n".join(lines) + "\n")
        self.known_hosts.write_text(f"[{self.host}]:{port} {self.host_public_key}\n")

    def _spawn(self, port: int) -> None:
        if not self.host_public_key:
            self.host_public_key = (
                self.host_key.with_name(self.host_key.name + ".pub").read_text().strip()
            )
        self._write_config(port)
        with self.log_path.open("ab") as log:
            proc = subprocess.Popen(
                [self.sshd_path, "-D", "-e", "-f", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + self.start_timeout
        while True:
            if proc.poll() is not None:
                log_tail = self._log_tail()
                if "Address already in use" in log_tail:
                    raise _PortTaken(f"port {port} in use")
                raise RuntimeError(
                    f"sshd exited with status {proc.returncode} on start; log:\n{log_tail}"
                )
            if self._answers(port):
                self._proc = proc
                self.port = port
                return
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(
                    f"sshd did not answer on {self.host}:{port} within {self.start_timeout}s; "
                    f"log:\n{self._log_tail()}"
                )
            time.sleep(0.05)

    def _answers(self, port: int) -> bool:
        """True once something on the port speaks SSH (sends an ``SSH-`` banner)."""
        try:
            with socket.create_connection((self.host, port), timeout=2.0) as sock:
                return sock.recv(4).startswith(b"SSH-")
        except OSError:
            return False

    def _log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return "(no log)"


class _PortTaken(RuntimeError):
    pass
