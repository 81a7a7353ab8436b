"""An E2B envd on loopback that loses bytes the way the field reports say envd streams do.

Each sandbox is a directory under ``root`` (its "home": the default cwd, and where relative
``/files`` paths resolve).  Commands run as local processes (own process group) and speak
envd's real wire format (:mod:`wsync.transports.e2b_protocol`):

* ``POST /process.Process/Start`` — Connect server stream, always HTTP 200: ``start``,
  ``data`` events of at most 32 KiB raw (stdout and stderr interleaved as read),
  ``keepalive`` every ``Keepalive-Ping-Interval`` seconds of quiet (90 without the
  header), ``end`` (``exitCode`` omitted when 0; -1 and ``signal: killed`` when killed),
  then the end-stream message.  ``Connect-Timeout-Ms`` kills the process group.  An absent
  ``stdin`` field opens a stdin pipe, as envd does for old clients.  ``end`` waits until the
  pipes close (a background child holding stdout delays it).  A process outlives its
  stream: when the client goes away its output is discarded (infra#2639) until it exits
  or is killed by ``SendSignal``.
* ``SendInput`` / ``CloseStdin`` / ``SendSignal`` — Connect unary, bare JSON.
* ``GET /files?path=`` — raw bytes with Range (206/416), gzip without Range,
  ``{"code","message"}`` errors (400 directory, 404 missing, 401 token).
* Auth: ``X-Access-Token`` when the emulator has a token (401 JSON otherwise).  Routing:
  ``E2b-Sandbox-Id`` header or a ``49983-<id>.`` host; an unknown sandbox is the edge's
  502 ``{"sandboxId","message":"The sandbox was not found","code":502}``.

Faults (:mod:`wsync.emulators.e2b_faults`), drawn per call from a seeded RNG: the stream cut
without end-stream (clean or reset, maybe mid-envelope), ``start`` then silence, dropped or
duplicated data events, login-shell noise, 502 before the first frame, ``deadline_exceeded``
racing ``end``, and short, cut or range-ignoring file bodies.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import gzip
import hmac
import logging
import os
import random
import signal
from pathlib import Path
from typing import Any

from wsync.digits import ascii_digits
from wsync.emulators.e2b_faults import E2BFaults, ExecPlan
from wsync.emulators.e2b_http import ClientGone, Exchange, H11Server
from wsync.emulators.sprites import end_process
from wsync.emulators.thread import BackgroundEmulator
from wsync.errors import ProtocolError
from wsync.transports.e2b_protocol import (
    CHUNK,
    CLOSE_STDIN_PATH,
    CONNECT_JSON,
    FILES_PATH,
    SEND_INPUT_PATH,
    SEND_SIGNAL_PATH,
    SIGNAL_NAMES,
    START_PATH,
    Data,
    End,
    EnvelopeDecoder,
    Keepalive,
    Start,
    StartRequest,
    encode_end_stream,
    encode_event,
    parse_range,
    parse_start_request,
    parse_unary,
)

__all__ = ["E2BEmulator", "E2BFaults", "EmulatorThread"]

log = logging.getLogger(__name__)

#: the emulator's default access token: a loopback test fixture, not a secret
EMULATOR_TOKEN = "wsync-e2b-emulator-token"  # noqa: S105
UNAUTHORIZED = "unauthorized access, please provide a valid access token or method signing"
SIGNAL_BY_NUMBER = {number: name for name, number in SIGNAL_NAMES.items()}
CONNECT_HTTP = {"invalid_argument": 400, "failed_precondition": 400, "not_found": 404}


class _Cut(Exception):
    """The fault plan ended this response early."""


class _Proc:
    """A running command: pumps its pipes into the (single) subscriber's queue."""

    def __init__(
        self, proc: asyncio.subprocess.Process, stdin_open: bool, tag: str | None = None
    ) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.tag = tag
        self.stdin_open = stdin_open
        self.queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue(maxsize=64)
        self.subscribed = True
        self.end: End | None = None
        self.deadline_hit = False
        self.done = asyncio.Event()

    def unsubscribe(self) -> None:
        """The client went away: from now on output is discarded (a full queue unblocks)."""
        self.subscribed = False
        while not self.queue.empty():
            self.queue.get_nowait()

    async def _pump(self, stream: str, reader: asyncio.StreamReader) -> None:
        while data := await reader.read(CHUNK):
            if self.subscribed:
                await self.queue.put((stream, data))

    async def run(self) -> None:
        proc = self.proc
        assert proc.stdout is not None and proc.stderr is not None
        try:
            await asyncio.gather(
                self._pump("stdout", proc.stdout), self._pump("stderr", proc.stderr)
            )
            code = await end_process(proc, kill=False)
        finally:
            if proc.returncode is None:
                await end_process(proc, kill=True)
        if code >= 0:
            status = f"exit status {code}"
            self.end = End(code, True, status, status if code else None)
        else:
            status = f"signal: {SIGNAL_BY_NUMBER.get(-code, f'signal {-code}')}"
            self.end = End(-1, False, status, status)
        self.done.set()
        if self.subscribed:
            await self.queue.put(None)

    def kill(self, signum: int = signal.SIGKILL) -> None:
        if self.proc.returncode is None:
            try:
                os.killpg(self.pid, signum)
            except (ProcessLookupError, PermissionError):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signum)


