"""``ssh://[user@]host[:port]/PATH``: exec over OpenSSH-compatible servers, via asyncssh.

One SSH connection is shared by every concurrent exec; each exec is one
session channel running ``shlex.join(argv)`` through the remote user's shell.
Why these choices:

* **Host keys are verified by default** (``~/.ssh/known_hosts``, or
  ``known_hosts=``).  wsync pulls a workspace *onto the host*; accepting any
  host key would let whoever answers on the port feed us a tree.  An unknown
  or changed key is :class:`~wsync.errors.SandboxUnreachable` with a one-line
  fix, never a prompt or a silent accept.
* **Bounded output, honest flags**: stdout/stderr are collected as raw bytes
  in the session callback, capped at ``max_output`` with ``truncated`` set,
  and a channel that closes without ``exit-status`` reports ``None``.
* **Channel slots**: OpenSSH's default ``MaxSessions`` is 10 per connection; a
  semaphore (``max_sessions``, default 8) queues extra execs instead of
  letting the 11th fail.  The exec deadline starts once a channel is open.
* **Reconnect lazily**: a lost connection fails the execs in flight with a
  retryable :class:`~wsync.errors.TransportError`; the next exec reconnects.
  Failing to connect the *first* time (refused, DNS, timeout) is fatal
  :class:`~wsync.errors.SandboxUnreachable`; failing to *re*connect for the
  same network reasons is retryable (sshd restarting, a network blip), while
  host-key and authentication failures stay fatal.
* **Deadlines kill the command's process group**: every command runs under a wrapper
  shell whose command line carries a per-exec nonce, and a deadline runs a reaper on a
  second channel (:mod:`wsync.transports.sshcommand`, shared with ``--ssh-client
  openssh``).

No key material, passphrase or password is ever logged or put in a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wsync.errors import (
    AuthFailed,
    SandboxUnreachable,
    TransportError,
    TransportTimeout,
    UsageError,
)
from wsync.protocol.records import printable
from wsync.transports.base import (
    DEFAULT_MAX_OUTPUT,
    BoundedBuffer,
    Channel,
    ChannelInbox,
    ExecResult,
)
from wsync.transports.sshcommand import (
    CIPHERS,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_SESSIONS,
    REAP_TIMEOUT,
    SshTransportBase,
    reaper,
    wrapped,
)
from wsync.transports.sshlib import ack_at_once, asyncssh

KEEPALIVE_INTERVAL = 15.0
#: how long to wait for a channel we are abandoning to finish closing
_CLOSE_GRACE = 2.0

_NETWORK_ERRORS = (OSError, TimeoutError, asyncssh.ConnectionLost)


def _existing_files(names: Sequence[object]) -> list[str]:
    """Those of ``names`` (``~`` expanded) that are files."""
    paths = (Path(str(name)).expanduser() for name in names)
    return [str(path) for path in paths if path.is_file()]


class _ExecSession(asyncssh.SSHClientSession[bytes]):
    """Collects one command's bounded output, exit status and end of channel."""

    def __init__(self, max_output: int) -> None:
        self.stdout = BoundedBuffer(max_output)
        self.stderr = BoundedBuffer(max_output)
        self.exit_status: int | None = None
        self.exit_signal: str | None = None
        self.error: Exception | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype == asyncssh.EXTENDED_DATA_STDERR:
            self.stderr.feed(data)
        else:
            self.stdout.feed(data)

    def exit_status_received(self, status: int) -> None:
        self.exit_status = status

    def exit_signal_received(self, signal: str, core_dumped: bool, msg: str, lang: str) -> None:
        self.exit_signal = signal

    def connection_lost(self, exc: Exception | None) -> None:
        self.error = exc
        if not self.closed.done():
            self.closed.set_result(None)


class _ChannelSession(asyncssh.SSHClientSession[bytes]):
    """Hands a long-running command's stdout to a :class:`ChannelInbox`."""

    def __init__(self) -> None:
        self.chan: asyncssh.SSHClientChannel[bytes] | None = None
        self.inbox = ChannelInbox(self._pause, self._resume)

    def _pause(self) -> None:
        if self.chan is not None:
            self.chan.pause_reading()

    def _resume(self) -> None:
        if self.chan is not None:
            self.chan.resume_reading()

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype != asyncssh.EXTENDED_DATA_STDERR:
            self.inbox.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.inbox.end(f"connection lost: {_reason(exc)}" if exc is not None else None)


