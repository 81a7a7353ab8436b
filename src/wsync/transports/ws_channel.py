"""An exec WebSocket kept open: the guest helper's pipe on the WebSocket backends.

Kubernetes pods/exec (:mod:`wsync.transports.k8s_channel`) and the Sprites exec API
(:mod:`wsync.transports.sprites`) both carry one command per WebSocket: stdin frames one
way, stdout frames the other, then the command's exit, each in a framing of its own.
:class:`WebSocketChannel` keeps such a socket open for a guest helper; a subclass says
how its backend frames stdin and what a server message means (:meth:`_stdin`,
:meth:`_stdin_end`, :meth:`_output`).

Every exec's argv travels in the request URL, which servers cap near 8 KiB; through a
helper a call's argv is stdin, so the long scripts of a pull (an admission that carries
the first status, a list in parts) lose that bound too.  And the field's faults of these
APIs strike at the end of a command's stream (a tail lost behind a success, data after
the exit, no exit at all): a helper's answers are not the output it ends with, it goes
on running after each.

Nothing here is trusted more than an exec's output: the caller parses envelopes out of
what :meth:`receive` returns.  The command's exit, a close, or a message that does not
decode ends the channel; the next receive says so.  Neither API has a kill: an abort
ends stdin (where the protocol can) and closes the socket, as a timed-out exec does.
Servers that end an exec whose stream closed stop the call with it; others leave it to
finish, bounded in time as every call is, and the helper's loop ends with its stdin
(on Kubernetes v4, which cannot end stdin, only if the server closes it with the
socket).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK, WebSocketException

from wsync.errors import ProtocolError, TransportError
from wsync.transports.base import PumpedChannel

#: stdin is sent in messages of at most this many bytes (the exec paths' size)
STDIN_FRAME = 64 * 1024


class NoRedirectConnect(connect):
    """websockets' ``connect``, following no redirect.  It follows up to ten, and keeps
    the ``Authorization`` header on the same host: a proxy or server could send the exec,
    token and all, to another pod, sprite or namespace, with another command, than the
    one asked for (client-go follows none on exec either); and a redirect to an
    ``http(s)://`` page (a login proxy in front of the API) came out as websockets'
    ``InvalidURI``, which reads as the user's own URL being bad.  The 3xx comes out as
    ``InvalidStatus``, for the transport to say what it is."""

    def process_redirect(self, exc: Exception) -> Exception | str:
        return exc


async def close_socket(ws: ClientConnection, timeout: float) -> None:
    """Close ``ws`` with a handshake of at most ``timeout`` seconds (servers have held
    sockets ~5 s), else abort it; a cancel aborts it at once, not at the peer's pace.
    The k8s and sprites transports close every exec's socket so, and their channels."""
    try:
        async with asyncio.timeout(timeout):
            await ws.close()
    except (TimeoutError, OSError, WebSocketException):
        ws.transport.abort()
    except BaseException:
        ws.transport.abort()
        raise


class Ended(Exception):
    """:meth:`WebSocketChannel._output` found the end of the command (its reason)."""


class WebSocketChannel(PumpedChannel):
    """One exec WebSocket with stdin, kept open; ``close(ws)`` is the transport's bounded
    close of a socket."""

    def __init__(
        self,
        ws: ClientConnection,
        description: str,
        close: Callable[[ClientConnection], Awaitable[None]],
    ) -> None:
        super().__init__(description)
        self._ws = ws
        self._close = close
        self._start_reading(self._read())

    @abc.abstractmethod
    def _stdin(self, data: bytes) -> bytes | str:
        """One message carrying ``data`` to the command's stdin."""

    @abc.abstractmethod
    def _stdin_end(self) -> bytes | str | None:
        """The message that ends the command's stdin, if the protocol has one."""

    @abc.abstractmethod
    def _output(self, message: bytes | str) -> bytes:
        """The stdout bytes in a server message (``b""``: none, a control message or
        stderr); :class:`Ended` at the command's end, ProtocolError when out of step."""

    async def _read(self) -> None:
        """Messages → the inbox until the command's end, a close or a bad message."""
        error: str | None = None
        try:
            while True:
                await self._flowing.wait()  # the caller's inbox is full: stop reading
                self._inbox.feed(self._output(await self._ws.recv()))
        except Ended as end:
            error = str(end)
        except ConnectionClosed as closed:
            if not isinstance(closed, ConnectionClosedOK):
                code = closed.rcvd.code if closed.rcvd is not None else 1006
                error = f"connection dropped (code {code})"
        except ProtocolError as err:
            error = str(err)
        except (OSError, WebSocketException) as err:
            error = f"{type(err).__name__}: {err}"
        finally:
            self._inbox.end(error)

    async def send(self, data: bytes) -> None:
        if self._inbox.ended or not self._open:
            raise TransportError(f"{self._description}: the channel is closed")
        try:
            view = memoryview(data)
            for start in range(0, len(view), STDIN_FRAME):
                await self._ws.send(self._stdin(bytes(view[start : start + STDIN_FRAME])))
        except (ConnectionClosed, OSError, WebSocketException) as err:
            raise TransportError(f"{self._description}: channel write: {err}") from None

    async def aclose(self, *, abort: bool = False) -> None:
        # stdin's end first where the protocol has one, on an abort too: the helper's loop
        # ends once the call it runs is over, even on a server whose session outlives its
        # socket (then the call itself runs to its end); then the socket goes
        if not self._open:
            return
        self._open = False
        try:
            await self._stop_reading()
            end = self._stdin_end()
            if end is not None:
                with contextlib.suppress(ConnectionClosed, OSError, WebSocketException):
                    async with asyncio.timeout(1.0):
                        await self._ws.send(end)
        finally:
            await self._close(self._ws)
