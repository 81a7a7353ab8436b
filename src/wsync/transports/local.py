"""``local:PATH``: the guest is this machine.

This is the transport behind ``wsync demo`` and the reference every other
transport is compared with in the conformance suite, so it must be boringly
exact: bytes in, bytes out, the real exit status, and nothing left running.

Why it is built on :meth:`asyncio.AbstractEventLoop.subprocess_exec` with its
own protocol rather than on ``asyncio.subprocess.Process`` streams:

* output is collected as it arrives and bounded in the protocol callback, so a
  chatty child never blocks on a full pipe and host memory stays bounded;
* we hold the public :class:`asyncio.SubprocessTransport`, so after a deadline
  we can close pipes that a stray grandchild still holds open, which the
  stream API cannot do without touching private attributes (and would then
  leak a transport and emit a ``ResourceWarning``).

Every command runs in a new session (its own process group), and a deadline
kills that whole group, so ``sh -c 'work & more'`` leaves nothing behind.  A
command that deliberately detaches (``setsid ... &`` with its stdio redirected)
is not waited for: exec returns when the command has exited and its pipes have
closed, which is exactly what the guest producer relies on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import pwd
import resource
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from wsync.errors import (
    HostOutOfFiles,
    TransportError,
    TransportTimeout,
    UsageError,
    WsyncError,
)
from wsync.transports.base import (
    DEFAULT_MAX_OUTPUT,
    BoundedBuffer,
    Capabilities,
    Channel,
    ChannelInbox,
    ExecResult,
    Transport,
)
from wsync.uri import SandboxURI

#: how long to wait for the kernel to report a SIGKILLed group leader's exit
_REAP_GRACE = 10.0


class _ExecProtocol(asyncio.SubprocessProtocol):
    """Collects bounded stdout/stderr and signals when the command is finished.

    "Finished" means: the process has exited *and* its stdout and stderr pipes
    have reached EOF.  Waiting for EOF as well as exit keeps the tail of the
    output that was still in the pipe when the process died.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, max_output: int) -> None:
        self.stdout = BoundedBuffer(max_output)
        self.stderr = BoundedBuffer(max_output)
        self.exited: asyncio.Future[None] = loop.create_future()
        self.finished: asyncio.Future[None] = loop.create_future()
        self._open_pipes = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        (self.stdout if fd == 1 else self.stderr).feed(raw)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        # fd 0 (stdin) closing, even with EPIPE, is normal: the child may not read it.
        self._open_pipes.discard(fd)
        self._maybe_finish()

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.exited.done() and not self._open_pipes and not self.finished.done():
            self.finished.set_result(None)