class _SshChannel(Channel):
    """One session channel kept open; it holds a channel slot until closed."""

    def __init__(
        self,
        transport: SshTransport,
        conn: asyncssh.SSHClientConnection,
        chan: asyncssh.SSHClientChannel[bytes],
        session: _ChannelSession,
        marker: str,
    ) -> None:
        self._transport = transport
        self._conn = conn
        self._chan = chan
        self._session = session
        self._marker = marker
        self._description = transport.description
        self._open = True

    async def send(self, data: bytes) -> None:
        if self._session.inbox.ended:
            raise TransportError(f"{self._description}: the channel is closed")
        try:
            self._chan.write(data)
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"{self._description}: channel write: {_reason(exc)}") from None

    async def receive(self, timeout: float) -> bytes:
        return await self._session.inbox.take(timeout, self._description)

    @property
    def ended(self) -> bool:
        return self._session.inbox.ended or not self._open

    async def aclose(self, *, abort: bool = False) -> None:
        # EOF ends the helper's loop once the call it runs is over (calls are bounded in
        # time); closing a channel does not stop its command, so an abort then reaps the
        # command's process group by its marker, as a timed-out exec does.  The channel
        # and its slot go first, whatever happens to the reaper (a cancel, a deadline)
        if not self._open:
            return
        self._open = False
        try:
            with contextlib.suppress(asyncssh.Error, OSError):
                self._chan.write_eof()
            self._chan.close()
        finally:
            self._transport._slots.release()
        if abort:
            await self._transport._reap(self._conn, self._marker)


