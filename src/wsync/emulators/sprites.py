"""A Sprites exec service on loopback that loses bytes the way field report 1 does.

Each sprite is a directory under ``root``; an exec runs its argv as a local
subprocess (cwd = the ``dir`` query parameter, else the sprite directory) and
speaks the real wire format (:mod:`wsync.transports.sprites_protocol`).  The
faults of the report are reproduced mechanically, each switchable in
:class:`SpritesFaults` and drawn per exec from a seeded RNG:

* **pre-attach ring** — the exec is a session; the client is *attached* only
  later.  Output produced before attach survives only as its last
  ``ring_bytes`` (64 KiB), output after attach is live and intact, and the
  client's stdin reaches the process only once it is attached.  So a fast
  ``cat`` of 1 MiB delivers exactly its last 64 KiB, while wsync's read
  scripts (which wait for a stdin byte before printing) lose nothing.
* **merged stderr** — stderr is held back and appended to the next stdout
  frame (``AAAA``/``BBBB``>&2/``CCCC`` arrives as ``AAAACCCCBBBB`` on stream 1).
* **data after exit** — the last output is split around the exit frame (held back
  until the exit, unless the command is seen blocked reading more stdin 0.1 s later:
  a guest helper between requests gets its answer through, ``held_released``).
* **no exit frame** — the socket closes with code 1000 and no exit status.
* **zero frames** — a fast command gets no frames at all, then a 1000 close.
* **sever** — the TCP connection is aborted part-way through the output.
* **linger** — the server holds the socket open after the exit frame.

``debug`` and ``session_info`` (``is_owner: false``) text frames are sent as
the real service does.  Auth is a bearer token (401 otherwise); unknown
sprites are 404.

Attach timing: with ``attach_delay`` the client attaches after a random delay
(realistic, timing-dependent, as in the report).  With ``attach_delay=None``
attach happens at the first stdin frame, once ``attach_after_bytes`` of
output exist, or at process exit, whichever comes first — deterministic, for
the naive-client table test.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from wsync.emulators.sprites_faults import ExecPlan, SpritesFaults
from wsync.emulators.thread import BackgroundEmulator
from wsync.errors import ProtocolError
from wsync.transports.sprites_protocol import (
    STDERR,
    STDIN,
    STDOUT,
    Data,
    ExecRequest,
    StdinEOF,
    decode,
    encode_control,
    encode_data,
    encode_exit,
    encode_exit_text,
    parse_exec_path,
)

__all__ = ["EmulatorThread", "ExecPlan", "SpritesEmulator", "SpritesFaults"]

log = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
READ_SIZE = 64 * KiB
#: after the main process exits, pipes still held open by its children are
#: abandoned after this long (a detached producer must not pin the exec)
PIPE_GRACE = 1.0
#: the emulator's default bearer token: a loopback test fixture, not a secret
EMULATOR_TOKEN = "wsync-emulator-token"  # noqa: S105


def kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL an exec the client abandoned, and its process group.

    Only abandoned execs are killed this way: a command that exits normally
    leaves its detached children alone (wsync's producer must survive).
    """
    # os.killpg/os.kill, not proc.kill(): Popen.send_signal() polls first, which can
    # reap the child behind asyncio's child watcher ("Unknown child process").
    # start_new_session=True made the command its group's leader (pgid == pid).
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    except PermissionError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)


def still_running(proc: asyncio.subprocess.Process | None) -> bool:
    """The process has not exited (a zombie has), whether or not it was reaped yet: its
    own word in ``/proc``, not the event loop's (a loop busy for a moment must not pass
    an exited command for a running one).  The emulators' lost-tail faults ask it."""
    if proc is None or proc.returncode is not None:
        return False
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rpartition(b") ")[2][:1] not in (b"Z", b"X")


#: how long the emulators' end-of-stream faults (docker's lost final frame, the k8s lost
#: tail, data after the exit here) hold output back before they ask
#: :func:`waiting_for_stdin`: output of a command waiting for more is not its last
RELEASE_WINDOW = 0.1


def waiting_for_stdin(proc: asyncio.subprocess.Process | None) -> bool:
    """The process is blocked reading its stdin pipe (``pipe_read`` in its wait channel,
    fd 0 the first argument of its system call where ``/proc`` tells): it wants more
    input, as a guest helper between requests does; a wrapper waiting for its child, or
    a command at its end, does not."""
    if not still_running(proc):
        return False
    assert proc is not None
    try:
        wchan = Path(f"/proc/{proc.pid}/wchan").read_text()
    except OSError:
        return False
    if not wchan.endswith("pipe_read"):
        return False
    try:
        call = Path(f"/proc/{proc.pid}/syscall").read_text().split()
    except OSError:
        return True  # (not readable here: the wait channel alone says it)
    return len(call) < 2 or call[1] == "0x0"


