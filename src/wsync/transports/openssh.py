"""``ssh://`` through OpenSSH's own client (``--ssh-client openssh``).

Why a second ssh transport: the asyncssh one decrypts in the pull's own process, where
it shares the GIL with verification and extraction, and it costs every ``wsync pull``
the import of asyncssh and ``cryptography`` (about 0.2 s, most of a small pull's time
beside rsync).  Here the bytes are OpenSSH's: one **master** connection per pull
(``ssh -M``, a control socket in a private 0700 directory), and each exec or helper
channel a short-lived ``ssh -S`` client that hands its pipes to the master, which
decrypts straight into them in its own process.  The master can be started before the
pull's modules are imported (:func:`preconnect`), so the handshake overlaps them.

The same rules as the asyncssh transport (:mod:`wsync.transports.ssh`):

* **Host keys are verified**: ``StrictHostKeyChecking=yes`` and ``BatchMode=yes`` are
  given on the command line, which wins over any ``~/.ssh/config`` (OpenSSH takes the
  first value it reads); ``known_hosts none`` is refused.  No prompt ever appears.
* **Failures are named**: the master's own messages (a file in the private directory,
  ``LogLevel=ERROR``) say whether the host key, the authentication or the network
  failed; the first connection's failure is fatal, a later one (the master died) is a
  retryable :class:`~wsync.errors.TransportError` and the next exec starts a new master.
* **Deadlines kill the command's process group** in the guest, by the same wrapper and
  reaper (:mod:`wsync.transports.sshcommand`); the local client is killed with it.
* **Nothing outlives the pull**: the master runs a remote ``cat`` reading its stdin,
  a pipe only this process holds, so when the process dies, even by ``kill -9``, the
  remote ``cat`` sees EOF and the master ends with it.
* The host is given after ``--``: a URI host cannot become an option.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from wsync.digits import ascii_digits
from wsync.errors import (
    AuthFailed,
    HostOutOfFiles,
    SandboxUnreachable,
    TransportError,
    TransportTimeout,
    UsageError,
)
from wsync.protocol.records import printable
from wsync.transports.base import DEFAULT_MAX_OUTPUT, Channel, ExecResult
from wsync.transports.local import LocalTransport
from wsync.transports.sshcommand import (
    CIPHERS,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_SESSIONS,
    REAP_TIMEOUT,
    SshTransportBase,
    reaper,
    wrapped,
)
from wsync.uri import SandboxURI

KEEPALIVE_INTERVAL = 15
#: the longest command line one argv element of the client can carry (Linux's
#: MAX_ARG_STRLEN is 128 KiB), with room to spare
MAX_COMMAND = 120_000
#: how long a master whose client lost it may take to exit
_DYING = 1.0
#: how often the master's readiness is looked at
_POLL = 0.005
#: the key exchange put first: the one the asyncssh transport negotiates (asyncssh has
#: OpenSSH's default, the post-quantum sntrup761 hybrid, only with liboqs), 70 ms
#: faster a connection here (ssh true: 0.13 s against 0.20 s); OpenSSH's own list follows
KEX = "curve25519-sha256"
#: what the master's primary session runs: it ends, and the master with it, when this
#: process's end of the master's stdin closes
_LIFELINE = "exec cat >/dev/null"

#: masters started by :func:`preconnect`, by their argv, for the transport to adopt
_EARLY: dict[tuple[str, ...], _Master] = {}


def _quoted(value: str) -> str:
    """A path as one ``-o`` value: OpenSSH splits on spaces unless quoted, and expands
    ``%`` tokens and a leading ``~``."""
    if any(c in value for c in '"\n\r\0'):
        raise UsageError(f"ssh: a path with a quote or a newline is not supported: {value!r}")
    return '"' + value.replace("\\", "\\\\").replace("%", "%%") + '"'


class _Master:
    """One ``ssh -M`` process and its private directory."""

    def __init__(self, argv: list[str], directory: str, control: str, log: str) -> None:
        self.directory = directory
        self.control = control
        self.log_path = log
        log_file: IO[bytes] = open(log, "wb")  # noqa: SIM115 - the child holds it
        try:
            self.proc = subprocess.Popen(
                [*argv[:1], "-M", "-S", control, *argv[1:]],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                start_new_session=True,  # a Ctrl-C to our group must not cut the cleanup off
            )
        finally:
            log_file.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        return self.alive() and os.path.exists(self.control)

    def messages(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            return f.read(8192).decode("utf-8", "replace").strip()
        return ""

    def stop(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class _OpensshChannel(Channel):
    """A helper channel: a local ``ssh -S`` client's pipes; an abort also reaps the
    command in the guest (killing the client does not stop it)."""

    def __init__(self, transport: OpensshTransport, inner: Channel, marker: str) -> None:
        self._transport = transport
        self._inner = inner
        self._marker = marker
        self._open = True

    async def send(self, data: bytes) -> None:
        await self._inner.send(data)

    async def receive(self, timeout: float) -> bytes:
        return await self._inner.receive(timeout)

    @property
    def ended(self) -> bool:
        return self._inner.ended or not self._open

    async def aclose(self, *, abort: bool = False) -> None:
        if not self._open:
            return
        self._open = False
        try:
            await self._inner.aclose(abort=abort)
        finally:
            self._transport._slots.release()
        if abort:
            await self._transport._reap(self._marker)


#: the lines of ssh(1)'s log that carry the server's own text
_SERVER_SAID = ("Received disconnect from", "Disconnected from")


class OpensshTransport(SshTransportBase):
    """Exec through one OpenSSH master connection (see the module docstring)."""

    def __init__(
        self,
        host: str,
        *,
        port: int | None = None,
        user: str | None = None,
        ssh_key: str | None = None,
        known_hosts: str | None = None,
        ssh_config: str | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        client: str = "ssh",
    ) -> None:
        super().__init__(
            host, port=port, user=user, connect_timeout=connect_timeout, max_sessions=max_sessions
        )
        if not host or host.startswith("-"):
            raise UsageError(f"ssh: {host!r} is not a host name")
        found = shutil.which(client)
        if found is None:
            raise UsageError(
                f"--ssh-client openssh needs OpenSSH's client ({client!r} is not on PATH); "
                "install openssh-client or use --ssh-client asyncssh"
            )
        self._master: _Master | None = None
        self._local = LocalTransport()
        self._argv = [found, *self._options(ssh_key, known_hosts, ssh_config, connect_timeout)]

    def _options(
        self,
        ssh_key: str | None,
        known_hosts: str | None,
        ssh_config: str | None,
        connect_timeout: float,
    ) -> list[str]:
        opts = ["-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
        opts += ["-o", "LogLevel=ERROR", "-o", f"ConnectTimeout={max(1, round(connect_timeout))}"]
        opts += ["-o", f"ServerAliveInterval={KEEPALIVE_INTERVAL}", "-o", "ServerAliveCountMax=3"]
        opts += ["-o", f"Ciphers={','.join(CIPHERS)}", "-o", f"KexAlgorithms=^{KEX}"]
        # a config's RemoteCommand would refuse ours, and its forwardings (a port in use)
        # could fail the master: neither is what a pull asked for
        opts += ["-o", "ControlPersist=no", "-o", "RemoteCommand=none"]
        opts += ["-o", "ClearAllForwardings=yes"]
        # the guest is hostile: a config's ForwardAgent would hand it the user's agent
        opts += ["-o", "ForwardAgent=no", "-o", "ForwardX11=no"]
        if self.port is not None:
            opts += ["-p", str(self.port)]
        if self.user is not None:
            opts += ["-l", self.user]
        if ssh_key is not None:
            if not Path(ssh_key).is_file():
                raise UsageError(f"ssh key {ssh_key!r} does not exist or is not a file")
            opts += ["-o", f"IdentityFile={_quoted(ssh_key)}"]
        if known_hosts is not None:
            if known_hosts == "none":
                raise UsageError("refusing known_hosts 'none': wsync always verifies host keys")
            if not Path(known_hosts).is_file():
                raise UsageError(f"known_hosts file {known_hosts!r} does not exist")
            opts += ["-o", f"UserKnownHostsFile={_quoted(known_hosts)}"]
            # FILE alone, as with asyncssh: not /etc/ssh/ssh_known_hosts nor a command
            opts += ["-o", "GlobalKnownHostsFile=none", "-o", "KnownHostsCommand=none"]
        if ssh_config == "none":
            opts += ["-F", "/dev/null"]
        elif ssh_config is not None:
            if not Path(ssh_config).is_file():
                raise UsageError(f"ssh config {ssh_config!r} does not exist")
            opts += ["-F", ssh_config]
        return opts

    # -- the master --------------------------------------------------------------------

    def start(self) -> None:
        """Start the master now, without waiting for it (see :func:`preconnect`)."""
        if self._master is None:
            self._master = _EARLY.pop(tuple(self._argv), None) or self._spawn()

    def _spawn(self) -> _Master:
        """A new master; its directory is named for this process, so that one a killed
        pull left is removed by the next (the master itself ended with the pull)."""
        parent = tempfile.gettempdir()
        if len(parent) > 60 or "%" in parent:  # a socket path has 107 bytes; ssh expands %
            parent = "/tmp"
        _sweep(parent)
        directory = ""
        try:
            directory = tempfile.mkdtemp(prefix=f"wsync-ssh-{os.getpid()}-", dir=parent)
            control = os.path.join(directory, "m")
            argv = [*self._argv, "--", self.host, _LIFELINE]
            return _Master(argv, directory, control, os.path.join(directory, "log"))
        except OSError as exc:
            if directory:
                shutil.rmtree(directory, ignore_errors=True)
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise HostOutOfFiles(f"cannot start ssh (ulimit -n is {_nofile()})") from exc
            raise TransportError(f"{self.description}: cannot start ssh: {exc}") from exc

    async def _control(self) -> _Master:
        """A running master, (re)started under a lock."""
        async with self._lock:
            master = self._master
            if master is not None and master.ready():
                return master
            if master is not None and not master.alive():
                self._master = None
                await asyncio.to_thread(master.stop)
            self.start()
            assert self._master is not None
            master = self._master
            deadline = asyncio.get_running_loop().time() + self._connect_timeout + 5
            while not master.ready():
                if not master.alive() or asyncio.get_running_loop().time() > deadline:
                    self._master = None
                    failure = self._failure(master)  # its log goes with its directory
                    await asyncio.to_thread(master.stop)
                    raise failure
                await asyncio.sleep(_POLL)
            self._ever_connected = True
            return master

    def _failure(self, master: _Master) -> Exception:
        """The master's failure as wsync's error (see the module docstring)."""
        desc = self.description
        text = master.messages()
        # ssh(1) sanitises a server's words itself; printable all the same
        last = printable(text.splitlines()[-1], 300) if text else "no answer"
        # ssh(1)'s own words decide, not the server's.  ssh logs a DISCONNECT's reason as
        # it came (newlines too) and exits: all from its first such line is the server's.
        # A host key is checked before anything the server says, and ssh's refusal is a
        # line of its own; the auth methods inside "Permission denied (...)" are the
        # server's too, so that line never tells a host key
        lines = text.splitlines()
        cut = next((i for i, line in enumerate(lines) if line.startswith(_SERVER_SAID)), None)
        own = [line.strip().lower() for line in lines[:cut]]
        low = "\n".join(own)
        if "host key verification failed." in own or "host identification has changed" in low:
            port = self.port or 22
            scan = f"ssh-keyscan -p {port} {shlex.quote(self.host)} >> ~/.ssh/known_hosts"
            return SandboxUnreachable(
                f"{desc}: host key not verified; if you trust this host, record its key "
                f"(`{scan}`) or pass --known-hosts FILE"
            )
        # sshd says "Too many authentication failures" only in its DISCONNECT: believed
        # (a server that claims to refuse the key can refuse it anyway)
        if "permission denied (" in low or "too many authentication failures" in text.lower():
            return AuthFailed(
                f"{desc}: authentication failed ({last}); check the user name and pass "
                "--ssh-key PATH"
            )
        if "load key" in low or "bad permissions" in low:
            return AuthFailed(f"{desc}: cannot use the ssh key: {last}")
        if "bad configuration option" in low or ("terminating, " in low and "config" in low):
            return UsageError(f"{desc}: bad ssh config: {last}")
        if self._ever_connected:
            return TransportError(f"{desc}: reconnect failed: {last}")
        return SandboxUnreachable(f"{desc}: cannot connect: {last}")

    async def aclose(self) -> None:
        """Stop the master (idempotent); a later exec would start another."""
        async with self._lock:
            master, self._master = self._master, None
        if master is not None:
            await asyncio.to_thread(master.stop)

    # -- exec --------------------------------------------------------------------------

    def _client(self, control: str, command: str) -> list[str]:
        if len(command) > MAX_COMMAND:
            raise UsageError(f"ssh: a command of {len(command)} bytes is too long for ssh(1)")
        return [*self._argv, "-S", control, "-o", "ControlMaster=no", "--", self.host, command]

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        if not argv:
            raise UsageError("exec needs a non-empty argv")
        if max_output < 0:
            raise UsageError("max_output must be >= 0")
        marker, command = wrapped(argv)
        async with self._slots:
            master = await self._control()
            client = self._client(master.control, command)
            finished = False
            try:
                result = await self._local.exec(
                    client, stdin=stdin if stdin is not None else b"", timeout=timeout,
                    max_output=max_output,
                )  # fmt: skip
                finished = True
            finally:
                if not finished:
                    await self._reap(marker)
        if result.exit_status == 255 and await self._died(master):
            raise TransportError(f"{self.description}: connection lost during exec")
        return result

    @staticmethod
    async def _died(master: _Master) -> bool:
        """After a client's exit 255 (ssh's own failures, or the command's status): the
        master the client used ended, or ends within :data:`_DYING` (a client can see the
        connection go before the master has exited)."""
        deadline = asyncio.get_running_loop().time() + _DYING
        while master.alive():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(_POLL)
        return True

    async def open_channel(self, argv: Sequence[str], *, timeout: float) -> Channel:
        """A helper's channel: a client kept running; it holds a slot until closed."""
        if not argv:
            raise UsageError("open_channel needs a non-empty argv")
        marker, command = wrapped(argv)
        try:
            async with asyncio.timeout(timeout):
                await self._slots.acquire()
        except TimeoutError:
            raise TransportTimeout(timeout) from None
        try:
            async with asyncio.timeout(timeout):
                master = await self._control()
            client = self._client(master.control, command)
            inner = await self._local.open_channel(client, timeout=timeout)
        except TimeoutError:
            self._slots.release()
            raise TransportTimeout(timeout) from None
        except BaseException:
            self._slots.release()
            raise
        return _OpensshChannel(self, inner, marker)

    async def _reap(self, marker: str) -> None:
        """Best effort: kill a stopped command's process group in the guest (see
        :meth:`wsync.transports.ssh.SshTransport._reap`)."""
        master = self._master
        if master is None or not master.ready():
            return
        client = self._client(master.control, reaper(marker))
        with contextlib.suppress(TransportError, OSError):
            await self._local.exec(client, stdin=b"", timeout=REAP_TIMEOUT)


def _sweep(parent: str) -> None:
    """Remove the master directories of pulls that are gone (killed: the master ended
    with them, its directory stayed), ours only."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            pid = entry.name.split("-")[2] if entry.name.startswith("wsync-ssh-") else ""
            if not ascii_digits(pid) or int(pid) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid() or entry.is_symlink():
                    continue
                try:
                    os.kill(int(pid), 0)
                except ProcessLookupError:
                    shutil.rmtree(entry.path, ignore_errors=True)


def _nofile() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def preconnect(uri: SandboxURI, options: Mapping[str, Any]) -> None:
    """Start the master of the transport ``uri`` and ``options`` will open, before the
    pull's modules are imported: the handshake overlaps the imports.  The transport
    adopts it; nothing is waited for, and any failure is the transport's to report."""
    try:
        transport = OpensshTransport.from_uri(uri, options)
    except UsageError:
        return
    key = tuple(transport._argv)
    if key not in _EARLY:
        if not _EARLY:
            atexit.register(_stop_early)
        _EARLY[key] = transport._spawn()


def _stop_early() -> None:
    """At exit: masters started early that no transport adopted (the pull stopped first)."""
    while _EARLY:
        _EARLY.popitem()[1].stop()