class _ChannelProtocol(asyncio.SubprocessProtocol):
    """Hands a long-running child's stdout to a :class:`ChannelInbox`; stderr is dropped."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.transport: asyncio.SubprocessTransport | None = None
        self.inbox = ChannelInbox(self._pause, self._resume)
        self.exited: asyncio.Future[None] = loop.create_future()

    def _stdout(self) -> asyncio.ReadTransport | None:
        pipe = self.transport.get_pipe_transport(1) if self.transport is not None else None
        return pipe if isinstance(pipe, asyncio.ReadTransport) else None

    def _pause(self) -> None:
        if (pipe := self._stdout()) is not None:
            pipe.pause_reading()

    def _resume(self) -> None:
        if (pipe := self._stdout()) is not None:
            pipe.resume_reading()

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        if fd == 1:
            self.inbox.feed(data.encode() if isinstance(data, str) else data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 1:
            self.inbox.end()

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


class _LocalChannel(Channel):
    def __init__(self, transport: asyncio.SubprocessTransport, protocol: _ChannelProtocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._closed = False

    async def send(self, data: bytes) -> None:
        pipe = self._transport.get_pipe_transport(0)
        if self._closed or not isinstance(pipe, asyncio.WriteTransport) or pipe.is_closing():
            raise TransportError("local: the channel is closed")
        try:
            pipe.write(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise TransportError(f"local: channel write: {exc}") from None

    async def receive(self, timeout: float) -> bytes:
        return await self._protocol.inbox.take(timeout, "local")

    @property
    def ended(self) -> bool:
        return self._protocol.inbox.ended or self._closed

    async def aclose(self, *, abort: bool = False) -> None:
        """End stdin and give the command a moment to end by itself (none if ``abort``),
        then kill its process group.  The kill comes before any wait when aborting, and
        the pipes are closed whatever interrupts the waits."""
        if self._closed:
            return
        self._closed = True
        try:
            pipe = self._transport.get_pipe_transport(0)
            if isinstance(pipe, asyncio.WriteTransport):
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    pipe.write_eof()
            if abort:
                self._kill()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CHANNEL_GRACE):
                    await asyncio.shield(self._protocol.exited)
            if not self._protocol.exited.done():
                await LocalTransport._kill_and_reap(self._transport, self._protocol)
        except BaseException:
            self._kill()
            raise
        finally:
            self._transport.close()

    def _kill(self) -> None:
        if not self._protocol.exited.done():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._transport.get_pid(), signal.SIGKILL)


#: how long a closed channel's command may take to end by itself before it is killed
_CHANNEL_GRACE = 1.0


class LocalTransport(Transport):
    """Runs commands on this machine, each in its own process group."""

    scheme = "local"
    capabilities = Capabilities(
        stdin=True, binary_safe=True, separate_stderr=True, channel=True, long_argv=True
    )

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        file_api: bool = False,
        run_as: tuple[int, int] | None = None,
    ) -> None:
        #: None: inherit our environment unchanged; else the full child environment
        self._env: dict[str, str] | None = None
        #: how each command is started as ``run_as`` (see :func:`as_user`)
        self._user: dict[str, Any] = {}
        if run_as is not None:
            self._env, self._user = as_user(*run_as, env)
        elif env:
            self._env = {**os.environ, **{str(k): str(v) for k, v in env.items()}}
        if file_api and run_as is None:
            # what the HTTP backends' file APIs offer, here for tests and the demo
            self.capabilities = dataclasses.replace(self.capabilities, file_read=True)  # type: ignore[misc]

    async def read_file(self, path: str, offset: int, length: int, *, timeout: float) -> bytes:
        if not self.capabilities.file_read:
            raise NotImplementedError("local: file API not enabled")

        def read() -> bytes:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(length)

        try:
            async with asyncio.timeout(timeout):
                return await asyncio.to_thread(read)
        except TimeoutError:
            raise TransportTimeout(timeout) from None
        except OSError as exc:
            raise TransportError(f"local file read {path!r}: {exc.strerror or exc}") from exc

    @classmethod
    def from_uri(cls, uri: SandboxURI, options: Mapping[str, Any]) -> LocalTransport:
        """Build from ``local:PATH``.  Option ``env``: variables overlaid on ours.

        (Tests use ``env={"PATH": busybox_dir}`` to run guest scripts against
        busybox tools only.)
        """
        if uri.scheme != cls.scheme:
            raise UsageError(f"{uri.raw!r} is not a local: URI")
        env = options.get("env")
        if env is not None and not isinstance(env, Mapping):
            raise UsageError("local transport option 'env' must be a mapping of strings")
        run_as = options.get("run_as")
        if run_as is not None and not (
            isinstance(run_as, Sequence)
            and len(run_as) == 2
            and all(type(n) is int and n >= 0 for n in run_as)
        ):
            raise UsageError("local transport option 'run_as' must be a (uid, gid) pair")
        return cls(
            env=env,
            file_api=bool(options.get("file_api", False)),
            run_as=None if run_as is None else (run_as[0], run_as[1]),
        )

    @property
    def description(self) -> str:
        return "local"

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
        loop = asyncio.get_running_loop()
        protocol = _ExecProtocol(loop, max_output)
        try:
            transport, _ = await loop.subprocess_exec(
                lambda: protocol,
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._env,
                start_new_session=True,
                **self._user,
            )
        except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
            # What a guest shell would report; retrying cannot help.
            code = 126 if isinstance(exc, PermissionError) else 127
            msg = f"wsync local: cannot execute {argv[0]!r}: {exc.strerror}\n"
            return ExecResult(
                stdout=b"",
                stderr=msg.encode("utf-8", "backslashreplace"),
                exit_status=code,
                notes=(f"exec failed: {exc.strerror}",),
            )
        except OSError as exc:  # EAGAIN from fork, ENOMEM: transient
            raise _cannot_start(argv[0], exc) from exc

        finished = False
        try:
            if stdin is not None:
                self._feed_stdin(transport, stdin)
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a
                # cancel that lands as the command finishes (a Ctrl-C ignored)
                async with asyncio.timeout(timeout):
                    await asyncio.shield(protocol.finished)
            except TimeoutError:
                raise TransportTimeout(timeout) from None
            finished = True
        finally:
            if not finished:
                await self._kill_and_reap(transport, protocol)
            transport.close()

        returncode = transport.get_returncode()
        notes: list[str] = []
        exit_status: int | None = returncode
        if returncode is None or returncode < 0:
            exit_status = None
            if returncode is not None:
                notes.append(f"killed by signal {-returncode}")
        return ExecResult(
            stdout=protocol.stdout.getvalue(),
            stderr=protocol.stderr.getvalue(),
            exit_status=exit_status,
            truncated=protocol.stdout.truncated or protocol.stderr.truncated,
            notes=tuple(notes),
        )

    async def open_channel(self, argv: Sequence[str], *, timeout: float) -> Channel:
        """``argv`` in its own process group with live stdin and stdout pipes."""
        if not argv:
            raise UsageError("open_channel needs a non-empty argv")
        loop = asyncio.get_running_loop()
        protocol = _ChannelProtocol(loop)
        try:
            transport, _ = await loop.subprocess_exec(
                lambda: protocol,
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                env=self._env,
                start_new_session=True,
                **self._user,
            )
        except OSError as exc:
            raise _cannot_start(argv[0], exc) from exc
        protocol.transport = transport
        return _LocalChannel(transport, protocol)

    @staticmethod
    def _feed_stdin(transport: asyncio.SubprocessTransport, data: bytes) -> None:
        """Queue stdin and close it; a child that exits unread gives EPIPE, which is fine."""
        pipe = transport.get_pipe_transport(0)
        if not isinstance(pipe, asyncio.WriteTransport):  # pragma: no cover - we asked for one
            return
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if data:
                pipe.write(data)
            pipe.write_eof()

    @staticmethod
    async def _kill_and_reap(
        transport: asyncio.SubprocessTransport, protocol: _ExecProtocol | _ChannelProtocol
    ) -> None:
        """SIGKILL the command's whole process group and wait for the leader's exit.

        Runs on timeout and on cancellation.  The group id is the leader's pid
        (``start_new_session``); Linux keeps that id reserved while any member
        lives, so this cannot hit an unrelated group.  Pipes still held by a
        process that escaped the group are closed by ``transport.close()``.
        """
        pid = transport.get_pid()
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except OSError as exc:  # pragma: no cover - EPERM cannot happen for our own child
            if exc.errno != errno.EPERM:
                raise
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_REAP_GRACE):
                await asyncio.shield(protocol.exited)

    async def aclose(self) -> None:
        """Nothing to release: each exec owns and reaps its own process."""


def as_user(
    uid: int, gid: int, overlay: Mapping[str, str] | None = None
) -> tuple[dict[str, str], dict[str, Any]]:
    """The environment and the process options that start a command as ``uid``/``gid``.

    Why: a daemon that pulls a workspace another user owns must not read it with its own
    rights.  ``tar`` opens the names of a select run by path, so the owner could swap a
    directory for a symlink between the listing and the read and have the daemon copy
    what only the daemon may read (its token, other users' DESTs).  Run as the owner, the
    guest side can read nothing the owner could not show us anyway.  The environment is
    a fresh one (the daemon's may hold secrets, and the owner may read a process's
    ``/proc/PID/environ``): PATH, and HOME, USER and LOGNAME of the owner's passwd entry
    (``/`` and the uid without one), then ``overlay``; the groups of the passwd entry
    (none without one); ``/`` as the working directory.  ``gid`` is the caller's to
    choose well: the owner's primary group, never the workspace directory's."""
    try:
        entry = pwd.getpwuid(uid)
        name, home = entry.pw_name, entry.pw_dir or "/"
        groups = os.getgrouplist(name, gid)
    except KeyError:
        name, home, groups = str(uid), "/", []
    env = {"PATH": os.environ.get("PATH") or os.defpath, "HOME": home, "USER": name}
    env["LOGNAME"] = name
    env.update({str(k): str(v) for k, v in (overlay or {}).items()})
    return env, {"user": uid, "group": gid, "extra_groups": groups, "cwd": "/"}


def _cannot_start(name: str, exc: OSError) -> WsyncError:
    """A guest command that could not be started: out of file descriptors is the host's
    limit, which twelve retries only hid behind "integrity not established" (exit 6);
    anything else (EAGAIN, ENOMEM from fork) may pass, and is retried."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return HostOutOfFiles(f"cannot start {name!r} (ulimit -n is {soft})")
    return TransportError(f"local: cannot start {name!r}: {exc}")