class SshTransport(SshTransportBase):
    """Exec over one shared, lazily (re)connected SSH connection."""

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
    ) -> None:
        super().__init__(
            host, port=port, user=user, connect_timeout=connect_timeout, max_sessions=max_sessions
        )
        self._ssh_key = ssh_key
        self._known_hosts = known_hosts
        self._ssh_config = ssh_config
        self._conn: asyncssh.SSHClientConnection | None = None

    # -- connection ----------------------------------------------------------

    def _connect_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "port": self.port if self.port is not None else (),
            "connect_timeout": self._connect_timeout,
            "keepalive_interval": KEEPALIVE_INTERVAL,
            # the guest is hostile: a config's ForwardAgent must not hand it the agent
            "agent_forwarding": False,
            "encryption_algs": CIPHERS,
        }
        if self.user is not None:
            kwargs["username"] = self.user
        if self._ssh_key is not None:
            if not Path(self._ssh_key).is_file():
                raise UsageError(f"ssh key {self._ssh_key!r} does not exist or is not a file")
            kwargs["client_keys"] = [self._ssh_key]
        if self._known_hosts is not None:
            if self._known_hosts == "none":
                raise UsageError("refusing known_hosts 'none': wsync always verifies host keys")
            if not Path(self._known_hosts).is_file():
                raise UsageError(f"known_hosts file {self._known_hosts!r} does not exist")
            kwargs["known_hosts"] = self._known_hosts
        if self._ssh_config == "none":
            kwargs["config"] = []
        elif self._ssh_config is not None:
            if not Path(self._ssh_config).is_file():
                raise UsageError(f"ssh config {self._ssh_config!r} does not exist")
            kwargs["config"] = [self._ssh_config]
        return kwargs

    async def _connection(self) -> asyncssh.SSHClientConnection:
        """The shared connection, (re)connected under a lock when missing or lost."""
        async with self._lock:
            conn = self._conn
            if conn is not None and not conn.is_closed():
                return conn
            if conn is not None:
                self._conn = None
                conn.close()
                await conn.wait_closed()
            self._conn = await self._connect()
            self._ever_connected = True
            return self._conn

    async def _connect(self) -> asyncssh.SSHClientConnection:
        desc = self.description
        kwargs = self._connect_kwargs()
        try:
            if "known_hosts" not in kwargs:
                kwargs["known_hosts"] = await self._config_known_hosts(kwargs)
            conn = await asyncssh.connect(self.host, **kwargs)
            try:
                ack_at_once(conn)
            except BaseException:
                conn.abort()
                raise
            return conn
        except asyncssh.HostKeyNotVerifiable as exc:
            port = self.port or 22
            scan = f"ssh-keyscan -p {port} {shlex.quote(self.host)} >> ~/.ssh/known_hosts"
            raise SandboxUnreachable(
                f"{desc}: host key not verified ({_reason(exc)}); if you trust this host, "
                f"record its key (`{scan}`) or pass --known-hosts FILE"
            ) from None
        except asyncssh.PermissionDenied as exc:
            tried = f"key {self._ssh_key}" if self._ssh_key else "default keys and agent"
            raise AuthFailed(
                f"{desc}: authentication failed ({_reason(exc)}; tried {tried}); "
                "check the user name and pass --ssh-key PATH"
            ) from None
        except asyncssh.ConfigParseError as exc:
            raise UsageError(f"{desc}: bad ssh config: {exc}") from None
        except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as exc:
            raise AuthFailed(f"{desc}: cannot use ssh key {self._ssh_key}: {exc}") from None
        except _NETWORK_ERRORS as exc:
            reason = _reason(exc) or f"no answer within {self._connect_timeout:g}s"
            if self._ever_connected:
                raise TransportError(f"{desc}: reconnect failed: {reason}") from None
            raise SandboxUnreachable(f"{desc}: cannot connect: {reason}") from None
        except asyncssh.Error as exc:
            raise SandboxUnreachable(f"{desc}: ssh handshake failed: {_reason(exc)}") from None

    async def _config_known_hosts(self, kwargs: dict[str, Any]) -> Any:
        """The host keys to trust when no ``known_hosts`` option names them: what the ssh
        config says, except that ``UserKnownHostsFile none`` is not "trust any key".

        asyncssh turns that line into ``known_hosts=None``, which verifies nothing, where
        OpenSSH reads it as "no user file" (the global ones still count, and
        StrictHostKeyChecking refuses a key none of them has).  Here it means the same:
        the config's ``GlobalKnownHostsFile`` that exist, else no key at all."""
        options = await asyncssh.SSHClientConnectionOptions.construct(host=self.host, **kwargs)
        if options.known_hosts is not None:
            return ()  # asyncssh's own choice: the config's files, or ~/.ssh/known_hosts
        found = _existing_files(options.config.get("GlobalKnownHostsFile") or [])
        return found or asyncssh.import_known_hosts("")

    async def aclose(self) -> None:
        """Close the shared connection (idempotent); a later exec would reconnect."""
        async with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            await conn.wait_closed()

    # -- exec ----------------------------------------------------------------

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
            conn = await self._connection()
            session = _ExecSession(max_output)
            try:
                chan, _ = await conn.create_session(lambda: session, command, encoding=None)
            except (asyncssh.Error, OSError) as exc:
                msg = f"{self.description}: cannot open a channel: {_reason(exc)}"
                raise TransportError(msg) from None
            await self._run(conn, chan, session, marker, stdin, timeout)
        return self._result(conn, session)

    async def _run(
        self,
        conn: asyncssh.SSHClientConnection,
        chan: asyncssh.SSHClientChannel[bytes],
        session: _ExecSession,
        marker: str,
        stdin: bytes | None,
        timeout: float,
    ) -> None:
        """Send stdin then EOF, and wait for the channel to close, under the deadline."""
        finished = False
        try:
            try:
                if stdin:
                    chan.write(stdin)
                chan.write_eof()
            except (asyncssh.Error, OSError):
                pass  # the channel closed early; its connection_lost tells the story
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a
                # cancel that lands as the channel closes (a Ctrl-C ignored)
                async with asyncio.timeout(timeout):
                    await asyncio.shield(session.closed)
            except TimeoutError:
                raise TransportTimeout(timeout) from None
            finished = True
        finally:
            if not finished:
                await self._reap(conn, marker)
                chan.close()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_CLOSE_GRACE):
                        await chan.wait_closed()

    async def open_channel(self, argv: Sequence[str], *, timeout: float) -> Channel:
        """A session channel running ``argv`` (under the exec wrapper), kept open; it
        takes one of the ``max_sessions`` slots until it is closed."""
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
                conn = await self._connection()
                session = _ChannelSession()
                chan, _ = await conn.create_session(lambda: session, command, encoding=None)
        except TimeoutError:
            self._slots.release()
            raise TransportTimeout(timeout) from None
        except (asyncssh.Error, OSError) as exc:
            self._slots.release()
            msg = f"{self.description}: cannot open a channel: {_reason(exc)}"
            raise TransportError(msg) from None
        except BaseException:
            self._slots.release()
            raise
        session.chan = chan
        return _SshChannel(self, conn, chan, session, marker)

    @staticmethod
    async def _reap(conn: asyncssh.SSHClientConnection, marker: str) -> None:
        """Best effort: kill the timed-out command's process group in the guest.

        Failures are ignored (no /proc, connection gone): the caller is already
        reporting a timeout or being cancelled, and the guest's staging GC and
        wsync's bounded scripts limit what a straggler can do.
        """
        if conn.is_closed():
            return
        with contextlib.suppress(asyncssh.Error, OSError, TimeoutError):
            async with asyncio.timeout(REAP_TIMEOUT):
                await conn.run(reaper(marker), check=False)

    def _result(self, conn: asyncssh.SSHClientConnection, session: _ExecSession) -> ExecResult:
        if session.error is not None:
            raise TransportError(
                f"{self.description}: connection lost during exec: {_reason(session.error)}"
            )
        notes: list[str] = []
        if session.exit_status is None:
            if conn.is_closed():
                raise TransportError(f"{self.description}: connection closed during exec")
            if session.exit_signal is not None:
                notes.append(f"killed by signal {session.exit_signal}")
            else:
                notes.append("channel closed without an exit status")
        return ExecResult(
            stdout=session.stdout.getvalue(),
            stderr=session.stderr.getvalue(),
            exit_status=session.exit_status,
            truncated=session.stdout.truncated or session.stderr.truncated,
            notes=tuple(notes),
        )


def _reason(exc: BaseException) -> str:
    """A short, secret-free description of a foreign exception."""
    if isinstance(exc, asyncssh.DisconnectError | asyncssh.ChannelOpenError):
        # the server's own words (a DISCONNECT's, a refused channel's): the sshd may be
        # the guest's, and its text reaches the terminal printable
        return printable(exc.reason, 200) or type(exc).__name__
    text = printable(str(exc), 300)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
