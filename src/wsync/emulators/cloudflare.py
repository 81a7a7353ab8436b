"""A Cloudflare Sandbox Bridge on loopback that loses output the way the field reports do.

Each sandbox is a directory under ``root`` and stands for the container's
``/workspace``: exec runs ``/bin/bash -c <argv joined>`` as a local process (cwd
= the sandbox directory, or ``cwd`` if it lies inside it), and the file API serves
only paths inside it (403 otherwise, as the Bridge confines files to
``/workspace``).  The wire is the Bridge's (:mod:`wsync.transports.cloudflare_protocol`):
bearer auth, JSON errors ``{"error","code"}``, ``text/event-stream`` with named
``stdout``/``stderr`` events carrying base64 of *lossily decoded* output (invalid
UTF-8 becomes U+FFFD, always: that is the channel, not a fault), ``exit`` with
``{"exit_code":N}``, and ``error`` events.

Without a ``Session-Id`` header an exec is sessionless (raw chunks); with one it
is session mode (one event per line, ``"\\n"`` appended, NULs dropped).  A
``timeout_ms`` expiry kills the process group (SIGTERM, 5 s, SIGKILL) and reports
exit 124 with ``Command timed out after Nms`` on stderr.  A client that goes away
gets its command killed.  Faults: :mod:`wsync.emulators.cloudflare_faults`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import os
import random
from pathlib import Path
from typing import Any

from wsync.emulators import cloudflare_http as http
from wsync.emulators.cloudflare_exec import READ_SIZE, ExecStream
from wsync.emulators.cloudflare_faults import CloudflareFaults, ExecPlan
from wsync.emulators.sprites import end_process, kill_group
from wsync.emulators.thread import BackgroundEmulator
from wsync.errors import ProtocolError
from wsync.transports.cloudflare_protocol import (
    SESSION_ID_RE,
    parse_exec_body,
    split_route,
)

__all__ = ["CloudflareEmulator", "CloudflareFaults", "EmulatorThread"]

log = logging.getLogger(__name__)

#: the emulator's default bearer token: a loopback test fixture, not a secret
EMULATOR_TOKEN = "wsync-cloudflare-emulator-token"  # noqa: S105


class CloudflareEmulator:
    """The Bridge: ``await start()``, use :attr:`url` and :attr:`token`, ``await stop()``."""

    def __init__(
        self,
        root: Path,
        *,
        token: str = EMULATOR_TOKEN,
        faults: CloudflareFaults | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.root = Path(root)
        self.token = token
        self.faults = faults or CloudflareFaults.off()
        self.host = host
        self.port = port
        self.stats: collections.Counter[str] = collections.Counter()
        self.procs: set[asyncio.subprocess.Process] = set()
        self.background: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._requests = 0
        self._started = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def transport_options(self) -> dict[str, Any]:
        """Options for :meth:`CloudflareTransport.from_uri` that reach this emulator."""
        return {"cloudflare_url": self.url, "cloudflare_token": self.token}

    def create_sandbox(self, sandbox_id: str) -> Path:
        path = self.root / sandbox_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._started = asyncio.get_running_loop().time()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in [*self._conns, *self.background]:
            task.cancel()
        for proc in list(self.procs):
            kill_group(proc)
        await asyncio.gather(*self._conns, *self.background, return_exceptions=True)
        for proc in list(self.procs):
            await end_process(proc, kill=proc.returncode is None)
        self.procs.clear()

    async def __aenter__(self) -> CloudflareEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            while True:
                try:
                    request = await http.read_request(reader)
                except http.BadRequest as err:
                    await http.send_json(
                        writer, 400, {"error": str(err), "code": "invalid_request"}, close=True
                    )
                    break
                if request is None or not await self._dispatch(request, reader, writer):
                    break
                if not request.keep_alive:
                    break
        except (ConnectionError, OSError) as err:
            log.debug("cloudflare emulator: connection ended: %r", err)
        except asyncio.CancelledError:
            # stop(): asyncio's start_server callback would log a cancelled handler as an error
            pass
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _dispatch(
        self, req: http.Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        async def reply(status: int, error: str, code: str) -> bool:
            self.stats[f"http_{status}"] += 1
            await http.send_json(writer, status, {"error": error, "code": code})
            return True

        self._requests += 1
        self.stats["requests"] += 1
        plan = self.faults.plan(random.Random(f"{self.faults.seed}/{self._requests}"))  # noqa: S311
        route = split_route(req.path)
        if route is None:
            return await reply(404, "Not found", "not_found")
        given = req.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
            return await reply(401, "Unauthorized", "unauthorized")
        sandbox_id, kind, rest = route
        box = self.root / sandbox_id
        if not sandbox_id or sandbox_id.startswith(".") or not box.is_dir():
            return await reply(404, f"Sandbox not found: {sandbox_id}", "sandbox_not_found")
        starting = asyncio.get_running_loop().time() - self._started < self.faults.starting_for
        if kind == "exec":
            if req.method != "POST":
                return await reply(405, "Method not allowed", "invalid_request")
            try:
                body = parse_exec_body(req.body)
            except ProtocolError as err:
                return await reply(400, str(err), "invalid_request")
            session = req.headers.get("session-id")
            if session is not None and not SESSION_ID_RE.fullmatch(session):
                return await reply(400, "Invalid Session-Id", "invalid_request")
            cwd = self._confined(box, body.cwd or str(box))
            if cwd is None:
                return await reply(403, "cwd must be within /workspace", "forbidden")
            if plan.unavailable or starting:
                return await reply(503, "Container is starting", "capacity_exceeded")
            self.stats["execs"] += 1
            return await ExecStream(self, writer, body, cwd, plan, session is not None).run(reader)
        if req.method != "GET":
            return await reply(405, "Method not allowed", "invalid_request")
        return await self._file(writer, box, rest, plan, reply)

    @staticmethod
    def _confined(box: Path, path: str) -> Path | None:
        root = os.path.realpath(box)
        real = os.path.realpath(path)
        return Path(real) if real == root or real.startswith(root + os.sep) else None

    async def _file(
        self, writer: asyncio.StreamWriter, box: Path, path: str, plan: ExecPlan, reply: Any
    ) -> bool:
        real = self._confined(box, path)
        if real is None:
            self.stats["file_refused"] += 1
            return bool(await reply(403, "Path must be within /workspace", "forbidden"))
        if plan.file_unavailable:
            return bool(await reply(503, "Container is starting", "capacity_exceeded"))
        try:
            data = await asyncio.to_thread(real.read_bytes)
        except (FileNotFoundError, NotADirectoryError):
            return bool(await reply(404, f"File not found: {path}", "workspace_read_not_found"))
        except OSError as err:
            return bool(await reply(502, f"read failed: {err.strerror}", "exec_transport_error"))
        self.stats["file_reads"] += 1
        headers = {"Content-Type": "application/octet-stream"}
        if data and (plan.file_truncate or plan.file_short):
            cut = plan.rng.randrange(len(data))
            if plan.file_truncate:
                self.stats["file_truncated"] += 1
                headers["Content-Length"] = str(len(data))
            else:
                self.stats["file_short"] += 1
                headers["Connection"] = "close"
            writer.write(http.head(200, headers) + data[:cut])
            await writer.drain()
            if plan.file_truncate:
                writer.transport.abort()
            return False
        headers["Content-Length"] = str(len(data))
        writer.write(http.head(200, headers))
        view = memoryview(data)
        for start in range(0, len(data), READ_SIZE * 4):
            writer.write(view[start : start + READ_SIZE * 4])
            await writer.drain()
        return True


class EmulatorThread(BackgroundEmulator[CloudflareEmulator, CloudflareFaults]):
    """Runs a :class:`CloudflareEmulator` on its own loop in a background thread.

    For synchronous callers (``wsync demo``, ``wsync doctor``, sync tests)::

        with EmulatorThread(root, faults=CloudflareFaults.all_on()) as emu:
            emu.create_sandbox("demo")
            pull_uri("cloudflare://demo/...", dest, opts, emu.transport_options())
    """

    thread_name = "cloudflare-emulator"

    def __init__(
        self, root: Path, *, token: str = EMULATOR_TOKEN, faults: CloudflareFaults | None = None
    ) -> None:
        super().__init__(CloudflareEmulator(root, token=token, faults=faults))

    @property
    def token(self) -> str:
        return self.emulator.token

    def create_sandbox(self, sandbox_id: str) -> Path:
        return self.emulator.create_sandbox(sandbox_id)
