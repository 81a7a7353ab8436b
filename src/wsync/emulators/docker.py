"""A Docker Engine API on a unix socket whose execs lose bytes the way the field says.

Each container is a directory under ``root`` (the default working directory of its
execs).  Each exec runs as a local process in its own session and speaks the daemon's
real wire format (:mod:`wsync.transports.docker_protocol`):

* ``POST /containers/{id}/exec`` → 201 ``{"Id"}`` (64 hex digits); 404 ``No such
  container``; 409 when the container is stopped; 400 for an empty ``Cmd``;
* ``POST /exec/{id}/start`` → the hand-written ``HTTP/1.1 101 UPGRADED`` head when the
  client asked for ``Upgrade: tcp`` (else ``200 OK`` with the raw-stream content type,
  multiplexed all the same), then frames of at most 32 KiB as the pipes are read, stdin
  from the socket until the client half-closes, and EOF by closing once the pipes closed
  and the process exited.  A command that cannot be started is reported *in the stream*
  as a stdout frame of text, exit 126/127.  409 for an exec started twice;
* ``GET /exec/{id}/json`` → ``Running``/``ExitCode``/``Pid``; ``ExitCode`` is ``null``
  while the process runs (a background child holding stdout does not keep it null);
* ``GET /_ping`` → ``OK``.  A ``/v1.NN`` prefix is accepted on every path.

As with moby, a client that goes away does not stop its exec: the output is discarded
until the process ends or something kills it.

Faults (:mod:`wsync.emulators.docker_faults`), drawn per start from a seeded RNG:
``ExitCode: null`` for a while after EOF, a dropped final frame (the last output before
the process ends; output followed by 0.1 s of quiet while the process waits for more
stdin gets through, counted as ``released_final``), the EOF withheld after
the exit, frames written in pieces (split headers), ``200 OK`` instead of ``101``, and
a process that starts seconds after its start was answered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import random
import re
import secrets
import time
from pathlib import Path
from typing import Any

import h11

from wsync.emulators.docker_faults import DockerFaults, StartPlan
from wsync.emulators.sprites import (
    RELEASE_WINDOW,
    end_process,
    kill_group,
    waiting_for_stdin,
)
from wsync.emulators.thread import BackgroundEmulator
from wsync.errors import ProtocolError
from wsync.transports.docker_protocol import (
    CHUNK,
    MULTIPLEXED,
    RAW_STREAM,
    STDERR,
    STDOUT,
    ExecConfig,
    Inspect,
    encode_frame,
    error_body,
    parse_exec_create,
)

__all__ = ["DockerEmulator", "DockerFaults", "EmulatorThread"]

log = logging.getLogger(__name__)

VERSION_PREFIX = re.compile(r"^/v1\.\d+(?=/)")
MAX_BODY = 1024 * 1024


class _Exec:
    """One exec: created, then started once; its process and what inspect says."""

    def __init__(self, exec_id: str, container: str, config: ExecConfig) -> None:
        self.id = exec_id
        self.container = container
        self.config = config
        self.started = False
        self.proc: asyncio.subprocess.Process | None = None
        #: set when the command could not be started (126/127)
        self.failed_code: int | None = None
        #: the fault: inspect hides the exit code until this moment (monotonic)
        self.null_until = 0.0

    def inspect(self) -> Inspect:
        if self.failed_code is not None:
            return Inspect(False, self.failed_code, 0)
        proc = self.proc
        if proc is None or proc.returncode is None:
            return Inspect(self.started, None, proc.pid if proc else 0)
        if time.monotonic() < self.null_until:
            return Inspect(True, None, proc.pid)
        code = proc.returncode
        return Inspect(False, code if code >= 0 else 128 - code, proc.pid)


class _Conn:
    """A client connection: h11 for requests, raw bytes once hijacked."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        self.gone = False

    async def send(self, data: bytes) -> None:
        if self.gone or not data:
            return
        self.writer.write(data)
        try:
            await self.writer.drain()
        except (ConnectionError, OSError):
            self.gone = True

    async def reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        headers = [("Content-Type", ctype), ("Content-Length", str(len(body)))]
        out = self.h11.send(h11.Response(status_code=status, headers=headers)) or b""
        out += self.h11.send(h11.Data(data=body)) or b""
        out += self.h11.send(h11.EndOfMessage()) or b""
        await self.send(out)


