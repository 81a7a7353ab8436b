"""The HTTP API's door and error shapes, over raw loopback sockets to one real daemon.

Raw sockets because what is tested is what happens *before* a whole request
exists: a body announced but not (yet) sent, a chunked body that keeps coming.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Iterator

import pytest

from test_daemon_harness import TOKEN, DaemonProcess, base_config, make_tree, running

CAP = 64 * 1024


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("guard")
    (tmp / "roots").mkdir()
    make_tree(tmp / "ws", seed=11)
    box = f'[sandboxes.ws]\nuri = "local:{tmp}/ws"\ndest = "{tmp}/roots/ws"\n'
    with running(tmp, base_config(tmp, box)) as proc:
        yield proc
        proc.signal(signal.SIGTERM)
        assert proc.wait_exit() == 0, proc.log()


def _connect(daemon: DaemonProcess) -> socket.socket:
    host, _, port = daemon.address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=20)


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP/1.1 answer with a Content-Length (what the daemon's errors have)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-answer"
        body += chunk
    return status, headers, body


def _head(method: str, path: str, token: str | None, extra: str) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}{extra}\r\n"
    ).encode()


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789"])
def test_a_request_without_the_token_is_refused_before_its_body_is_read(
    daemon: DaemonProcess, token: str | None
) -> None:
    """A 300 MiB body is announced and only 1 KiB of it sent: the 401 must come from the
    headers alone (before: the daemon read and parsed the whole body first, so here it
    waited for bytes that never came, and with them grew to ~1 GB)."""
    with _connect(daemon) as sock:
        sock.sendall(_head("POST", "/v1/pulls", token, f"Content-Length: {300 << 20}\r\n"))
        sock.sendall(b"{" + b" " * 1023)
        status, headers, body = _answer(sock)
    assert status == 401, body
    assert json.loads(body) == {"error": "missing or wrong bearer token", "kind": "auth"}
    assert headers.get("www-authenticate") == "Bearer"


def test_an_announced_body_over_the_cap_is_refused_with_413(daemon: DaemonProcess) -> None:
    with _connect(daemon) as sock:
        sock.sendall(_head("POST", "/v1/pulls", TOKEN, f"Content-Length: {300 << 20}\r\n"))
        sock.sendall(b"{" + b" " * 1023)
        status, _, body = _answer(sock)
    assert status == 413, body
    answer = json.loads(body)
    assert set(answer) == {"error", "kind"} and answer["kind"] == "too-large", answer


def test_a_chunked_body_is_counted_and_refused_once_past_the_cap(daemon: DaemonProcess) -> None:
    """No Content-Length: the body is counted as it comes (before: read whole, then 422)."""
    piece = b" " * 8192
    with _connect(daemon) as sock:
        sock.sendall(_head("POST", "/v1/pulls", TOKEN, "Transfer-Encoding: chunked\r\n"))
        sock.sendall(b"1\r\n{\r\n")
        for _ in range(CAP // len(piece) + 1):
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        status, _, body = _answer(sock)
    assert status == 413, body
    assert json.loads(body)["kind"] == "too-large"


def test_a_small_chunked_body_still_queues_a_pull(daemon: DaemonProcess) -> None:
    """The cap changes nothing for real requests: a chunked, authenticated POST works."""
    payload = json.dumps({"sandbox": "ws"}).encode()
    with _connect(daemon) as sock:
        sock.sendall(_head("POST", "/v1/pulls", TOKEN, "Transfer-Encoding: chunked\r\n"))
        sock.sendall(f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n")
        status, _, body = _answer(sock)
    assert status == 202, body
    daemon.wait_job(json.loads(body)["id"], timeout=60)


@pytest.mark.parametrize(
    ("method", "path", "raw", "status"),
    [
        ("GET", "/v1/nope", None, 404),
        ("GET", "/nope", None, 404),
        ("PUT", "/v1/pulls", b"{}", 405),
        # nested deeper than the JSON parser recurses, yet under the body cap
        ("POST", "/v1/pulls", b"[" * 30000, 400),
    ],
)
def test_starlette_and_body_parse_errors_have_the_documented_shape(
    daemon: DaemonProcess, method: str, path: str, raw: bytes | None, status: int
) -> None:
    """Before: ``{"detail": "Not Found"}`` and the like, from Starlette and FastAPI's own
    handlers; the docs promise ``{"error", "kind"}`` for every error."""
    got, body = daemon.request(method, path, raw=raw)
    assert got == status, body
    assert isinstance(body, dict) and set(body) == {"error", "kind"}, body
    assert body["kind"] == "usage" and body["error"], body


def test_a_dest_that_is_a_dest_root_itself_is_refused_as_such(daemon: DaemonProcess) -> None:
    """Before: "resolves outside the allowed roots", which it does not."""
    root = daemon.root / "roots"
    for dest in (str(root), f"{root}/", f"{root}/."):
        status, body = daemon.request("POST", "/v1/pulls", {"sandbox": "ws", "dest": dest})
        assert status == 403, body
        assert body["kind"] == "forbidden", body
        assert "is a dest root itself" in body["error"], body
        assert "outside" not in body["error"], body


def test_a_connection_that_sends_no_whole_request_head_is_closed(daemon: DaemonProcess) -> None:
    """Found by a review: connections that sent nothing, or a request head a byte at a
    time, stayed open for good, and 505 of them took every file descriptor of a daemon
    (no token needed): the API stopped answering and pulls could not start."""
    from wsync.daemon.httpconn import HEAD_DEADLINE

    silent, trickle, pipelined = _connect(daemon), _connect(daemon), _connect(daemon)
    started = time.monotonic()
    # a whole head sent behind another in one write (pipelined): its response is a stream
    # that lasts; it must not be cut off at the deadline the first response re-armed
    pipelined.sendall(_head("GET", "/healthz", None, "") + _head("GET", "/v1/events", TOKEN, ""))
    try:
        trickle.settimeout(1.0)
        silent.settimeout(HEAD_DEADLINE + 30)
        head = _head("GET", "/healthz", None, "")
        closed = False
        for i in range(int(HEAD_DEADLINE * 4)):  # a byte each second, up to 4 deadlines
            try:
                trickle.sendall(head[i : i + 1])
                if trickle.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed, "a request head trickled a byte a second was never cut off"
        assert silent.recv(1) == b""  # closed by the daemon, not timed out here
        time.sleep(max(0.0, started + HEAD_DEADLINE + 2 - time.monotonic()))
        pipelined.settimeout(0.5)
        with contextlib.suppress(TimeoutError):  # nothing more to read, and still open
            while True:
                assert pipelined.recv(65536) != b"", "the pipelined event stream was cut off"
    finally:
        silent.close()
        trickle.close()
        pipelined.close()
    # and the door still opens for a whole request
    with _connect(daemon) as sock:
        sock.sendall(_head("GET", "/healthz", None, ""))
        status, _, _ = _answer(sock)
        assert status == 200


def _held_by(pid: int, server_port: int, sock: socket.socket) -> bool:
    """Whether process ``pid`` still holds the daemon's end of ``sock`` (a descriptor).

    Read from ``/proc``, not from ``sock``: a connection the daemon closed may stay
    established on this side for a while (its FIN queued behind the unread answer, in a
    socket the kernel keeps, no descriptor of the daemon's any more)."""
    client_port = sock.getsockname()[1]
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                local, remote, inode = fields[1], fields[2], fields[9]
                if (
                    int(local.rsplit(":", 1)[1], 16) == server_port
                    and int(remote.rsplit(":", 1)[1], 16) == client_port
                    and inode != "0"
                ):
                    inodes.add(f"socket:[{inode}]")
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return bool(inodes & held)


def test_a_client_that_never_reads_its_answers_is_dropped(daemon: DaemonProcess) -> None:
    """Found by a red-team review: a client with a tiny receive window that pipelined
    ``GET /openapi.json`` (no token needed) and never read kept its connection for good:
    the answer it did not read never completed, so the head deadline never came back,
    and enough such clients took every file descriptor of the daemon.  One that sends a
    single request and never reads its answer is let go in time too."""
    from wsync.daemon.httpconn import HEAD_DEADLINE, WRITE_STALL_DEADLINE

    assert daemon.proc is not None
    pid = daemon.proc.pid
    host, _, port = daemon.address.rpartition(":")
    clients = []
    for count in (400, 1):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # a tiny window
        sock.settimeout(20)
        sock.connect((host, int(port)))
        sock.sendall(_head("GET", "/openapi.json", None, "") * count)
        clients.append(sock)
    try:
        time.sleep(1)
        assert all(_held_by(pid, int(port), s) for s in clients)  # the probe sees them
        bound = HEAD_DEADLINE + WRITE_STALL_DEADLINE + 60  # generous for a loaded machine
        deadline = time.monotonic() + bound
        while any(_held_by(pid, int(port), s) for s in clients):
            assert time.monotonic() < deadline, (
                f"the daemon still holds {[_held_by(pid, int(port), s) for s in clients]} "
                f"after {bound:.0f} s"
            )
            time.sleep(0.5)
    finally:
        for sock in clients:
            sock.close()
    with _connect(daemon) as sock:  # and the door still opens for a whole request
        sock.sendall(_head("GET", "/healthz", None, ""))
        status, _, _ = _answer(sock)
        assert status == 200


def test_connections_may_take_half_the_open_file_limit_and_no_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other half stays for pulls: the red team's non-reading clients had taken all."""
    from wsync.daemon import httpconn

    for soft, cap in ((256, 128), (100, httpconn.MIN_CONNECTIONS), (1 << 20, 1 << 19)):
        monkeypatch.setattr(httpconn.resource, "getrlimit", lambda _which, s=soft: (s, s))
        assert httpconn.connection_cap() == cap


def _read_slowly(
    monkeypatch: pytest.MonkeyPatch, size: int, pause: float, give_up: float, rcvbuf: int
) -> tuple[int, int]:
    """A 4 MiB answer from a real uvicorn with the daemon's connection class, its stall
    deadline lowered to 1.5 s, read ``size`` bytes at a time ``pause`` seconds apart for
    at most ``give_up`` seconds, then at full speed to the end: (bytes received, of how
    many).  Fewer than all: the server dropped the connection.  ``rcvbuf`` is set before
    the connection is made (the window the client offers: how far one read moves the
    server's send queue)."""
    import asyncio
    import threading

    import uvicorn

    from wsync.daemon import httpconn

    monkeypatch.setattr(httpconn, "WRITE_STALL_DEADLINE", 1.5)
    body = b"x" * (4 << 20)

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        head = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": head})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": body})  # type: ignore[operator]

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=httpconn.DeadlineH11, log_level="warning",
        lifespan="off",
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline, "the server never started"
            time.sleep(0.05)
        with socket.socket() as sock:
            sock.settimeout(30)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while b"\r\n\r\n" not in got:
                got += sock.recv(65536)
            received = len(got.partition(b"\r\n\r\n")[2])
            until = time.monotonic() + give_up
            with contextlib.suppress(ConnectionResetError):
                while received < len(body) and time.monotonic() < until:
                    chunk = sock.recv(size)
                    if not chunk:
                        return received, len(body)
                    received += len(chunk)
                    time.sleep(pause)
                # then at full speed: a live connection gives the rest, a dropped one
                # ends with what the kernel had buffered
                while received < len(body) and (chunk := sock.recv(1 << 20)):
                    received += len(chunk)
            return received, len(body)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_a_slow_client_that_keeps_reading_a_large_answer_is_not_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stall deadline bounds the time between two reads, not the time an answer
    takes: a 4 MiB answer read at most 256 KiB at a time, 0.3 s apart (the writes paused all
    along), with the deadline lowered to 1.5 s, comes whole.  Found by a review: the
    deadline counted from the pause, and such a client got an RST at 6%.  Then by a CI
    run: the deadline watched the transport's buffer only, which stays put while the
    kernel's send queue (grown to megabytes) drains, and a client reading every 0.1 s
    was dropped on a loaded machine, one reading every 0.3 s on any."""
    received, whole = _read_slowly(monkeypatch, 256 * 1024, 0.3, give_up=600, rcvbuf=64 << 10)
    assert received == whole, f"dropped after {received} of {whole} bytes"


def test_a_client_that_only_trickles_its_answer_out_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The send queue moves with every segment the peer takes, so counting it (above)
    let a client hold a connection by reading a few hundred bytes a deadline (found by a
    review): a paused answer must now move by MIN_PROGRESS (16 KiB) within each one.
    2 KiB every 0.3 s through a 4 KiB window moves it by about 10 KiB per 1.5 s
    deadline: dropped within 8 s, where it was kept to the end."""
    received, whole = _read_slowly(monkeypatch, 2048, 0.3, give_up=8, rcvbuf=4096)
    assert received < whole, "a trickle held the connection: it read the whole answer"