class E2BEmulator:
    """The service: ``await start()``, use :attr:`url` and :attr:`token`, ``await stop()``."""

    def __init__(
        self,
        root: Path,
        *,
        token: str | None = EMULATOR_TOKEN,
        faults: E2BFaults | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.root = Path(root)
        self.token = token
        self.faults = faults or E2BFaults.off()
        self.stats: collections.Counter[str] = collections.Counter()
        self.procs: dict[int, _Proc] = {}
        self._server = H11Server(self._handle, host, port)
        self._tasks: set[asyncio.Task[None]] = set()
        self._calls = 0

    @property
    def url(self) -> str:
        return f"http://{self._server.host}:{self._server.port}"

    def transport_options(self) -> dict[str, Any]:
        """Options for :meth:`E2BTransport.from_uri` that reach this emulator."""
        # keepalives every second, stall declared after 2.5 s without any event: a
        # start-then-silence fault costs seconds, not the call deadline
        options: dict[str, Any] = {
            "e2b_url": self.url,
            "e2b_keepalive_interval": 1.0,
            "e2b_stall_factor": 2.0,
        }
        if self.token is not None:
            options["e2b_token"] = self.token
        return options

    def create_sandbox(self, sandbox_id: str) -> Path:
        path = self.root / sandbox_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop()
        for entry in list(self.procs.values()):
            entry.kill()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.procs.clear()

    async def __aenter__(self) -> E2BEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- routing

    def _plan(self) -> ExecPlan:
        self._calls += 1
        return self.faults.plan(random.Random(f"{self.faults.seed}/{self._calls}"))  # noqa: S311

    def _sandbox(self, ex: Exchange) -> str:
        sandbox = ex.headers.get("e2b-sandbox-id", "")
        if not sandbox:
            host = ex.headers.get("host", "")
            if host.startswith("49983-"):
                sandbox = host.removeprefix("49983-").split(".", 1)[0]
        return sandbox

    def _authorized(self, ex: Exchange) -> bool:
        if self.token is None:
            return True
        given = ex.headers.get("x-access-token", "")
        return hmac.compare_digest(given.encode(), self.token.encode())

    async def _handle(self, ex: Exchange) -> None:
        sandbox = self._sandbox(ex)
        if not sandbox or "/" in sandbox or not (self.root / sandbox).is_dir():
            self.stats["http_502_not_found"] += 1
            body = {"sandboxId": sandbox, "message": "The sandbox was not found", "code": 502}
            await ex.reply_json(502, body)
            return
        if not self._authorized(ex):
            self.stats["http_401"] += 1
            await ex.reply_json(401, {"code": 401, "message": UNAUTHORIZED})
            return
        home = self.root / sandbox
        route = (ex.method, ex.path)
        try:
            if route == ("POST", START_PATH):
                await self._start(ex, home, self._plan())
            elif route == ("GET", FILES_PATH):
                await self._files(ex, home, self._plan())
            elif ex.method == "POST" and ex.path in (
                SEND_INPUT_PATH,
                CLOSE_STDIN_PATH,
                SEND_SIGNAL_PATH,
            ):
                await self._unary(ex)
            else:
                await ex.reply_json(404, {"code": 404, "message": "not found"})
        except _Cut:
            return

    # -------------------------------------------------------------------- Start

    async def _spawn(self, req: StartRequest, home: Path) -> _Proc:
        env = dict(os.environ)
        env.update(req.envs)
        stdin_open = req.stdin is not False  # an absent field opens a pipe (E2B#927)
        proc = await asyncio.create_subprocess_exec(
            req.cmd,
            *req.args,
            cwd=req.cwd or str(home),
            env=env,
            stdin=asyncio.subprocess.PIPE if stdin_open else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        entry = _Proc(proc, stdin_open, req.tag)
        self.procs[entry.pid] = entry
        task = asyncio.create_task(self._supervise(entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return entry

    async def _supervise(self, entry: _Proc) -> None:
        try:
            await entry.run()
        finally:
            self.procs.pop(entry.pid, None)

    async def _start(self, ex: Exchange, home: Path, plan: ExecPlan) -> None:
        self.stats["execs"] += 1
        if plan.bad_gateway:
            self.stats["bad_gateway"] += 1
            if plan.not_found:
                body = {"sandboxId": home.name, "message": "The sandbox was not found", "code": 502}
                await ex.reply_json(502, body)
            else:
                await ex.reply(502, b"Bad Gateway\n", "text/plain")
            return
        ctype = ex.headers.get("content-type", "")
        if ctype.split(";")[0].strip() != CONNECT_JSON:
            # connect-go answers a codec it was not built with before any stream starts
            await ex.reply_json(415, {"code": "unknown", "message": f"unsupported {ctype!r}"})
            return
        try:
            decoder = EnvelopeDecoder()
            envelopes = decoder.feed(ex.body)
            decoder.eof()
            if len(envelopes) != 1 or envelopes[0].end_stream:
                raise ProtocolError("expected exactly one request envelope")
            req = parse_start_request(envelopes[0].message)
        except ProtocolError as err:
            await self._stream_error(ex, "invalid_argument", str(err))
            return
        try:
            entry = await self._spawn(req, home)
        except OSError as err:
            await self._stream_error(ex, "internal", f"error starting process: {err}")
            return
        timeout_ms = ex.headers.get("connect-timeout-ms", "")
        killer = None
        if ascii_digits(timeout_ms):
            killer = asyncio.get_running_loop().call_later(
                int(timeout_ms) / 1000, self._deadline, entry
            )
        interval = ex.headers.get("keepalive-ping-interval", "")
        keepalive = float(interval) if ascii_digits(interval) and int(interval) > 0 else 90.0
        finished = False
        try:
            await self._stream(ex, entry, plan, keepalive)
            finished = True
        except ClientGone:
            log.debug("e2b emulator: client left pid %d", entry.pid)
        finally:
            if not finished:
                entry.unsubscribe()
            if killer is not None and entry.done.is_set():
                killer.cancel()

    def _deadline(self, entry: _Proc) -> None:
        if not entry.done.is_set():
            entry.deadline_hit = True
            self.stats["deadline_kills"] += 1
            entry.kill()

    async def _stream_error(self, ex: Exchange, code: str, message: str) -> None:
        await ex.start(200, {"Content-Type": CONNECT_JSON})
        await ex.write(encode_end_stream(code, message))
        await ex.end()

    async def _stream(self, ex: Exchange, entry: _Proc, plan: ExecPlan, keepalive: float) -> None:
        sent = 0

        async def send(blob: bytes) -> None:
            nonlocal sent
            cut = plan.cut_after
            if cut is not None and sent + len(blob) > cut:
                await ex.write(blob[: cut - sent])
                self.stats["cut_reset" if plan.cut_reset else "cut_clean"] += 1
                if plan.cut_reset:
                    ex.abort()
                else:
                    await ex.end()
                entry.unsubscribe()
                raise _Cut
            await ex.write(blob)
            sent += len(blob)

        if self.faults.start_delay > 0:
            await asyncio.sleep(self.faults.start_delay)
        await ex.start(200, {"Content-Type": CONNECT_JSON})
        await send(encode_event(Start(entry.pid)))
        if plan.silence:
            self.stats["silence"] += 1
            entry.unsubscribe()
            while not ex.gone.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(keepalive):
                        await ex.gone.wait()
                if self.faults.silence_keepalive and not ex.gone.is_set():
                    await send(encode_event(Keepalive()))
            raise ClientGone
        if plan.noise is not None:
            self.stats["login_noise"] += 1
            await send(encode_event(Data("stdout", plan.noise)))
        index = 0
        while True:
            try:
                async with asyncio.timeout(keepalive):
                    item = await entry.queue.get()
            except TimeoutError:
                await send(encode_event(Keepalive()))
                continue
            if item is None:
                break
            stream, data = item
            if index == plan.drop_index:
                self.stats["dropped_data"] += 1
            else:
                await send(encode_event(Data(stream, data)))
                if index == plan.dup_index:
                    self.stats["duplicated_data"] += 1
                    await send(encode_event(Data(stream, data)))
            index += 1
        assert entry.end is not None
        await send(encode_event(entry.end))
        if entry.deadline_hit or plan.deadline_race:
            if plan.deadline_race:
                self.stats["deadline_race"] += 1
            await send(encode_end_stream("deadline_exceeded", "context deadline exceeded"))
        else:
            await send(encode_end_stream())
        await ex.end()

    # -------------------------------------------------------------------- unary

    async def _unary(self, ex: Exchange) -> None:
        async def error(code: str, message: str) -> None:
            await ex.reply_json(CONNECT_HTTP.get(code, 500), {"code": code, "message": message})

        try:
            selector, obj = parse_unary(ex.body)
        except ProtocolError as err:
            await error("invalid_argument", str(err))
            return
        if isinstance(selector, int):
            entry = self.procs.get(selector)
        else:  # envd's ProcessSelector: a tag names the process as well as its pid
            entry = next((p for p in self.procs.values() if p.tag == selector), None)
        if entry is None or entry.proc.returncode is not None:
            await error("not_found", f"process {selector!r:.60} not found")
            return
        if ex.path == SEND_SIGNAL_PATH:
            name = obj.get("signal")
            signum = {"SIGNAL_SIGKILL": signal.SIGKILL, "SIGNAL_SIGTERM": signal.SIGTERM}.get(
                name if isinstance(name, str) else ""
            )
            if signum is None:
                await error("invalid_argument", f"invalid signal: {name!r:.40}")
                return
            self.stats["signals"] += 1
            entry.kill(signum)
            await ex.reply_json(200, {})
            return
        stdin = entry.proc.stdin
        if not entry.stdin_open or stdin is None:
            await error("failed_precondition", "stdin not enabled or closed")
            return
        try:
            if ex.path == CLOSE_STDIN_PATH:
                stdin.close()
                entry.stdin_open = False
            else:
                raw = (
                    obj.get("input", {}).get("stdin", "")
                    if isinstance(obj.get("input"), dict)
                    else ""
                )
                try:
                    data = base64.b64decode(str(raw).encode("ascii"), validate=True)
                except (binascii.Error, UnicodeEncodeError):
                    await error("invalid_argument", "stdin is not base64")
                    return
                stdin.write(data)
                await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            await error("internal", "error writing to stdin: write |1: broken pipe")
            return
        await ex.reply_json(200, {})

    # -------------------------------------------------------------------- files

    async def _files(self, ex: Exchange, home: Path, plan: ExecPlan) -> None:
        self.stats["file_reads"] += 1
        raw = ex.query.get("path", "")
        if (
            "signature" in ex.query
            and self.token is not None
            and "x-access-token" not in ex.headers
        ):
            await ex.reply_json(401, {"code": 401, "message": "invalid signature"})
            return
        if not raw:
            await ex.reply_json(400, {"code": 400, "message": "path is required"})
            return
        path = Path(raw) if raw.startswith("/") else home / raw
        if not path.exists():
            await ex.reply_json(404, {"code": 404, "message": f"path '{raw}' does not exist"})
            return
        if path.is_dir():
            await ex.reply_json(400, {"code": 400, "message": f"path '{raw}' is a directory"})
            return
        size = path.stat().st_size
        first, last, status = 0, size - 1, 200
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f'inline; filename="{path.name}"',
            "Accept-Ranges": "bytes",
        }
        wanted = ex.headers.get("range")
        if wanted and plan.file_ignore_range:
            self.stats["file_ignored_range"] += 1
        elif wanted:
            try:
                span = parse_range(wanted, size)
            except ProtocolError:
                span = (0, size - 1)  # Go's ServeContent ignores what it cannot parse
            if span is None:
                headers["Content-Range"] = f"bytes */{size}"
                await ex.reply(416, b"", "text/plain")
                return
            first, last = span
            if plan.file_short and last > first:
                self.stats["file_short"] += 1
                last = first + (last - first) // 2
            status = 206
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        with path.open("rb") as f:
            f.seek(first)
            body = f.read(max(last - first + 1, 0))
        if status == 200 and not wanted and "gzip" in ex.headers.get("accept-encoding", ""):
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        headers["Content-Length"] = str(len(body))
        await ex.start(status, headers)
        if plan.file_cut and body:
            self.stats["file_cut"] += 1
            await ex.write(body[: plan.rng.randrange(len(body))])
            ex.abort()
            return
        for start in range(0, len(body), 256 * 1024):
            await ex.write(body[start : start + 256 * 1024])
        await ex.end()


class EmulatorThread(BackgroundEmulator[E2BEmulator, E2BFaults]):
    """Runs an :class:`E2BEmulator` on its own loop in a background thread.

    For synchronous callers (``wsync demo``, ``wsync doctor``, sync tests)::

        with EmulatorThread(root, faults=E2BFaults.all_on()) as emu:
            emu.create_sandbox("sbx")
            pull_uri("e2b://sbx/work", dest, opts, emu.transport_options())
    """

    thread_name = "e2b-emulator"

    def __init__(
        self, root: Path, *, token: str | None = EMULATOR_TOKEN, faults: E2BFaults | None = None
    ) -> None:
        super().__init__(E2BEmulator(root, token=token, faults=faults))

    @property
    def token(self) -> str | None:
        return self.emulator.token

    def create_sandbox(self, sandbox_id: str) -> Path:
        return self.emulator.create_sandbox(sandbox_id)