async def end_process(proc: asyncio.subprocess.Process, *, kill: bool) -> int:
    """Optionally kill, then close the pipes and reap; returns the raw return code.

    Closing the subprocess transport matters: asyncio's ``wait()`` resolves only
    once every pipe is disconnected, and a pipe whose reader was abandoned (its
    buffer full, reading paused) never sees EOF — ``wait()`` would hang and the
    transport would leak.  There is no public close on ``Process``.
    """
    if kill:
        kill_group(proc)
        # Let asyncio's child watcher see the death before closing: the transport's
        # close() calls Popen.poll(), which would reap the child behind its back.
        for _ in range(500):
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.01)
    elif proc.returncode is None:
        # pipes all closed but the command still runs: wait for it (the session
        # is cancelled, and the command killed, if the client goes away)
        return await proc.wait()
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport.close()
    try:
        async with asyncio.timeout(10):
            return await proc.wait()
    except TimeoutError:
        log.warning("sprites emulator: pid %d did not exit after close", proc.pid)
        return -signal.SIGKILL


class _Session:
    """One exec: a subprocess, its output pipeline and one WebSocket."""

    def __init__(
        self, emu: SpritesEmulator, ws: ServerConnection, req: ExecRequest, plan: ExecPlan
    ) -> None:
        self.emu = emu
        self.ws = ws
        self.req = req
        self.plan = plan
        self.faults = emu.faults
        self.proc: asyncio.subprocess.Process | None = None
        self.attached = asyncio.Event()
        self.finished = asyncio.Event()
        self.queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue(maxsize=64)
        self.history: collections.deque[tuple[int, bytes]] = collections.deque()
        self.history_len = 0
        self.produced = 0
        self.held_err = b""
        self.exit_code = 0
        self.reading: set[int] = set()
        self.sent = 0
        self.pid = 0

    # ------------------------------------------------------------ attach/ring

    def attach(self, why: str) -> None:
        if not self.attached.is_set():
            log.debug("sprites emulator: attached (%s) after %d bytes", why, self.produced)
            self.attached.set()

    async def emit(self, stream: int, data: bytes) -> None:
        if self.plan.merged:
            if stream == STDERR:
                self.held_err += data
                return
            data, self.held_err = data + self.held_err, b""
        if not data:
            return
        if self.attached.is_set():
            await self.queue.put((stream, data))
            return
        self.produced += len(data)
        self.history.append((stream, data))
        self.history_len += len(data)
        while self.history_len > self.faults.ring_bytes:
            drop = self.history_len - self.faults.ring_bytes
            first_stream, first = self.history[0]
            cut = min(drop, len(first))
            self.emu.stats["ring_dropped_bytes"] += cut
            self.history_len -= cut
            if cut == len(first):
                self.history.popleft()
            else:
                self.history[0] = (first_stream, first[cut:])
        limit = self.faults.attach_after_bytes
        if limit is not None and self.produced >= limit:
            self.attach("size")

    # -------------------------------------------------------------- process

    async def spawn(self) -> None:
        cwd = self.req.workdir or str(self.emu.root / self.req.name)
        env = dict(os.environ)
        env.update(self.req.env)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.req.argv,
                cwd=cwd,
                env=env,
                stdin=asyncio.subprocess.PIPE if self.req.stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                # its own process group, so an abandoned exec is killed with its children
                start_new_session=True,
            )
            self.pid = self.proc.pid
        except OSError as err:
            self.exit_code = 126 if isinstance(err, PermissionError) else 127
            await self.emit(STDERR, f"exec {self.req.argv[0]}: {err.strerror}\n".encode())

    async def pump(self, stream: int, reader: asyncio.StreamReader) -> None:
        while True:
            self.reading.add(stream)
            data = await reader.read(READ_SIZE)
            self.reading.discard(stream)
            if not data:
                return
            await self.emit(stream, data)

    async def run_process(self) -> None:
        """Wait for the process and its pipes, then attach and end the output."""
        proc = self.proc
        if proc is not None:
            assert proc.stdout is not None and proc.stderr is not None
            pumps = {
                asyncio.create_task(self.pump(STDOUT, proc.stdout)): STDOUT,
                asyncio.create_task(self.pump(STDERR, proc.stderr)): STDERR,
            }
            try:
                # Not ``proc.wait()`` first: asyncio only reports the exit once every
                # pipe is closed, and a child of the command may hold them open.
                # Pipes are abandoned only PIPE_GRACE after the exit was first seen, so
                # output still buffered in a pipe at exit is never cut off.
                loop = asyncio.get_running_loop()
                pending = set(pumps)
                exited_at: float | None = None
                while pending:
                    _, pending = await asyncio.wait(pending, timeout=0.1)
                    if not pending or proc.returncode is None:
                        continue
                    if exited_at is None:
                        exited_at = loop.time()
                    if loop.time() - exited_at < PIPE_GRACE:
                        continue
                    for task in pending:
                        if pumps[task] in self.reading:  # a child holds the pipe open
                            task.cancel()
                            self.emu.stats["pipes_abandoned"] += 1
            finally:
                for task in pumps:
                    task.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
            code = await end_process(proc, kill=False)
            # a signal death is reported the way a shell does: 128 + signal number
            self.exit_code = code if code >= 0 else 128 - code
        if self.held_err:
            data, self.held_err = self.held_err, b""
            self.plan.merged = False
            await self.emit(STDOUT, data)
        self.finished.set()
        self.attach("exit")
        await self.queue.put(None)

    async def forward_stdin(self) -> None:
        """Client frames → process stdin, but only once the client is attached."""
        with contextlib.suppress(ConnectionClosed):
            async for message in self.ws:
                try:
                    frame = decode(message)
                except ProtocolError as err:
                    log.debug("sprites emulator: bad client frame: %s", err)
                    continue
                if self.faults.attach_delay is None:
                    self.attach("stdin")
                await self.attached.wait()
                stdin = self.proc.stdin if self.proc is not None else None
                if stdin is None:
                    continue
                try:
                    if isinstance(frame, Data) and frame.stream == STDIN:
                        stdin.write(frame.data)
                        await stdin.drain()
                    elif isinstance(frame, StdinEOF):
                        stdin.close()
                except (BrokenPipeError, ConnectionResetError):
                    continue

    async def attach_timer(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self.attach("timer")

    # --------------------------------------------------------------- output

    async def send(self, stream: int, data: bytes) -> None:
        pieces = [data]
        if self.plan.split and len(data) > 1:
            cuts = sorted(self.plan.rng.sample(range(1, len(data)), min(3, len(data) - 1)))
            pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        for piece in pieces:
            sever = self.plan.sever_after
            if sever is not None and self.sent + len(piece) > sever:
                await self.ws.send(encode_data(stream, piece[: max(sever - self.sent, 0)]))
                self.emu.stats["severed"] += 1
                self.ws.transport.abort()
                raise ConnectionAbortedError("severed by fault plan")
            await self.ws.send(encode_data(stream, piece))
            self.sent += len(piece)

    async def write_output(self, started: float) -> None:
        plan = self.plan
        loop = asyncio.get_running_loop()
        if plan.zero_frames:
            remaining = started + self.faults.fast_threshold - loop.time()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(remaining, 0.0)):
                    await self.finished.wait()
            if self.finished.is_set():
                self.emu.stats["zero_frames"] += 1
                return
        await self.attached.wait()
        argv0 = self.req.argv[0]
        t_ms = int((loop.time() - started) * 1000)
        for msg in (f"session_created cmd={argv0}", f"normal_path history_len={self.produced}"):
            await self.ws.send(encode_control("debug", msg=msg, pid=self.pid, t_ms=t_ms))
        await self.ws.send(
            encode_control(
                "session_info",
                session_id=str(self.pid),
                command=argv0,
                created=int(time.time()),
                is_owner=False,
                tty=False,
            )
        )
        held: tuple[int, bytes] | None = None
        history = list(self.history)
        self.history.clear()
        while True:
            item: tuple[int, bytes] | None
            if history:
                item = history.pop(0)
            elif held is None:
                item = await self.queue.get()
            else:
                try:
                    item = await asyncio.wait_for(self.queue.get(), RELEASE_WINDOW)
                except TimeoutError:
                    # the data-after-exit fault holds the newest frame for the exit; a
                    # command blocked reading more stdin (a helper between requests) is
                    # not exiting: the frame goes now
                    if waiting_for_stdin(self.proc):
                        self.emu.stats["held_released"] += 1
                        await self.send(*held)
                        held = None
                    continue
            if item is None:
                break
            if plan.after_exit:
                item, held = held, item
                if item is None:
                    continue
            await self.send(*item)
        after: tuple[int, bytes] | None = None
        if held is not None:
            stream, data = held
            cut = plan.rng.randrange(len(data))
            if cut:
                await self.send(stream, data[:cut])
            after = (stream, data[cut:])
        if plan.no_exit:
            self.emu.stats["no_exit_frame"] += 1
        elif plan.json_exit:
            await self.ws.send(encode_exit_text(self.exit_code))
        else:
            await self.ws.send(encode_exit(min(self.exit_code, 255)))
        if after is not None:
            self.emu.stats["data_after_exit"] += 1
            await self.send(*after)
        if self.faults.linger > 0:
            await asyncio.sleep(self.faults.linger)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        if not self.plan.ring:
            self.attach("no ring")
        await self.spawn()
        if self.proc is not None:
            self.emu.procs.add(self.proc)
        tasks = [
            asyncio.create_task(self.run_process()),
            asyncio.create_task(self.forward_stdin()),
        ]
        if self.plan.attach_delay is not None:
            tasks.append(asyncio.create_task(self.attach_timer(self.plan.attach_delay)))
        writer = asyncio.create_task(self.write_output(started))
        closed = asyncio.create_task(self.ws.wait_closed())
        try:
            await asyncio.wait({writer, closed}, return_when=asyncio.FIRST_COMPLETED)
            if writer.done() and not writer.cancelled() and writer.exception() is not None:
                log.debug("sprites emulator: writer ended: %r", writer.exception())
        finally:
            for task in [*tasks, writer, closed]:
                task.cancel()
            await asyncio.gather(*tasks, writer, closed, return_exceptions=True)
            await self.reap()

    async def reap(self) -> None:
        if self.proc is not None:
            await end_process(self.proc, kill=self.proc.returncode is None)
            self.emu.procs.discard(self.proc)


