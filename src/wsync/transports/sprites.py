"""``sprites://NAME/PATH``: exec over the Sprites WebSocket API, reported honestly.

The Sprites exec stream is the backend of field report 1: output produced
before the client attaches survives only as a ~64 KB ring, stderr is
sometimes merged into stdout frames, data frames arrive after the exit frame,
and some sockets close (code 1000) with no exit frame at all.  This transport
cannot repair any of that; it reports exactly what it saw, so the engine's
envelopes can detect it and retry:

* one WebSocket connection per exec (never one long stream), so a loss costs
  one short read;
* stdin bytes are sent only once the socket is open, then ``[0x04]``; wsync's
  read scripts wait for that byte before printing, which defeats the ring;
* a close without an exit frame gives ``exit_status=None`` — never 0 (one
  public SDK turns close code 1000 into exit 0);
* after the exit frame the client keeps reading until the socket closes or a
  short drain deadline passes, and keeps late data (note "data after exit
  frame");
* merged stderr cannot be told apart by a client, so ``separate_stderr`` is
  False and whatever arrived on stream 2 is reported as stderr;
* a guest helper's exec stays open (:meth:`SpritesTransport.open_channel`,
  :class:`SpritesChannel`): many calls for one socket, their argv on stdin instead of
  in the URL, and answers that the end-of-stream faults cannot take.

The token is sent only in the ``Authorization`` header; it is never logged,
never part of :attr:`description`, errors or ``repr``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import (
    ConnectionClosed,
    ConnectionClosedOK,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
    WebSocketException,
)

from wsync.errors import (
    AuthFailed,
    ProtocolError,
    SandboxUnreachable,
    TransportError,
    TransportTimeout,
    UsageError,
)
from wsync.protocol.records import printable
from wsync.transports.base import (
    DEFAULT_MAX_OUTPUT,
    Capabilities,
    Channel,
    ExecResult,
    Transport,
    dns_spellable,
    find_secret,
    float_options,
)
from wsync.transports.sprites_protocol import (
    STDERR,
    STDIN,
    STDOUT,
    Control,
    Data,
    ExecCollector,
    Exit,
    decode,
    encode_data,
    encode_stdin_eof,
    exec_url,
)
from wsync.transports.ws_channel import Ended, NoRedirectConnect, WebSocketChannel, close_socket
from wsync.uri import SandboxURI

log = logging.getLogger(__name__)

DEFAULT_API_URL = "https://api.sprites.dev"
TOKEN_ENV_VARS = ("SPRITES_TOKEN", "SPRITES_API_TOKEN")
#: stdin is sent in frames of at most this many bytes
STDIN_FRAME = 64 * 1024


def resolve_token(options: Mapping[str, Any]) -> str:
    """Explicit options beat the environment: ``token``, ``token_file``, then env vars."""
    token = find_secret(options, "token", "token_file", TOKEN_ENV_VARS, "Sprites token")
    if token is None:
        raise AuthFailed(
            "no Sprites API token: set SPRITES_TOKEN (or SPRITES_API_TOKEN) or pass a token file"
        )
    return token


class SpritesTransport(Transport):
    """One sprite's exec endpoint; every :meth:`exec` is its own WebSocket."""

    scheme: ClassVar[str] = "sprites"
    capabilities: ClassVar[Capabilities] = Capabilities(
        stdin=True, binary_safe=True, separate_stderr=False, channel=True
    )

    def __init__(
        self,
        name: str,
        *,
        token: str,
        base_url: str = DEFAULT_API_URL,
        workspace: str | None = None,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
        drain_timeout: float = 0.75,
        connect_timeout: float = 15.0,
        close_timeout: float = 1.0,
        ping_interval: float | None = 20.0,
        max_frame: int = 16 * 1024 * 1024,
    ) -> None:
        if not name:
            raise UsageError("sprites:// needs a sprite name (sprites://NAME/PATH)")
        self.name = name
        self.workspace = workspace
        self.base_url = base_url
        self.workdir = workdir
        self.env = dict(env or {})
        self.drain_timeout = drain_timeout
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self.ping_interval = ping_interval
        self.max_frame = max_frame
        self._token = token
        self._connected_once = False
        # validate the base URL now, so a typo is a usage error and not a retry loop
        exec_url(base_url, name, ["true"], stdin=False)
        parts = urllib.parse.urlsplit(base_url)
        if parts.username is not None or parts.password is not None:
            # they would show in repr and every connection error: the token has its option
            raise UsageError("the Sprites API URL carries credentials: give the token separately")
        if not dns_spellable(parts.hostname or ""):
            raise UsageError(f"the Sprites API URL {base_url!r}: not a host name DNS can spell")

    @classmethod
    def from_uri(cls, uri: SandboxURI, options: Mapping[str, Any]) -> SpritesTransport:
        if not uri.name:
            raise UsageError(f"{uri.raw!r}: missing sprite name (sprites://NAME/PATH)")
        base = options.get("sprites_url") or os.environ.get("SPRITES_API_URL") or DEFAULT_API_URL
        extra = float_options(options, ("drain_timeout", "connect_timeout", "close_timeout"))
        return cls(
            uri.name,
            token=resolve_token(options),
            base_url=str(base),
            workspace=uri.path,
            workdir=options.get("dir"),
            env=options.get("env"),
            **extra,
        )

    @property
    def description(self) -> str:
        return f"sprites://{self.name}"

    def __repr__(self) -> str:
        return f"SpritesTransport({self.description}, base_url={self.base_url!r})"

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        if max_output < 0:
            raise UsageError("max_output must be >= 0")
        url = exec_url(
            self.base_url,
            self.name,
            list(argv),
            stdin=stdin is not None,
            workdir=self.workdir,
            env=self.env,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        ws = await self._connect(url, deadline, timeout)
        try:
            return await self._session(ws, stdin, deadline, timeout, max_output)
        finally:
            await self._close(ws)

    async def open_channel(self, argv: Sequence[str], *, timeout: float) -> Channel:
        """``argv`` with stdin, its WebSocket kept open (:class:`SpritesChannel`)."""
        if not argv:
            raise UsageError("open_channel needs a command")
        url = exec_url(
            self.base_url, self.name, list(argv), stdin=True, workdir=self.workdir, env=self.env
        )
        deadline = asyncio.get_running_loop().time() + timeout
        ws = await self._connect(url, deadline, timeout)
        return SpritesChannel(ws, self.description, self._close)

    async def _connect(self, url: str, deadline: float, timeout: float) -> ClientConnection:
        """Open the socket; map handshake failures to wsync's errors."""
        try:
            async with asyncio.timeout_at(deadline):
                ws = await NoRedirectConnect(
                    url,
                    additional_headers={"Authorization": f"Bearer {self._token}"},
                    compression=None,
                    open_timeout=self.connect_timeout,
                    ping_interval=self.ping_interval,
                    ping_timeout=self.ping_interval,
                    close_timeout=self.close_timeout,
                    max_size=self.max_frame,
                    user_agent_header="wsync",
                )
        except TimeoutError:
            raise TransportTimeout(timeout) from None
        except InvalidStatus as err:
            status = err.response.status_code
            if status in (401, 403):
                raise AuthFailed(
                    f"{self.description}: authentication failed (HTTP {status}); "
                    "check SPRITES_TOKEN"
                ) from None
            if status == 404:
                raise SandboxUnreachable(f"sprite {self.name} not found") from None
            if 300 <= status < 400:
                raise SandboxUnreachable(
                    f"{self.description}: {self.base_url} redirected the exec (HTTP {status}); "
                    "wsync does not follow it (is this the Sprites API URL?)"
                ) from None
            raise TransportError(f"{self.description}: exec refused (HTTP {status})") from None
        except InvalidURI as err:
            raise UsageError(f"{self.description}: bad Sprites API URL: {err}") from None
        except (OSError, InvalidHandshake, WebSocketException) as err:
            message = f"{self.description}: cannot connect to {self.base_url}: {err}"
            if not self._connected_once and isinstance(err, OSError):
                raise SandboxUnreachable(message) from None
            raise TransportError(message) from None
        self._connected_once = True
        return ws

    async def _session(
        self,
        ws: ClientConnection,
        stdin: bytes | None,
        deadline: float,
        timeout: float,
        max_output: int,
    ) -> ExecResult:
        loop = asyncio.get_running_loop()
        collector = ExecCollector(max_output)
        sender = asyncio.create_task(self._send_stdin(ws, stdin)) if stdin is not None else None
        drain_until: float | None = None
        try:
            while True:
                if collector.exited and drain_until is None:
                    drain_until = min(loop.time() + self.drain_timeout, deadline)
                until = deadline if drain_until is None else drain_until
                try:
                    async with asyncio.timeout_at(until):
                        message = await ws.recv()
                except TimeoutError:
                    if collector.exited:
                        collector.drain_expired()
                        break
                    raise TransportTimeout(timeout) from None
                except ConnectionClosed as closed:
                    clean = isinstance(closed, ConnectionClosedOK)
                    # no close frame received: the TCP connection just ended (1006)
                    code = closed.rcvd.code if closed.rcvd is not None else 1006
                    if not clean and not collector.exited:
                        raise TransportError(
                            f"{self.description}: connection dropped (code {code}) "
                            "before the exit frame"
                        ) from None
                    collector.closed(code, clean=clean)
                    break
                try:
                    frame = collector.feed(message)
                except ProtocolError as err:
                    raise TransportError(f"{self.description}: {err}") from None
                if isinstance(frame, Control):
                    log.debug(
                        "sprites %s: %s message ignored", self.name, printable(frame.type, 40)
                    )
        finally:
            if sender is not None:
                sender.cancel()
                try:
                    await sender
                except asyncio.CancelledError:
                    # the sender's own cancel is expected; ours (a Ctrl-C) must go on
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise
        result = collector.result()
        if result.notes:
            log.debug("sprites %s exec notes: %s", self.name, "; ".join(result.notes))
        return result

    @staticmethod
    async def _send_stdin(ws: ClientConnection, data: bytes | None) -> None:
        """Send stdin once the socket is open, then stdin EOF; a closed socket ends it."""
        try:
            view = memoryview(data or b"")
            for start in range(0, len(view), STDIN_FRAME):
                await ws.send(encode_data(STDIN, bytes(view[start : start + STDIN_FRAME])))
            await ws.send(encode_stdin_eof())
        except ConnectionClosed:
            # the receive loop sees the close and reports it
            return

    async def _close(self, ws: ClientConnection) -> None:
        await close_socket(ws, self.close_timeout + 0.5)


class SpritesChannel(WebSocketChannel):
    """A Sprites exec WebSocket with stdin, kept open: the guest helper's pipe.

    Requests go as stream-0 frames, answers come on stream 1 (stderr, stream 2, may be
    merged into it by the service: a helper's calls send theirs nowhere); the exit frame,
    binary or JSON, is the helper's end, and stdin bytes or a stdin EOF from the server
    are out of step.  ``[0x04]`` ends stdin on close.  Output before the client attaches
    survives only as a ring: a helper writes nothing before its first request.
    """

    def _stdin(self, data: bytes) -> bytes:
        return encode_data(STDIN, data)

    def _stdin_end(self) -> bytes:
        return encode_stdin_eof()

    def _output(self, message: bytes | str) -> bytes:
        frame = decode(message)
        if isinstance(frame, Control):
            return b""  # session_info, debug, port notices
        if isinstance(frame, Exit):
            raise Ended(f"the command ended (exit {frame.code})")
        if isinstance(frame, Data) and frame.stream == STDOUT:
            return frame.data
        if isinstance(frame, Data) and frame.stream == STDERR:
            return b""
        raise Ended("stdin from the server: out of step")
