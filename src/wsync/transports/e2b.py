"""``e2b://SANDBOX_ID/PATH``: exec through envd's Connect ``process.Process/Start`` stream.

envd (the agent inside every E2B sandbox, port 49983) runs a command and streams
``start`` / ``data`` / ``keepalive`` / ``end`` events in Connect envelopes, then an
end-stream message (:mod:`wsync.transports.e2b_protocol`).  The channel carries raw bytes
(base64 inside JSON, decoded here, never through a text decoder), stdout and stderr
separately, and stdin through two more calls (``SendInput``, ``CloseStdin``) once the
``start`` event has given the pid.  ``GET /files`` serves raw file bytes with Range, the
fast path of :meth:`E2BTransport.read_file`.

What this client does about the field faults (it reports, the engine's envelopes verify):

* a body that ends without the end-stream message, or inside an envelope, is truncation:
  ``exit_status=None``, never 0 (connect-rust#140 got this wrong); a reset mid-body is a
  :class:`TransportError`;
* a missing ``exitCode`` means 0 only inside an ``end`` event that really arrived;
* ``"stdin": false`` is always explicit when there is no stdin (an absent field makes envd
  keep a stdin pipe open, and a ``cat`` hangs to its deadline, E2B#927);
* ``start`` then silence (infra#3292): the client asks for keepalives every
  ``keepalive_interval`` seconds and gives up (``TransportError``) when no event at all
  arrived for ``stall_factor`` intervals, long before the call's deadline;
* a command the client abandons (deadline, stall, cut, cancel) is killed with
  ``SendSignal`` — envd keeps processes running after their stream ends — and
  ``Connect-Timeout-Ms`` is the server-side backstop;
* argv runs as ``/bin/sh -c 'exec "$@"' sh ARGV...``: no login shell (no profile noise),
  exact argv, and a missing command is exit 127 rather than an RPC error;
* 502 "sandbox was not found" before any exec succeeded is :class:`SandboxUnreachable`
  (exit 3); after one succeeded it is a transient :class:`TransportError` (the edge says it
  while a sandbox resumes), as are 5xx answers.

The access token goes only into the ``X-Access-Token`` header: never logged, never in
:attr:`description`, ``repr`` or errors.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import os
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import httpx

from wsync.errors import (
    AuthFailed,
    ProtocolError,
    SandboxUnreachable,
    TransportError,
    TransportTimeout,
    UsageError,
)
from wsync.transports import httpbody
from wsync.transports.base import (
    DEFAULT_MAX_OUTPUT,
    Capabilities,
    Channel,
    ExecResult,
    Transport,
    check_base_url,
    error_message,
    find_secret,
    float_options,
)
from wsync.transports.e2b_channel import LIFETIME, RETIRE, E2BChannel, send_input
from wsync.transports.e2b_protocol import (
    CLOSE_STDIN_PATH,
    CONNECT_JSON,
    FILES_PATH,
    SEND_SIGNAL_PATH,
    START_PATH,
    EndStream,
    StartCollector,
    parse_content_range,
    pid_body,
    range_header,
    start_request,
    tag_body,
)
from wsync.uri import SandboxURI

log = logging.getLogger(__name__)
T = TypeVar("T")

ENVD_PORT = 49983
DEFAULT_DOMAIN = "e2b.app"
DEFAULT_URL = "https://49983-{id}.{domain}"
#: argv runs through this, so lookup uses the guest's PATH and a missing tool is 127
EXEC_WRAPPER = ("/bin/sh", "-c", 'exec "$@"', "sh")


def resolve_token(options: Mapping[str, Any]) -> str | None:
    """``e2b_token``, then ``e2b_token_file``, then ``$E2B_ACCESS_TOKEN``; None if unset
    (envd only checks a token on sandboxes created "secure")."""
    return find_secret(
        options, "e2b_token", "e2b_token_file", ("E2B_ACCESS_TOKEN",), "E2B access token"
    )


def envd_url(template: str, sandbox_id: str) -> str:
    """The envd base URL: ``{id}`` and ``{domain}`` in ``template`` are filled in."""
    domain = os.environ.get("E2B_DOMAIN", "").strip() or DEFAULT_DOMAIN
    url = template.replace("{id}", sandbox_id).replace("{domain}", domain).rstrip("/")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as err:
        raise UsageError(f"bad E2B envd URL {url!r}: {err}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise UsageError(f"E2B envd URL must be http(s)://HOST..., got {url!r}")
    return url


class _SandboxNotFound(SandboxUnreachable):
    """The edge's 502 "sandbox was not found" (or a 404) before any exec succeeded."""