class DockerEmulator:
    """The daemon: ``await start()``, point ``DOCKER_HOST`` at :attr:`url`, ``await stop()``."""

    def __init__(
        self,
        root: Path,
        *,
        faults: DockerFaults | None = None,
        socket_path: Path | None = None,
        tcp: bool = False,
    ) -> None:
        self.root = Path(root)
        self.faults = faults or DockerFaults.off()
        self.socket_path = socket_path or self.root / "docker.sock"
        self.tcp = tcp
        self.stats: collections.Counter[str] = collections.Counter()
        self.execs: dict[str, _Exec] = {}
        self.stopped: set[str] = set()
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._calls = 0
        self.tcp_port = 0

    @property
    def url(self) -> str:
        """The ``DOCKER_HOST`` of this daemon (its unix socket)."""
        return f"unix://{self.socket_path}"

    @property
    def tcp_url(self) -> str:
        return f"tcp://127.0.0.1:{self.tcp_port}"

    def transport_options(self) -> dict[str, Any]:
        """Options for :meth:`DockerTransport.from_uri` that reach this emulator (the
        held-EOF fault costs a poll interval and a linger, not seconds each)."""
        return {"docker_host": self.url, "docker_poll_interval": 0.5, "docker_linger": 0.5}

    def create_container(self, name: str) -> Path:
        path = self.root / "containers" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _container_dir(self, name: str) -> Path | None:
        path = self.root / "containers" / name
        if "/" in name or name in ("", ".", "..") or not path.is_dir():
            return None
        return path

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self._servers.append(
            await asyncio.start_unix_server(self._on_connect, str(self.socket_path))
        )
        if self.tcp:
            server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
            self.tcp_port = server.sockets[0].getsockname()[1]
            self._servers.append(server)

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        self._servers.clear()
        live = [e.proc for e in self.execs.values() if e.proc and e.proc.returncode is None]
        for proc in live:
            kill_group(proc)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # reaped on this loop, before it closes (a guest helper whose client just let go
        # may still be ending: its exit after the loop's close is a warning on stderr);
        # all at once, and a few seconds at most whatever happens
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await asyncio.gather(
                    *(end_process(p, kill=p.returncode is None) for p in live),
                    return_exceptions=True,
                )
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def __aenter__(self) -> DockerEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _plan(self) -> StartPlan:
        self._calls += 1
        return self.faults.plan(random.Random(f"{self.faults.seed}/{self._calls}"))  # noqa: S311

    # ------------------------------------------------------------------ HTTP

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = _Conn(reader, writer)
        try:
            while await self._serve_one(conn):
                conn.h11.start_next_cycle()
        except (ConnectionError, OSError, h11.ProtocolError) as err:
            log.debug("docker emulator: connection ended: %r", err)
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve_one(self, conn: _Conn) -> bool:
        """One request; True when the connection may carry another."""
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.h11.next_event()
            if event is h11.NEED_DATA:
                conn.h11.receive_data(await conn.reader.read(65536))
                continue
            if isinstance(event, h11.ConnectionClosed):
                return False
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY:
                    return False
            elif isinstance(event, h11.EndOfMessage):
                break
        assert request is not None
        method = request.method.decode("ascii", "replace")
        path = VERSION_PREFIX.sub("", request.target.decode("ascii", "replace").split("?")[0])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        parts = path.strip("/").split("/")
        if method == "GET" and path == "/_ping":
            await conn.reply(200, b"OK", "text/plain")
        elif method == "POST" and len(parts) == 3 and parts[::2] == ["containers", "exec"]:
            await self._create(conn, parts[1], bytes(body))
        elif method == "POST" and len(parts) == 3 and parts[::2] == ["exec", "start"]:
            await self._start(conn, parts[1], headers)
            return False  # hijacked (or refused): never reused
        elif method == "GET" and len(parts) == 3 and parts[::2] == ["exec", "json"]:
            entry = self.execs.get(parts[1])
            if entry is None:
                await conn.reply(404, error_body(f"No such exec instance: {parts[1]}"))
            else:
                self.stats["inspects"] += 1
                state = entry.inspect()
                if state.running and entry.proc is not None and entry.proc.returncode is not None:
                    self.stats["inspect_null_after_exit"] += 1
                await conn.reply(200, state.to_json(entry.id, entry.container))
        else:
            await conn.reply(404, error_body(f"page not found: {method} {path}"))
        return not conn.gone and conn.h11.our_state is h11.DONE

    async def _create(self, conn: _Conn, container: str, body: bytes) -> None:
        if self._container_dir(container) is None:
            self.stats["no_such_container"] += 1
            await conn.reply(404, error_body(f"No such container: {container}"))
            return
        if container in self.stopped:
            await conn.reply(409, error_body(f"Container {container} is not running"))
            return
        try:
            config = parse_exec_create(body)
        except ProtocolError as err:
            await conn.reply(400, error_body(str(err)))
            return
        exec_id = secrets.token_hex(32)
        self.execs[exec_id] = _Exec(exec_id, container, config)
        self.stats["execs"] += 1
        await conn.reply(201, f'{{"Id":"{exec_id}"}}'.encode())

    # ----------------------------------------------------------------- start

    async def _start(self, conn: _Conn, exec_id: str, headers: dict[str, str]) -> None:
        entry = self.execs.get(exec_id)
        if entry is None:
            await conn.reply(404, error_body(f"No such exec instance: {exec_id}"))
            return
        if entry.started:
            await conn.reply(409, error_body(f"Exec command {exec_id} has already run"))
            return
        entry.started = True
        plan = self._plan()
        slow = self.faults.start_delay > 0 and self._calls <= self.faults.slow_starts
        upgrade = "upgrade" in headers.get("connection", "").lower() and not plan.answer_200
        if upgrade:
            head = (
                "HTTP/1.1 101 UPGRADED\r\n"
                f"Content-Type: {MULTIPLEXED}\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
            )
        else:
            self.stats["answered_200"] += 1
            head = f"HTTP/1.1 200 OK\r\nContent-Type: {RAW_STREAM}\r\n\r\n"
        await conn.send(head.encode())
        early, _ = conn.h11.trailing_data  # stdin bytes sent right behind the request
        if slow:
            # moby answers the upgrade, then asks containerd to start the process
            await asyncio.sleep(self.faults.start_delay)
        home = self._container_dir(entry.container) or self.root
        config = entry.config
        env = dict(os.environ)
        env.update(config.env)
        try:
            proc = await asyncio.create_subprocess_exec(
                *config.cmd,
                cwd=config.workdir or str(home),
                env=env,
                stdin=asyncio.subprocess.PIPE if config.stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as err:
            # moby writes start failures into the stream, through the stdout writer
            entry.failed_code = 127 if isinstance(err, FileNotFoundError) else 126
            text = f"OCI runtime exec failed: exec failed: unable to start container process: {err}"
            await conn.send(encode_frame(STDOUT, f"{text}\r\n".encode()))
            return
        entry.proc = proc
        if slow:
            self.stats["slow_starts"] += 1  # counted once the process exists
        if plan.exit_null_for is not None:
            entry.null_until = float("inf")  # until EOF + the drawn delay
        feeder = asyncio.create_task(self._feed_stdin(conn, proc, bytes(early)))
        try:
            await self._stream(conn, entry, proc, plan, feeder)
        finally:
            if not feeder.done():
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feeder

    async def _feed_stdin(
        self, conn: _Conn, proc: asyncio.subprocess.Process, early: bytes
    ) -> None:
        """Socket → the command's stdin until the client half-closes (its only EOF)."""
        stdin = proc.stdin
        if stdin is None:
            return
        data, broken = early, False
        try:
            while True:
                if data and not broken:
                    try:
                        stdin.write(data)
                        await stdin.drain()
                    except (ConnectionError, OSError):
                        # the command closed its stdin or exited: containerd's shim
                        # holds the fifo, so the daemon keeps reading and drops the rest
                        broken = True
                        stdin.close()
                data = await conn.reader.read(65536)
                if not data:
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                stdin.close()

    async def _stream(
        self,
        conn: _Conn,
        entry: _Exec,
        proc: asyncio.subprocess.Process,
        plan: StartPlan,
        feeder: asyncio.Task[None],
    ) -> None:
        out, err = proc.stdout, proc.stderr
        assert out is not None and err is not None
        queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue(maxsize=64)

        async def pump(stream: int, reader: asyncio.StreamReader) -> None:
            while data := await reader.read(CHUNK):
                await queue.put((stream, data))

        async def pumps() -> None:
            await asyncio.gather(pump(STDOUT, out), pump(STDERR, err))
            await queue.put(None)

        pumping = asyncio.create_task(pumps())
        # the drop-final fault keeps the newest frame back while more may follow: sent
        # when the next one comes, or when RELEASE_WINDOW passes while the process waits
        # for more of a stdin still open (a helper between requests); lost when its
        # output ends first.  moby's race is with the exit: a long-lived helper's answers
        # arrive, that late, and a command whose stdin has ended (or never had one) loses
        # its last frame whatever the timing
        held: bytes | None = None
        splits = 0
        try:
            while True:
                if held is None:
                    item = await queue.get()
                else:
                    try:
                        item = await asyncio.wait_for(queue.get(), RELEASE_WINDOW)
                    except TimeoutError:
                        if feeder.done() or not waiting_for_stdin(proc):
                            continue  # its last output: lost when the output ends
                        frame, held = held, None
                        self.stats["released_final"] += 1
                        await conn.send(frame)
                        continue
                if item is None:
                    break
                frame = encode_frame(*item)
                if plan.drop_final:
                    frame, held = held or b"", frame
                    if not frame:
                        continue
                if plan.split and splits < 8 and len(frame) > 1:
                    splits += 1
                    cut = plan.rng.randrange(1, min(len(frame), 12))
                    await conn.send(frame[:cut])
                    await asyncio.sleep(0.002)
                    frame = frame[cut:]
                await conn.send(frame)
            if held is not None:
                self.stats["dropped_final"] += 1
            await end_process(proc, kill=False)
        finally:
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pumping
        if plan.split and splits:
            self.stats["split_frames"] += 1
        if plan.hold_for is not None and not conn.gone:
            # no output, no EOF: what a background child holding stdout looks like
            self.stats["held_eof"] += 1
            await asyncio.sleep(plan.hold_for)
        if plan.exit_null_for is not None:
            self.stats["exit_null"] += 1
            entry.null_until = time.monotonic() + plan.exit_null_for
        # EOF: the caller closes the connection


class EmulatorThread(BackgroundEmulator[DockerEmulator, DockerFaults]):
    """Runs a :class:`DockerEmulator` on its own loop in a background thread::

    with EmulatorThread(root, faults=DockerFaults.all_on()) as emu:
        emu.create_container("ctr")
        pull_uri("docker://ctr/work", dest, opts, emu.transport_options())
    """

    thread_name = "docker-emulator"

    def __init__(
        self, root: Path, *, faults: DockerFaults | None = None, tcp: bool = False
    ) -> None:
        super().__init__(DockerEmulator(root, faults=faults, tcp=tcp))

    @property
    def tcp_url(self) -> str:
        return self.emulator.tcp_url

    def create_container(self, name: str) -> Path:
        return self.emulator.create_container(name)

    def create_sandbox(self, name: str) -> Path:
        """The other emulators' name for it (bench, demo)."""
        return self.create_container(name)

    def stop_container(self, name: str) -> None:
        self.emulator.stopped.add(name)