def test_a_close_with_an_answer_unread_is_bounded_though_nothing_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvicorn closes a connection itself in the middle of its send ("Connection: close",
    an error): the close waits for the buffer to drain, for good if the peer never reads,
    and an answer left under the high-water mark never paused the writes, so no deadline
    was armed (found by a review: the descriptor stayed).  Any close with bytes unsent
    is now bounded like a stall."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from wsync.daemon import httpconn

    monkeypatch.setattr(httpconn, "WRITE_STALL_DEADLINE", 0.5)

    async def app(scope: object, receive: object, send: object) -> None:
        return None

    async def run() -> tuple[int, bool, bool]:
        ours, peer = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read
        loop = asyncio.get_running_loop()
        config = uvicorn.Config(app, lifespan="off", log_level="warning")
        state = ServerState()
        try:
            transport, proto = await loop.connect_accepted_socket(
                lambda: httpconn.DeadlineH11(config, state, {}, loop), sock=ours
            )
            proto._disarm()  # a request head came (handle_events): no head deadline now
            transport.write(b"x" * 40_000)  # under the 64 KiB high-water mark: no pause
            unsent = transport.get_write_buffer_size()
            transport.close()
            for _ in range(400):  # (20 s: the deadline is 0.5 s)
                if proto not in state.connections:
                    break
                await asyncio.sleep(0.05)
            return unsent, proto in state.connections, transport.is_closing()
        finally:
            peer.close()

    unsent, held, closing = asyncio.run(run())
    assert 0 < unsent < 64 * 1024, unsent  # the case: something unsent, nothing paused
    assert closing and not held