class E2BTransport(Transport):
    """One sandbox's envd; one pooled HTTP client, one ``Start`` stream per exec."""

    scheme: ClassVar[str] = "e2b"
    capabilities: ClassVar[Capabilities] = Capabilities(
        stdin=True,
        binary_safe=True,
        separate_stderr=True,
        file_read=True,
        long_argv=True,
        channel=True,
    )

    def __init__(
        self,
        sandbox_id: str,
        *,
        token: str | None,
        base_url: str | None = None,
        workspace: str | None = None,
        user: str | None = None,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
        # a keepalive is a few bytes: asking for one every 2 s makes a silent stream
        # (start, then nothing) cost 5.5 s rather than 30.5 s; it hits the admission,
        # which has no shorter deadline (it may measure the workspace for 20 s), and
        # the other calls before their kind has taught one
        keepalive_interval: float = 2.0,
        stall_factor: float = 2.5,
        connect_timeout: float = 15.0,
    ) -> None:
        if not sandbox_id:
            raise UsageError("e2b:// needs a sandbox id (e2b://SANDBOX_ID/PATH)")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}", sandbox_id):
            # it becomes part of the envd host name ({id} in the URL template)
            raise UsageError(f"bad E2B sandbox id {sandbox_id!r} (letters, digits, '-', '_')")
        self.sandbox_id = sandbox_id
        self.base_url = check_base_url(envd_url(base_url or DEFAULT_URL, sandbox_id), "E2B envd")
        self.workspace = workspace
        self.user = user
        self.workdir = workdir
        self.env = dict(env or {})
        if keepalive_interval <= 0 or stall_factor < 1:
            raise UsageError("keepalive_interval must be > 0 and stall_factor >= 1")
        self.keepalive_interval = keepalive_interval
        self.stall_timeout = keepalive_interval * stall_factor + 0.5
        self.connect_timeout = connect_timeout
        self._token = token
        self._client: httpx.AsyncClient | None = None
        self._ok_once = False
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    def from_uri(cls, uri: SandboxURI, options: Mapping[str, Any]) -> E2BTransport:
        if not uri.name:
            raise UsageError(f"{uri.raw!r}: missing sandbox id (e2b://SANDBOX_ID/PATH)")
        base = options.get("e2b_url") or os.environ.get("E2B_ENVD_URL") or DEFAULT_URL
        extra = float_options(
            options, ("keepalive_interval", "stall_factor", "connect_timeout"), "e2b_"
        )
        return cls(
            uri.name,
            token=resolve_token(options),
            base_url=str(base),
            workspace=uri.path,
            user=options.get("e2b_user") or uri.user,
            workdir=options.get("dir"),
            env=options.get("env"),
            **extra,
        )

    @property
    def description(self) -> str:
        return f"e2b://{self.sandbox_id}"

    def __repr__(self) -> str:
        return f"E2BTransport({self.description}, base_url={self.base_url!r})"

    # ------------------------------------------------------------------ plumbing

    def _headers(self) -> dict[str, str]:
        headers = {
            "User-Agent": "wsync",
            **httpbody.IDENTITY,
            # the newer SDKs' routing through https://sandbox.<domain>; harmless on the
            # per-sandbox host
            "E2b-Sandbox-Id": self.sandbox_id,
            "E2b-Sandbox-Port": str(ENVD_PORT),
        }
        if self._token:
            headers["X-Access-Token"] = self._token
        if self.user:
            headers["Authorization"] = (
                "Basic " + base64.b64encode(f"{self.user}:".encode()).decode()
            )
        return headers

    def _http(self) -> httpx.AsyncClient:
        if self._closed:
            raise TransportError(f"{self.description}: transport is closed")
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                headers=self._headers(),
                timeout=httpx.Timeout(self.connect_timeout),
                limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
                follow_redirects=False,
                trust_env=False,
            )
        return self._client

    def _timeout(self, seconds: float) -> httpx.Timeout:
        seconds = max(seconds, 0.05)
        return httpx.Timeout(seconds, connect=min(seconds, self.connect_timeout))

    def _refused(self, status: int, body: bytes, what: str) -> TransportError | SandboxUnreachable:
        """The error for a non-200 answer (no stream was started)."""
        text = error_message(body)
        if status in (401, 403):
            return AuthFailed(
                f"{self.description}: authentication failed (HTTP {status}); check E2B_ACCESS_TOKEN"
            )
        if status in (404, 502) and "not found" in text.lower() and not self._ok_once:
            return _SandboxNotFound(
                f"{self.description}: sandbox not found (HTTP {status}: {text})"
            )
        return TransportError(f"{self.description}: {what} refused (HTTP {status}: {text})")

    def _wire_error(self, err: Exception, timeout: float) -> TransportError | SandboxUnreachable:
        if isinstance(err, httpx.TimeoutException):
            return TransportTimeout(timeout)
        if isinstance(err, httpx.ConnectError) and not self._ok_once:
            return SandboxUnreachable(
                f"{self.description}: cannot connect to {self.base_url}: {err}"
            )
        return TransportError(f"{self.description}: {type(err).__name__}: {err}")

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _check_stream(self, response: httpx.Response) -> None:
        """Raise unless ``response`` is a ``Start`` stream: HTTP 200 and Connect's JSON."""
        if response.status_code != 200:
            raise self._refused(response.status_code, await httpbody.head(response), "exec")
        ctype = response.headers.get("content-type", "")
        if not ctype.startswith(CONNECT_JSON):
            what = ctype or "no content type"
            raise TransportError(f"{self.description}: exec answered {what!r}")
        httpbody.refuse_encoded(response, f"{self.description}: exec")

    async def _unary(self, path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
        """One Connect unary call (bare JSON): (status, body)."""
        async with self._http().stream(
            "POST",
            path,
            content=body,
            headers={"Content-Type": "application/json", "Connect-Protocol-Version": "1"},
            timeout=self._timeout(timeout),
        ) as response:
            return response.status_code, await httpbody.head(response)

    async def _kill(self, pid: int | None, tag: str) -> None:
        """Best effort: envd keeps a process whose stream ended, so kill what we abandon.

        Without a pid (abandoned before the ``start`` event arrived) the process is named
        by the tag its StartRequest carried; it may not have started yet, so a
        ``not_found`` is asked again a few times before giving up."""
        body = (
            pid_body(pid, signal="SIGNAL_SIGKILL")
            if pid is not None
            else tag_body(tag, signal="SIGNAL_SIGKILL")
        )
        try:
            async with asyncio.timeout(5.0):
                for delay in (0.0, 0.25, 0.5, 1.0) if pid is None else (0.0,):
                    await asyncio.sleep(delay)
                    status, _ = await self._unary(SEND_SIGNAL_PATH, body, timeout=5.0)
                    if status != 404:
                        return
        except (TimeoutError, httpx.HTTPError, TransportError) as err:
            log.debug("e2b %s: kill of %s failed: %r", self.sandbox_id, pid or tag, err)

    def _start_headers(self, lifetime: float) -> dict[str, str]:
        """A ``Start`` request's headers: envd kills the process after ``lifetime``
        seconds, and sends keepalives while the stream is quiet."""
        return {
            "Content-Type": CONNECT_JSON,
            "Connect-Protocol-Version": "1",
            "Connect-Timeout-Ms": str(max(1, int(lifetime * 1000))),
            "Keepalive-Ping-Interval": str(max(1, round(self.keepalive_interval))),
        }

    # ---------------------------------------------------------------------- exec

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        return await self._while_resuming(
            lambda: self._exec(argv, stdin, timeout, max_output), timeout
        )

    async def _while_resuming(self, start: Callable[[], Awaitable[T]], timeout: float) -> T:
        """``start()``; the edge also says "sandbox was not found" while a paused sandbox
        resumes, so that answer is asked again twice (1.5 s in all) before it is taken
        to mean that the sandbox does not exist (exit 3)."""
        for delay in (0.5, 1.0):
            try:
                return await start()
            except _SandboxNotFound:
                if delay >= timeout / 4:
                    raise
                log.debug("e2b %s: sandbox not found, asking again", self.sandbox_id)
                await asyncio.sleep(delay)
        return await start()

    async def _exec(
        self, argv: Sequence[str], stdin: bytes | None, timeout: float, max_output: int
    ) -> ExecResult:
        if max_output < 0:
            raise UsageError("max_output must be >= 0")
        if not argv:
            raise UsageError("exec needs a non-empty argv")
        tag = f"wsync-{secrets.token_hex(8)}"
        body = start_request(
            [*EXEC_WRAPPER, *argv],
            stdin=stdin is not None,
            cwd=self.workdir,
            envs=self.env,
            tag=tag,
        )
        headers = self._start_headers(timeout)
        collector = StartCollector(max_output)
        sender: asyncio.Task[None] | None = None
        stdin_error: list[str] = []
        deadline = asyncio.get_running_loop().time() + timeout
        ended_well = refused = False
        try:
            async with asyncio.timeout_at(deadline):
                async with self._http().stream(
                    "POST",
                    START_PATH,
                    content=body,
                    headers=headers,
                    timeout=self._timeout(timeout),
                ) as response:
                    refused = response.status_code != 200  # no process was started
                    await self._check_stream(response)
                    chunks = httpbody.raw_body(response, self.description)
                    while True:
                        try:
                            async with asyncio.timeout(self.stall_timeout):
                                chunk = await anext(chunks)
                        except StopAsyncIteration:
                            break
                        except TimeoutError:
                            raise TransportError(
                                f"{self.description}: stream stalled (no event for "
                                f"{self.stall_timeout:.0f}s)"
                            ) from None
                        collector.feed(chunk)
                        if sender is None and stdin is not None and collector.pid is not None:
                            sender = asyncio.create_task(
                                self._send_stdin(collector.pid, stdin, deadline, stdin_error)
                            )
            ended_well = True
        except TimeoutError:
            raise TransportTimeout(timeout) from None
        except ProtocolError as err:
            raise TransportError(f"{self.description}: {err}") from None
        except httpx.HTTPError as err:
            raise self._wire_error(err, timeout) from None
        finally:
            if sender is not None and not sender.done():
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sender
            if not refused and (not ended_well or collector.end is None):
                self._spawn(self._kill(collector.pid, tag))
        self._ok_once = True
        return self._finish(collector, timeout, deadline, stdin_error)

    def _finish(
        self, collector: StartCollector, timeout: float, deadline: float, stdin_error: list[str]
    ) -> ExecResult:
        """The result, or the error the end-stream message carried.  envd's
        ``deadline_exceeded`` before our own deadline (the race with ``end``) is a
        transport error, not a timeout: nothing here waited that long."""
        error: EndStream | None = collector.error
        if error is not None:
            code = error.error_code
            if code == "deadline_exceeded" and asyncio.get_running_loop().time() >= deadline:
                raise TransportTimeout(timeout)
            if code in ("unauthenticated", "permission_denied"):
                raise AuthFailed(f"{self.description}: envd refused the exec ({code})")
            raise TransportError(
                f"{self.description}: envd error {code}: {error.error_message[:200]}"
            )
        result = collector.result()
        if stdin_error:
            # A command that ended on its own did not need what it did not read (EPIPE);
            # one that we killed because its stdin failed did not finish its work.
            end = collector.end
            if end is None or result.exit_status is None or end.status == "signal: killed":
                raise TransportError(f"{self.description}: stdin not delivered: {stdin_error[0]}")
            result = dataclasses.replace(
                result, notes=(*result.notes, f"stdin not fully delivered: {stdin_error[0]}")
            )
        if result.notes:
            log.debug("e2b %s exec notes: %s", self.sandbox_id, "; ".join(result.notes))
        return result

    async def _send_stdin(self, pid: int, data: bytes, deadline: float, errors: list[str]) -> None:
        """SendInput in chunks, then CloseStdin.  A process that already exited is fine;
        any other failure kills the process, so the stream ends and the exec fails."""
        loop = asyncio.get_running_loop()
        try:
            status, body = await send_input(self._unary, pid, data, deadline)
            if status == 200:
                status, body = await self._unary(
                    CLOSE_STDIN_PATH, pid_body(pid), deadline - loop.time()
                )
            if status in (200, 404):  # 404: the process already exited (not_found)
                return
            errors.append(f"HTTP {status}: {error_message(body)}")
        except httpx.HTTPError as err:
            errors.append(f"{type(err).__name__}: {err}")
        await self._kill(pid, "")

    # ------------------------------------------------------------------- channel

    @property
    def channel_limit(self) -> int:
        # each channel holds one of the client's connections while its stream is open,
        # and its SendInput calls and every other call need free ones; chunks are read
        # through /files, so a pull has a few calls through helpers at once
        return 8

    async def _end(self, pid: int | None, tag: str, *, now: bool) -> None:
        """A helper's end: ``CloseStdin`` (its loop ends after the call it runs), and the
        kill where that did not get through; only the kill when ``now`` or no pid."""
        if pid is not None and not now:
            with contextlib.suppress(TimeoutError, httpx.HTTPError, TransportError):
                async with asyncio.timeout(5.0):
                    status, _ = await self._unary(CLOSE_STDIN_PATH, pid_body(pid), 5.0)
                if status in (200, 404):  # 404: it has exited already
                    return
        await self._kill(pid, tag)

    async def open_channel(self, argv: Sequence[str], *, timeout: float) -> Channel:
        """``argv`` (under the exec wrapper) with a stdin pipe, its ``Start`` stream kept
        open (:class:`~wsync.transports.e2b_channel.E2BChannel`), once its ``start``
        event has named the pid."""
        if not argv:
            raise UsageError("a channel needs a non-empty argv")
        deadline = asyncio.get_running_loop().time() + timeout
        return await self._while_resuming(lambda: self._open_channel(argv, deadline), timeout)

    async def _open_channel(self, argv: Sequence[str], deadline: float) -> Channel:
        timeout = max(deadline - asyncio.get_running_loop().time(), 0.0)
        tag = f"wsync-{secrets.token_hex(8)}"
        body = start_request(
            [*EXEC_WRAPPER, *argv], stdin=True, cwd=self.workdir, envs=self.env, tag=tag
        )
        client = self._http()
        request = client.build_request(
            "POST",
            START_PATH,
            content=body,
            headers=self._start_headers(LIFETIME),
            # (no read timeout: the channel's own stall check covers the whole stream)
            timeout=httpx.Timeout(self.connect_timeout, read=None),
        )
        channel: E2BChannel | None = None
        refused = False
        try:
            async with asyncio.timeout(timeout):
                response = await client.send(request, stream=True)
                try:
                    refused = response.status_code != 200  # no process was started
                    await self._check_stream(response)
                except BaseException:
                    await response.aclose()
                    raise
                channel = E2BChannel(
                    response,
                    self.description,
                    tag=tag,
                    unary=self._unary,
                    stop=lambda pid, name, now: self._spawn(self._end(pid, name, now=now)),
                    stall_timeout=self.stall_timeout,
                    retire_after=RETIRE,
                )
                await channel.started()
        except BaseException as err:
            if channel is not None:
                await channel.aclose(abort=True)  # it kills by pid or tag
            elif not refused:  # the process may have started all the same
                self._spawn(self._kill(None, tag))
            if isinstance(err, TimeoutError):
                raise TransportTimeout(timeout) from None
            if isinstance(err, httpx.HTTPError):
                raise self._wire_error(err, timeout) from None
            raise
        self._ok_once = True
        return channel

    # ----------------------------------------------------------------- read_file

    async def read_file(self, path: str, offset: int, length: int, *, timeout: float) -> bytes:
        """``GET /files?path=`` with a Range; a server that ignores the Range is skipped
        through (streamed, never buffered whole); a short body is returned short, and so
        is a body cut part-way (the bytes before the cut are as good as any: the caller
        hashes what it assembles and asks for the rest, rather than giving up on a file
        API that answered)."""
        if offset < 0 or length < 0:
            raise UsageError("offset and length must be >= 0")
        if length == 0:
            return b""
        params = {"path": path}
        if self.user:
            params["username"] = self.user
        headers = {"Range": range_header(offset, length), "Accept-Encoding": "identity"}
        out = bytearray()
        body = False  # the answer's status was fine and its bytes are arriving
        try:
            async with asyncio.timeout(timeout):
                async with self._http().stream(
                    "GET",
                    FILES_PATH,
                    params=params,
                    headers=headers,
                    timeout=self._timeout(timeout),
                ) as response:
                    status = response.status_code
                    if status == 416:
                        return b""
                    if status not in (200, 206):
                        err = self._refused(
                            status, await httpbody.head(response), f"read of {path!r}"
                        )
                        raise TransportError(str(err))
                    skip = offset if status == 200 else 0
                    if status == 206:
                        first, _, _ = parse_content_range(response.headers.get("content-range", ""))
                        if first != offset:
                            raise TransportError(
                                f"{self.description}: asked for byte {offset}, got {first}"
                            )
                    elif offset:
                        log.debug("e2b %s: /files ignored the Range", self.sandbox_id)
                    body = True
                    async for chunk in httpbody.raw_body(response, f"{self.description}: read"):
                        if skip >= len(chunk):
                            skip -= len(chunk)
                            continue
                        out += chunk[skip : skip + length - len(out)]
                        skip = 0
                        if len(out) >= length:
                            break
        except TimeoutError:
            raise TransportTimeout(timeout) from None
        except ProtocolError as err:
            raise TransportError(f"{self.description}: {err}") from None
        except httpx.HTTPError as err:
            if body and isinstance(err, httpx.TransportError):
                # (cut before its first byte too: an answer of nothing, short like any
                # other, not a failure that counts toward turning the file API off)
                log.debug("e2b %s: /files body cut after %d bytes", self.sandbox_id, len(out))
                return bytes(out)
            wire = self._wire_error(err, timeout)
            raise wire if isinstance(wire, TransportError) else TransportError(str(wire)) from None
        return bytes(out)

    async def aclose(self) -> None:
        # (the kills and helper ends started while it waits are waited for too)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(6.0):
                while self._background:
                    await asyncio.gather(*self._background, return_exceptions=True)
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
