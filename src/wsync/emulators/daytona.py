"""A Daytona toolbox on loopback that behaves like the daemon behind its proxy.

Each sandbox is a directory under ``root``.  The server speaks HTTP/1.1 itself (raw
asyncio, so a body can be cut mid-way) under ``{url}`` = ``http://127.0.0.1:PORT/toolbox``:

* ``POST /toolbox/{id}/process/execute`` ``{"command", "timeout", "cwd"}`` — as the
  daemon since PR #3918: the command text is piped into a shell (``shell``: zsh, bash or
  sh as ``GetShell`` picks them, or the one given) started in its own process group;
  stdout and stderr share one pipe and one unbounded buffer; the answer is
  ``{"exitCode":N,"result":"..."}`` written the way Go's ``encoding/json`` writes a
  ``string(bytes)`` (each invalid UTF-8 byte a U+FFFD).  ``timeout`` is in seconds (0 or
  absent: none); when it passes the process group is SIGKILLed and the answer is 408
  with the daemon's error JSON and no output.  A signal death is ``exitCode: -1``.  The
  command goes on running when the client disconnects (the daemon uses a background
  context), and if the shell exits while a child holds the pipe, the answer waits
  ``hang_timeout`` seconds and carries what was buffered.
* ``GET /toolbox/{id}/files/download?path=`` — raw bytes with the daemon's headers,
  ``Range`` honoured as ``http.ServeFile`` does (206, ``Content-Range``, 416 past the
  end); 400/403/404 with an empty body.
* ``Authorization: Bearer <token>`` or 401; an unknown sandbox is 404.

Field faults (:class:`~wsync.emulators.daytona_faults.DaytonaFaults`) are drawn per
request from a seeded RNG; :attr:`DaytonaEmulator.stats` counts what fired.
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
import shutil
import signal
import urllib.parse
from pathlib import Path
from typing import Any

from wsync.emulators.daytona_faults import DaytonaFaults, RequestPlan
from wsync.emulators.thread import BackgroundEmulator
from wsync.transports.daytona_protocol import (
    error_body,
    go_json_result,
    go_lossy,
    split_command,
)

__all__ = ["DaytonaEmulator", "DaytonaEmulatorThread", "DaytonaFaults"]

log = logging.getLogger(__name__)

#: a loopback test fixture, not a secret
EMULATOR_TOKEN = "wsync-daytona-emulator-key"  # noqa: S105
_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024
_PIECE = 256 * 1024
_REASONS = {
    200: "OK",
    206: "Partial Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Payload Too Large",
    416: "Range Not Satisfiable",
    502: "Bad Gateway",
}


def pick_shell() -> str:
    """``GetShell``'s order: zsh if listed in /etc/shells, then bash, then $SHELL, then sh."""
    try:
        listed = Path("/etc/shells").read_text().split()
    except OSError:
        listed = []
    for zsh in ("/usr/bin/zsh", "/bin/zsh"):
        if zsh in listed and os.access(zsh, os.X_OK):
            return zsh
    return shutil.which("bash") or os.environ.get("SHELL") or "/bin/sh"


