"""A pods/exec WebSocket kept open: the guest helper's pipe (:meth:`K8sTransport.open_channel`).

The exec is opened with stdin, as every v5 exec is; then the socket stays open
(:class:`~wsync.transports.ws_channel.WebSocketChannel`).  Requests go as channel-0
messages (base64 text on ``v4.base64``), answers come back as channel-1 messages,
channel 2 is dropped; a status on channel 3 is the helper's end, and data from the
server on channel 0 or 4 is out of step, as an exec's collector says.  v5 ends stdin
with its CLOSE frame; v4 has only the socket's close.

There is no kill in this API: an abort closes the socket, as a timed-out exec does.
Runtimes that end an exec whose stream closed stop the call with it; others
(containerd's, by field reports: see the backend's notes) leave it to finish.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from websockets.asyncio.client import ClientConnection

from wsync.transports import k8s_protocol as kp
from wsync.transports.ws_channel import Ended, WebSocketChannel


class K8sChannel(WebSocketChannel):
    """One pods/exec WebSocket with stdin, kept open, in the subprotocol it chose."""

    def __init__(
        self,
        ws: ClientConnection,
        protocol: str,
        description: str,
        close: Callable[[ClientConnection], Awaitable[None]],
    ) -> None:
        self._protocol = protocol
        super().__init__(ws, description, close)

    def _stdin(self, data: bytes) -> bytes | str:
        return kp.encode(kp.STDIN, data, self._protocol)

    def _stdin_end(self) -> bytes | None:
        return kp.encode_close(kp.STDIN) if kp.has_close(self._protocol) else None

    def _output(self, message: bytes | str) -> bytes:
        frame = kp.decode(message, self._protocol)
        if not isinstance(frame, kp.Data) or frame.channel == kp.STDERR:
            return b""  # the greeting, a half-close of the server's, stderr
        if frame.channel == kp.STDOUT:
            return frame.data  # (the kubelet's greeting is empty too)
        if frame.channel == kp.ERROR:
            # (not parsed: the helper ended, whatever it says, and a status may come in
            # pieces; the call in flight is retried elsewhere)
            raise Ended("the command ended (a status on channel 3)")
        raise Ended(f"server data on channel {frame.channel}")
