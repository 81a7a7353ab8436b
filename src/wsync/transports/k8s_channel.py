"""A pods/exec WebSocket kept open: the guest helper's pipe (:meth:`K8sTransport.open_channel`).

The exec is opened with stdin, as every v5 exec is; then the socket stays open.  Requests
go as channel-0 messages (64 KiB at most each, base64 text on ``v4.base64``), answers
come back as channel-1 messages, channel 2 is dropped.  Every exec's argv travels in the
request URL, which servers cap near 8 KiB: through a helper a call's argv is stdin, so
the long scripts of a pull (an admission that carries the first status, a list in
parts) lose that bound too.

Why a channel pays on Kubernetes: every exec is a WebSocket handshake (TLS and the
API server's authentication on a real cluster) and a runtime exec, where a helper
answers with one message each way.  And the field's faults of pods/exec strike at the
end of a command's stream (the tail lost behind a ``Success``, ``kubectl`` issue
#60140; a status sent while the process runs): a helper's answers are not the output
it ends with, it goes on running after each.

Nothing here is trusted more than an exec's output: the caller parses envelopes out of
what :meth:`receive` returns.  A status on channel 3 (the command ended), a close, or a
message that does not decode ends the channel; the next receive says so.  There is no
kill in this API: an abort closes the socket, as a timed-out exec does.  Runtimes that
end an exec whose stream closed stop the call with it; others (containerd's, by field
reports: see the backend's notes) leave it to finish, bounded in time as every call is,
and the helper's loop ends with its stdin.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK, WebSocketException

from wsync.errors import ProtocolError, TransportError
from wsync.transports import k8s_protocol as kp
from wsync.transports.base import PumpedChannel

#: stdin is sent in messages of at most this many bytes (the exec path's size)
STDIN_FRAME = 64 * 1024


class K8sChannel(PumpedChannel):
    """One exec WebSocket with stdin, kept open; ``close(ws)`` is the transport's bounded
    close of a socket."""

    def __init__(
        self,
        ws: ClientConnection,
        protocol: str,
        description: str,
        close: Callable[[ClientConnection], Awaitable[None]],
    ) -> None:
        super().__init__(description)
        self._ws = ws
        self._protocol = protocol
        self._close = close
        self._pump = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        """Messages → the inbox until the command's status, a close or a bad message."""
        error: str | None = None
        try:
            while True:
                await self._flowing.wait()  # the caller's inbox is full: stop reading
                frame = kp.decode(await self._ws.recv(), self._protocol)
                if not isinstance(frame, kp.Data):
                    continue  # the greeting, or a half-close of the server's
                if frame.channel == kp.STDOUT:
                    self._inbox.feed(frame.data)  # (the kubelet's greeting is empty)
                elif frame.channel == kp.ERROR:
                    # (not parsed: the helper ended, whatever it says, and a status may
                    # come in pieces; the call in flight is retried elsewhere)
                    error = "the command ended (a status on channel 3)"
                    return
                elif frame.channel != kp.STDERR:
                    # stdin or resize bytes from the server: out of step, as an exec's
                    # collector says
                    error = f"server data on channel {frame.channel}"
                    return
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
                chunk = bytes(view[start : start + STDIN_FRAME])
                await self._ws.send(kp.encode(kp.STDIN, chunk, self._protocol))
        except (ConnectionClosed, OSError, WebSocketException) as err:
            raise TransportError(f"{self._description}: channel write: {err}") from None

    async def aclose(self, *, abort: bool = False) -> None:
        # v5 ends stdin first (the helper's loop ends once the call it runs is over);
        # then the socket goes, which is all v4 has, and all an abort can do here
        if not self._open:
            return
        self._open = False
        self._pump.cancel()
        try:
            if kp.has_close(self._protocol) and not abort:
                with contextlib.suppress(ConnectionClosed, OSError, WebSocketException):
                    async with asyncio.timeout(1.0):
                        await self._ws.send(kp.encode_close(kp.STDIN))
            # (wait, not await: a cancel of this task must not be taken for the pump's)
            await asyncio.wait([self._pump])
        finally:
            await self._close(self._ws)