class _Request:
    __slots__ = ("body", "headers", "method", "path", "query")

    def __init__(
        self, method: str, path: str, query: str, headers: dict[str, str], body: bytes
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body


class _BadRequest(Exception):
    pass


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as err:
        if err.partial.strip():
            raise _BadRequest("incomplete request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise _BadRequest("request head too long") from None
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ")
    except ValueError:
        raise _BadRequest("bad request line") from None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _BadRequest("bad header line")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise _BadRequest("chunked request bodies are not supported")
    length = int(headers.get("content-length", "0") or "0")
    if length < 0 or length > _MAX_BODY:
        raise _BadRequest("bad Content-Length")
    body = await reader.readexactly(length) if length else b""
    parts = urllib.parse.urlsplit(target)
    return _Request(method, parts.path, parts.query, headers, body)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    except PermissionError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class DaytonaEmulator:
    """The service: ``await start()``, use :attr:`url` and :attr:`token`, ``await stop()``."""

    def __init__(
        self,
        root: Path,
        *,
        token: str = EMULATOR_TOKEN,
        faults: DaytonaFaults | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        shell: str | None = None,
        hang_timeout: float = 30.0,
        split_command: bool = False,
    ) -> None:
        self.root = Path(root)
        self.token = token
        self.faults = faults or DaytonaFaults.off()
        self.host = host
        self.port = port
        self.shell = shell or pick_shell()
        self.hang_timeout = hang_timeout
        #: old daemons: the command is split on quotes and run without a shell
        self.split_command = split_command
        self.stats: collections.Counter[str] = collections.Counter()
        self._server: asyncio.Server | None = None
        self._requests = 0
        self._executes = 0
        self._pids: set[int] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/toolbox"

    def transport_options(self) -> dict[str, Any]:
        """Options for :meth:`DaytonaTransport.from_uri` that reach this emulator."""
        return {"daytona_url": self.url, "daytona_token": self.token}

    def create_sandbox(self, sandbox_id: str) -> Path:
        path = self.root / sandbox_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._server = await asyncio.start_server(
            self._connection, self.host, self.port, limit=_MAX_HEAD
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Kill every running command, drop every connection, close the socket."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for pid in list(self._pids):
            _kill_group(pid)
        for writer in list(self._writers):
            writer.transport.abort()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        self._pids.clear()
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> DaytonaEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- HTTP -------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(writer)
        try:
            while True:
                try:
                    request = await _read_request(reader)
                except _BadRequest as err:
                    await self._respond(writer, 400, str(err).encode(), "text/plain")
                    break
                if request is None:
                    break
                if not await self._dispatch(request, writer):
                    break
                if request.headers.get("connection", "").lower() == "close":
                    break
        except (ConnectionError, asyncio.IncompleteReadError) as err:
            log.debug("daytona emulator: connection ended: %r", err)
        except asyncio.CancelledError:
            # stop(): end quietly (asyncio's stream callback logs a cancelled handler)
            return
        finally:
            self._writers.discard(writer)
            self._handlers.discard(task)
            writer.transport.abort()

    async def _respond(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes = b"",
        content_type: str | None = "application/json; charset=utf-8",
        headers: dict[str, str] | None = None,
        *,
        declared: int | None = None,
    ) -> None:
        self.stats[f"http_{status}"] += 1
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        if content_type and body:
            lines.append(f"Content-Type: {content_type}")
        for name, value in (headers or {}).items():
            lines.append(f"{name}: {value}")
        lines.append(f"Content-Length: {len(body) if declared is None else declared}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()

    async def _dispatch(self, request: _Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False closes the connection."""
        parts = request.path.split("/")
        # ["", "toolbox", id, "process", "execute"] / ["", "toolbox", id, "files", "download"]
        if len(parts) != 5 or parts[1] != "toolbox":
            await self._respond(writer, 404, error_body(404, "not found", "NOT_FOUND", "", ""))
            return True
        sandbox_id, route = urllib.parse.unquote(parts[2]), "/".join(parts[3:])
        expected = f"Bearer {self.token}".encode()
        given = request.headers.get("authorization", "").encode("latin-1")
        if not hmac.compare_digest(given, expected):
            body = error_body(401, "Unauthorized", "UNAUTHORIZED", request.path, request.method)
            await self._respond(writer, 401, body)
            return True
        if not sandbox_id or "/" in sandbox_id or not (self.root / sandbox_id).is_dir():
            body = error_body(
                404, f"sandbox {sandbox_id} not found", "NOT_FOUND", request.path, request.method
            )
            await self._respond(writer, 404, body)
            return True
        self._requests += 1
        rng = random.Random(f"{self.faults.seed}/{self._requests}")  # noqa: S311
        plan = self.faults.plan(rng)
        if route == "process/execute" and request.method == "POST":
            self.stats["execs"] += 1
            self._executes += 1
            faults = self.faults
            delay = faults.start_delay if self._executes <= faults.slow_starts else 0.0
            return await self._execute(request, writer, self.root / sandbox_id, plan, delay)
        if route == "files/download" and request.method == "GET":
            self.stats["downloads"] += 1
            return await self._download(request, writer, plan)
        await self._respond(writer, 405 if route in ("process/execute", "files/download") else 404)
        return True

    # -- process/execute ---------------------------------------------------------------

    async def _execute(
        self,
        request: _Request,
        writer: asyncio.StreamWriter,
        home: Path,
        plan: RequestPlan,
        delay: float = 0.0,
    ) -> bool:
        try:
            obj = json.loads(request.body)
            command = obj["command"]
            timeout = obj.get("timeout") or 0
            cwd = obj.get("cwd") or str(home)
            if not isinstance(command, str) or not command or not isinstance(timeout, int):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            await self._respond(writer, 400)  # AbortWithError: status only, empty body
            return True
        if plan.bad_gateway == "before":
            self.stats["bad_gateway"] += 1
            await self._respond(writer, 502, b"Bad Gateway\n", "text/plain; charset=utf-8")
            return True
        outcome = await self._run(command, cwd, timeout, plan, delay)
        if outcome is None:
            body = error_body(
                408, "command execution timeout", "REQUEST_TIMEOUT", "/process/execute", "POST"
            )
            await self._respond(writer, 408, body)
            return True
        code, output = outcome
        if plan.bad_gateway == "after":
            self.stats["bad_gateway"] += 1
            await self._respond(writer, 502, b"Bad Gateway\n", "text/plain; charset=utf-8")
            return True
        output, code = self._mangle(output, code, plan)
        await self._respond(writer, 200, go_json_result(code, output))
        return True

    def _mangle(self, output: bytes, code: int, plan: RequestPlan) -> tuple[bytes, int]:
        """Cuts apply to the ``result`` text as sent (lossy UTF-8), where proxies cut it."""
        cap = self.faults.result_cap
        if (cap is not None or plan.truncate) and output:
            output = go_lossy(output).encode()
        if cap is not None and len(output) > cap:
            self.stats["result_capped"] += 1
            output = output[:cap]
        if plan.truncate and output:
            self.stats["truncated_result"] += 1
            output = output[: plan.rng.randrange(len(output))]
        if plan.minus_one:
            self.stats["minus_one"] += 1
            code = -1
            if plan.minus_one_empty:
                output = b""
        return output, code

    async def _run(
        self, command: str, cwd: str, timeout: int, plan: RequestPlan, delay: float = 0.0
    ) -> tuple[int, bytes] | None:
        """Run ``command`` in the shell; (exit code, merged output), or None on timeout.
        ``delay``: the shell starts that much later (the ``start_delay`` fault)."""
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            argv = split_command(command) if self.split_command else [self.shell]
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=cwd,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # Setpgid: a timeout kills the whole group
            )
        except OSError as err:
            return -1, str(err).encode()
        self._pids.add(proc.pid)
        if delay > 0:
            self.stats["slow_starts"] += 1  # counted once the shell exists
        assert proc.stdin is not None and proc.stdout is not None
        loop = asyncio.get_running_loop()
        limit_at = loop.time() + timeout if timeout > 0 else None
        if plan.early_timeout is not None:
            self.stats["early_timeout"] += 1
            early = loop.time() + plan.early_timeout
            limit_at = early if limit_at is None else min(limit_at, early)
        late_at = loop.time() + self.faults.late_delay if plan.late_partial else None
        buf = bytearray()

        async def feed() -> None:
            assert proc.stdin is not None
            with contextlib.suppress(ConnectionError):
                proc.stdin.write(b"" if self.split_command else command.encode())
                await proc.stdin.drain()
                proc.stdin.close()

        async def collect() -> None:
            assert proc.stdout is not None
            while data := await proc.stdout.read(_PIECE):
                buf.extend(data)

        feeder = asyncio.create_task(feed())
        reader = asyncio.create_task(collect())
        timed_out = False
        exited_at: float | None = None
        try:
            while not reader.done():
                await asyncio.wait({reader}, timeout=0.05)
                now = loop.time()
                if limit_at is not None and now >= limit_at and not reader.done():
                    timed_out = True
                    break
                if proc.returncode is not None and not reader.done():
                    exited_at = exited_at or now
                    if now - exited_at >= self.hang_timeout:
                        self.stats["pipes_abandoned"] += 1
                        break
        finally:
            feeder.cancel()
            reader.cancel()
            await asyncio.gather(feeder, reader, return_exceptions=True)
        if timed_out or plan.early_timeout is not None:
            _kill_group(proc.pid)
        code = await self._reap(proc)
        if timed_out or plan.early_timeout is not None:
            return None
        if late_at is not None:
            self.stats["late_partial"] += 1
            await asyncio.sleep(max(0.0, late_at - loop.time()))
            cut = plan.rng.randrange(len(buf) + 1)
            return code, bytes(buf[:cut])
        return code, bytes(buf)

    async def _reap(self, proc: asyncio.subprocess.Process) -> int:
        """Close the pipes and wait for the shell; Go's ``ExitCode()``: -1 for a signal."""
        # let the child watcher see the exit before closing (close() polls and could reap)
        for _ in range(200):
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.01)
        transport = getattr(proc, "_transport", None)
        if transport is not None:
            transport.close()
        try:
            async with asyncio.timeout(30):
                code = await proc.wait()
        except TimeoutError:
            _kill_group(proc.pid)
            code = await proc.wait()
        self._pids.discard(proc.pid)
        return code if code >= 0 else -1

    # -- files/download ---------------------------------------------------------------

    async def _download(
        self, request: _Request, writer: asyncio.StreamWriter, plan: RequestPlan
    ) -> bool:
        query = urllib.parse.parse_qs(request.query, keep_blank_values=True)
        path = (query.get("path") or [""])[0]
        if not path:
            await self._respond(writer, 400)
            return True
        wanted = request.headers.get("range", "") if self.faults.range_support else ""
        status, headers, data = await asyncio.to_thread(_file_slice, path, wanted)
        if status >= 400:
            await self._respond(writer, status, b"", None, headers)
            return True
        count = len(data)
        if plan.short_download and count:
            self.stats["short_download"] += 1
            cut = plan.rng.randrange(count)
            if plan.short_download == "short":
                await self._respond(writer, status, data[:cut], None, headers)
                return True
            # "cut": the full length is declared, part is sent, the connection closes
            await self._respond(writer, status, data[:cut], None, headers, declared=count)
            return False
        await self._respond(writer, status, data, None, headers)
        return True


def _file_slice(path: str, wanted: str) -> tuple[int, dict[str, str], bytes]:
    """``c.File``: (status, headers, bytes) for ``path`` and a ``Range`` value ('' for none)."""
    absolute = os.path.abspath(path)
    try:
        info = os.stat(absolute)
    except FileNotFoundError:
        return 404, {}, b""
    except PermissionError:
        return 403, {}, b""
    except OSError:
        return 400, {}, b""
    if not os.path.isfile(absolute):
        return 400, {}, b""
    size = info.st_size
    headers = {
        "Content-Description": "File Transfer",
        "Content-Type": "application/octet-stream",
        "Content-Disposition": f"attachment; filename={os.path.basename(absolute)}",
        "Content-Transfer-Encoding": "binary",
        "Accept-Ranges": "bytes",
    }
    first, count, status = 0, size, 200
    if wanted:
        span = _parse_range(wanted, size)
        if span is None:
            return 416, {"Content-Range": f"bytes */{size}"}, b""
        first, count, status = span[0], span[1] - span[0] + 1, 206
        headers["Content-Range"] = f"bytes {span[0]}-{span[1]}/{size}"
    try:
        with open(absolute, "rb") as f:
            f.seek(first)
            data = f.read(count)
    except OSError:
        return 403, {}, b""
    return status, headers, data


def _parse_range(value: str, size: int) -> tuple[int, int] | None:
    """One ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range → (first, last), None: 416."""
    unit, _, spec = value.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return (0, size - 1) if size else None
    start, _, end = spec.strip().partition("-")
    try:
        if not start:
            n = int(end)
            return (max(0, size - n), size - 1) if n > 0 and size else None
        first = int(start)
        last = int(end) if end else size - 1
    except ValueError:
        return (0, size - 1) if size else None
    if first >= size or last < first:
        return None
    return first, min(last, size - 1)


class DaytonaEmulatorThread(BackgroundEmulator[DaytonaEmulator, DaytonaFaults]):
    """Runs a :class:`DaytonaEmulator` on its own loop in a background thread.

    For synchronous callers (``wsync demo``, ``wsync doctor``, sync tests)::

        with DaytonaEmulatorThread(root, faults=DaytonaFaults.all_on()) as emu:
            emu.create_sandbox("demo")
            pull_uri("daytona://demo/work", dest, opts, emu.transport_options())
    """

    thread_name = "daytona-emulator"

    def __init__(self, root: Path, **kwargs: Any) -> None:
        super().__init__(DaytonaEmulator(root, **kwargs))

    @property
    def token(self) -> str:
        return self.emulator.token

    def create_sandbox(self, sandbox_id: str) -> Path:
        return self.emulator.create_sandbox(sandbox_id)