class SpritesEmulator:
    """The service: ``await start()``, use :attr:`url` and :attr:`token`, ``await stop()``."""

    def __init__(
        self,
        root: Path,
        *,
        token: str = EMULATOR_TOKEN,
        faults: SpritesFaults | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.root = Path(root)
        self.token = token
        self.faults = faults or SpritesFaults.off()
        self.host = host
        self.port = port
        self.stats: collections.Counter[str] = collections.Counter()
        self.procs: set[asyncio.subprocess.Process] = set()
        self._server: Server | None = None
        self._execs = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def transport_options(self) -> dict[str, Any]:
        """Options for :meth:`SpritesTransport.from_uri` that reach this emulator."""
        return {"sprites_url": self.url, "token": self.token}

    def create_sprite(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._server = await serve(
            self._handle,
            self.host,
            self.port,
            process_request=self._check_request,
            compression=None,
            max_size=16 * MiB,
            close_timeout=2,
        )
        sock = next(iter(self._server.sockets))
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for proc in list(self.procs):
            await end_process(proc, kill=proc.returncode is None)
        self.procs.clear()

    async def __aenter__(self) -> SpritesEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _check_request(self, conn: ServerConnection, request: Request) -> Response | None:
        def reply(status: int, message: str) -> Response:
            self.stats[f"http_{status}"] += 1
            body = json.dumps({"error": message})
            return conn.respond(status, body + "\n")

        try:
            req = parse_exec_path(request.path)
        except (ProtocolError, UnicodeDecodeError) as err:
            return reply(400, str(err))
        if req is None:
            return reply(404, "not found")
        header = request.headers.get("Authorization", "")
        expected = f"Bearer {self.token}"
        if not hmac.compare_digest(header.encode(), expected.encode()):
            return reply(401, "unauthorized")
        if not (self.root / req.name).is_dir():
            return reply(404, f"sprite {req.name} not found")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        req = parse_exec_path(ws.request.path)
        assert req is not None  # checked in _check_request
        self._execs += 1
        plan = self.faults.plan(random.Random(f"{self.faults.seed}/{self._execs}"))  # noqa: S311
        self.stats["execs"] += 1
        try:
            await _Session(self, ws, req, plan).run()
        except (ConnectionClosed, ConnectionAbortedError, OSError) as err:
            log.debug("sprites emulator: session ended: %r", err)


class EmulatorThread(BackgroundEmulator[SpritesEmulator, SpritesFaults]):
    """Runs a :class:`SpritesEmulator` on its own loop in a background thread.

    For synchronous callers (``wsync demo``, ``wsync doctor``, sync tests)::

        with EmulatorThread(root, faults=SpritesFaults.field_report()) as emu:
            emu.create_sprite("demo")
            pull_uri("sprites://demo/work", dest, opts, emu.transport_options())
    """

    thread_name = "sprites-emulator"

    def __init__(
        self,
        root: Path,
        *,
        token: str = EMULATOR_TOKEN,
        faults: SpritesFaults | None = None,
    ) -> None:
        super().__init__(SpritesEmulator(root, token=token, faults=faults))

    @property
    def token(self) -> str:
        return self.emulator.token

    def create_sprite(self, name: str) -> Path:
        return self.emulator.create_sprite(name)
