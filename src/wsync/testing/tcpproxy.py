"""A TCP proxy on loopback that a test can cut and restore: a database outage on demand,
or a slow link for the benchmarks.

Why a proxy and not restarting the server: the PostgreSQL that the tests use is
shared with everything else on the machine, and restarting it would break
them all.  Between the daemons and PostgreSQL the proxy gives the same view a
restart or a network cut gives: every open connection is reset at once, and
new connections are refused until :meth:`TcpProxy.restore`.

It runs in one background thread with plain sockets and ``selectors``, so it
works from sync tests and under any event loop the daemons use.

With ``rate`` (bytes per second) it is a slow link instead (issue 13's
benchmark rows): each direction is one token bucket shared by every
connection, as a link's capacity is, and the thread sleeps off what a send
borrowed from the next second.  A sleep holds the other direction too; at
16 KiB per send that is a few milliseconds, well inside what it models.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time
from types import TracebackType


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``(host, port)`` until cut."""

    def __init__(self, target_host: str, target_port: int, rate: float | None = None) -> None:
        self.target = (target_host, target_port)
        self.rate = rate
        #: per direction (keyed by the sending side's role): when its bucket is empty again
        self._free_at: dict[bool, float] = {True: 0.0, False: 0.0}
        self._clients: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._cut = False
        self._stop = False
        #: connections accepted (and forwarded) so far
        self.connections = 0
        #: connections refused while cut (a client's attempts to reach the target)
        self.refused = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._loop, name="tcp-proxy", daemon=True)

    def start(self) -> TcpProxy:
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()
        return self

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def cut(self) -> None:
        """Reset every forwarded connection and refuse new ones until :meth:`restore`."""
        with self._lock:
            self._cut = True
        self._poke()

    def restore(self) -> None:
        with self._lock:
            self._cut = False
        self._poke()

    def close(self) -> None:
        with self._lock:
            self._stop = True
        self._poke()
        self._thread.join(10)
        for sock in [self._listener, self._wake_r, self._wake_w, *self._pairs]:
            with contextlib.suppress(OSError):
                sock.close()

    def _poke(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # -- the proxy thread ------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                stop, cut = self._stop, self._cut
            if stop:
                return
            if cut and self._pairs:
                for sock in list(self._pairs):
                    self._drop(sock)
            for key, _mask in self._sel.select(timeout=0.5):
                if key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                elif key.data == "accept":
                    self._accept(cut)
                else:
                    self._forward(key.fileobj)  # type: ignore[arg-type]

    def _accept(self, cut: bool) -> None:
        try:
            client, _addr = self._listener.accept()
        except OSError:
            return
        if cut:
            self.refused += 1
            _reset(client)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            _reset(client)
            return
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pairs[client], self._pairs[upstream] = upstream, client
        self._clients.add(client)
        self._sel.register(client, selectors.EVENT_READ, "data")
        self._sel.register(upstream, selectors.EVENT_READ, "data")
        self.connections += 1

    def _forward(self, sock: socket.socket) -> None:
        peer = self._pairs.get(sock)
        if peer is None:
            return
        try:
            data = sock.recv(65536 if self.rate is None else 16384)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        if self.rate is not None:
            up = sock in self._clients
            now = time.monotonic()
            self._free_at[up] = max(now, self._free_at[up]) + len(data) / self.rate
            time.sleep(max(0.0, self._free_at[up] - now))
        try:
            peer.setblocking(True)
            peer.settimeout(5)
            peer.sendall(data)
            peer.setblocking(False)
        except OSError:
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        peer = self._pairs.pop(sock, None)
        for one in (sock, peer):
            if one is None:
                continue
            self._pairs.pop(one, None)
            self._clients.discard(one)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(one)
            _reset(one)


def _reset(sock: socket.socket) -> None:
    """Close with RST (linger 0), as a server that died would leave the peer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
