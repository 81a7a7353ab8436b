"""``daytona://SANDBOX_ID/PATH``: the Daytona toolbox API, reported honestly.

Exec is ``POST {toolbox}/{id}/process/execute``, one JSON answer per command (see
:mod:`wsync.transports.daytona_protocol`).  What that channel does to output decides
the capabilities:

* stdout and stderr arrive merged in one ``result`` string (``separate_stderr=False``;
  everything is reported as stdout);
* the string was decoded lossily (invalid UTF-8 became U+FFFD) and can be cut short
  with a real-looking exit code, so the channel is text (``binary_safe=False``: the
  engine sends base64 lines and checks length and hash);
* the command's stdin is the daemon's script pipe, so nothing can be sent
  (``stdin=False``);
* a timeout answers 408 with the output thrown away: :class:`TransportTimeout`.  The
  request carries ``timeout`` = the engine's per-call deadline in whole seconds, so the
  daemon kills the process group at that deadline, and the client gives up a few
  seconds later whatever the server does;
* the daemon keeps running a command whose client went away.  So an exec that is
  cancelled, times out on the client side or loses its connection sends a second,
  short exec that kills the process group carrying that call's marker (a detached
  producer, in its own session, is not in it).  That kill may run before the daemon
  has started the command at all (the call names no process, and the kill comes on
  another connection): it first leaves a kill marker directory
  (``/tmp/wsync-kill-<hex>``), and the command runs nothing when it finds it.

``read_file`` uses ``GET {toolbox}/{id}/files/download?path=`` with a ``Range`` header
(the daemon serves files with Go's ``http.ServeFile``, which honours it).  A server that
ignores ``Range`` and sends the whole file is accepted only for small files
(``full_read_limit``); beyond that the read is refused and the engine reads through
exec.  A body cut short is a :class:`TransportError`; the bytes are never trusted anyway.

The token goes only into the ``Authorization`` header: never logged, never in
:attr:`description`, errors or ``repr``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NoReturn
from urllib.parse import quote

import httpx

from wsync.digits import ascii_digits
from wsync.errors import (
    AuthFailed,
    ProtocolError,
    SandboxUnreachable,
    TransportError,
    TransportTimeout,
    UsageError,
    WsyncError,
)
from wsync.transports import httpbody
from wsync.transports.base import (
    DEFAULT_MAX_OUTPUT,
    Capabilities,
    ExecResult,
    Transport,
    find_secret,
    float_options,
    header_safe,
)
from wsync.transports.daytona_protocol import (
    MARKER_PREFIX,
    ExecBody,
    command_text,
    kill_argv,
    parse_content_range,
    parse_error,
    range_header,
    request_body,
)
from wsync.uri import SandboxURI

log = logging.getLogger(__name__)

#: the example toolbox proxy of Daytona's cloud; the real one is per region (the
#: sandbox's ``toolboxProxyUrl``), so set DAYTONA_TOOLBOX_URL
DEFAULT_TOOLBOX_URL = "https://proxy.app.daytona.io/toolbox"
URL_ENV = "DAYTONA_TOOLBOX_URL"
TOKEN_ENV = "DAYTONA_API_KEY"  # noqa: S105 - a variable name
ORG_ENV = "DAYTONA_ORGANIZATION_ID"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
MiB = 1024 * 1024


def resolve_token(options: Mapping[str, Any]) -> str:
    """``daytona_token``, then ``daytona_token_file``, then ``$DAYTONA_API_KEY``."""
    token = find_secret(
        options, "daytona_token", "daytona_token_file", (TOKEN_ENV,), "Daytona API key"
    )
    if token is None:
        raise AuthFailed(f"no Daytona API key: set {TOKEN_ENV} or pass a token file")
    return token


def _why(err: httpx.HTTPError) -> str:
    """An httpx error in words: its type, and its text unless it is about our own request
    (h11 quotes a refused header whole, the token with it)."""
    if isinstance(err, httpx.LocalProtocolError):
        return type(err).__name__
    return f"{type(err).__name__}: {err}"


def _shown_url(url: httpx.URL) -> str:
    """The base URL for messages: no userinfo, no query."""
    return str(url.copy_with(username=None, password=None, query=None, fragment=None))


class DaytonaTransport(Transport):
    """One sandbox's toolbox; connections are reused across execs."""

    scheme: ClassVar[str] = "daytona"
    capabilities: ClassVar[Capabilities] = Capabilities(
        stdin=False, binary_safe=False, separate_stderr=False, file_read=True, long_argv=True
    )

    def __init__(
        self,
        sandbox_id: str,
        *,
        token: str,
        base_url: str = DEFAULT_TOOLBOX_URL,
        workspace: str | None = None,
        workdir: str | None = None,
        organization_id: str | None = None,
        connect_timeout: float = 15.0,
        timeout_grace: float = 5.0,
        kill_timeout: float = 10.0,
        close_wait: float = 5.0,
        full_read_limit: int = 8 * MiB,
        max_connections: int = 32,
    ) -> None:
        if not sandbox_id or not _ID.match(sandbox_id):
            raise UsageError(f"bad Daytona sandbox id {sandbox_id!r}")
        try:
            url = httpx.URL(base_url)
        except (httpx.InvalidURL, TypeError) as err:
            raise UsageError(f"bad Daytona toolbox URL: {err}") from None
        if url.scheme not in ("http", "https") or not url.host:
            raise UsageError(f"the Daytona toolbox URL must be http(s)://HOST/...: {base_url!r}")
        self.sandbox_id = sandbox_id
        self.workspace = workspace
        self.workdir = workdir
        self.base_url = _shown_url(url)
        self.connect_timeout = connect_timeout
        self.timeout_grace = timeout_grace
        self.kill_timeout = kill_timeout
        self.close_wait = close_wait
        self.full_read_limit = full_read_limit
        self.max_connections = max_connections
        root = str(url).rstrip("/") + "/" + quote(sandbox_id, safe="")
        self._exec_url = root + "/process/execute"
        self._download_url = root + "/files/download"
        self._headers = {
            "Authorization": f"Bearer {token}",
            "User-Agent": "wsync",
            **httpbody.IDENTITY,
        }
        if organization_id:
            self._headers["X-Daytona-Organization-ID"] = organization_id
        self._client: httpx.AsyncClient | None = None
        self._closed = False
        self._answered_once = False
        #: None until a download shows whether Range is honoured
        self._range_ok: bool | None = None
        self._kills: set[asyncio.Task[None]] = set()
        self._kill_gate: asyncio.Semaphore | None = None

    @classmethod
    def from_uri(cls, uri: SandboxURI, options: Mapping[str, Any]) -> DaytonaTransport:
        if not uri.name:
            raise UsageError(f"{uri.raw!r}: missing sandbox id (daytona://SANDBOX_ID/PATH)")
        base = options.get("daytona_url") or os.environ.get(URL_ENV) or DEFAULT_TOOLBOX_URL
        org = options.get("daytona_organization_id") or os.environ.get(ORG_ENV) or None
        extra = float_options(options, ("connect_timeout", "timeout_grace", "kill_timeout"))
        return cls(
            uri.name,
            token=resolve_token(options),
            base_url=str(base),
            workspace=uri.path,
            workdir=options.get("dir"),
            organization_id=header_safe(str(org), "Daytona organization id") if org else None,
            **extra,
        )

    @property
    def description(self) -> str:
        return f"daytona://{self.sandbox_id}"

    def __repr__(self) -> str:
        return f"DaytonaTransport({self.description}, base_url={self.base_url!r})"

    # -- plumbing -------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        if self._closed:
            raise TransportError(f"{self.description}: transport is closed")
        if self._client is None:
            self._client = httpx.AsyncClient(
                headers=self._headers,
                limits=httpx.Limits(
                    max_connections=self.max_connections,
                    max_keepalive_connections=self.max_connections,
                ),
                timeout=httpx.Timeout(60.0, connect=self.connect_timeout),
                follow_redirects=False,
                trust_env=False,
            )
        return self._client

    def _timeouts(self, seconds: float) -> httpx.Timeout:
        return httpx.Timeout(seconds, connect=min(self.connect_timeout, seconds))

    def _status_error(self, status: int, body: bytes, what: str) -> NoReturn:
        reason = parse_error(body)
        suffix = f": {reason}" if reason else ""
        if status == 401 or (status == 403 and what == "execute"):
            raise AuthFailed(
                f"{self.description}: authentication failed (HTTP {status}); check {TOKEN_ENV}"
            )
        if 300 <= status < 400 and what == "execute":
            raise SandboxUnreachable(
                f"the Daytona toolbox URL {self.base_url} redirects (HTTP {status}); "
                "give the toolbox proxy URL itself"
            )
        if status == 404 and what == "execute":
            raise SandboxUnreachable(
                f"Daytona sandbox {self.sandbox_id} not found at {self.base_url} (HTTP 404)"
            )
        raise TransportError(f"{self.description}: {what} failed (HTTP {status}{suffix})")

    def _connection_error(self, err: httpx.HTTPError, what: str) -> WsyncError:
        message = f"{self.description}: {what}: {_why(err)}"
        if isinstance(err, httpx.ConnectError) and not self._answered_once:
            return SandboxUnreachable(f"cannot reach the Daytona toolbox at {self.base_url}: {err}")
        return TransportError(message)

    async def _read_some(self, response: httpx.Response, limit: int) -> bytes:
        buf = bytearray()
        async for chunk in httpbody.raw_body(response, f"{self.description}: download"):
            buf += chunk
            if len(buf) >= limit:
                break
        return bytes(buf[:limit])

    # -- exec -------------------------------------------------------------------------

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        if stdin:
            raise UsageError(f"{self.description}: the Daytona execute API has no stdin")
        if max_output < 0:
            raise UsageError("max_output must be >= 0")
        if not argv:
            raise UsageError("empty argv")
        return await self._execute(list(argv), timeout, max_output, kill_on_loss=True)

    async def _execute(
        self, argv: list[str], timeout: float, max_output: int, *, kill_on_loss: bool
    ) -> ExecResult:
        marker = MARKER_PREFIX + secrets.token_hex(12)
        body = request_body(command_text(argv, marker), timeout, self.workdir)
        client = self._http()
        limit = timeout + self.timeout_grace
        landed = False  # the daemon answered: the command is over
        try:
            async with asyncio.timeout(limit):
                async with client.stream(
                    "POST", self._exec_url, json=body, timeout=self._timeouts(limit)
                ) as response:
                    self._answered_once = True
                    status = response.status_code
                    if status == 408:
                        landed = True
                        raise TransportTimeout(timeout)
                    if status != 200:
                        landed = status < 500
                        self._status_error(status, await httpbody.head(response), "execute")
                    collector = ExecBody(max_output)
                    async for chunk in httpbody.raw_body(response, self.description):
                        if not collector.feed(chunk):
                            break
                    landed = True
            outcome = collector.outcome()
        except TimeoutError:
            self._kill_later(marker, kill_on_loss)
            raise TransportTimeout(timeout) from None
        except asyncio.CancelledError:
            self._kill_later(marker, kill_on_loss)
            raise
        except httpx.TimeoutException:
            self._kill_later(marker, kill_on_loss)
            raise TransportTimeout(timeout) from None
        except httpx.HTTPError as err:
            self._kill_later(marker, kill_on_loss and not landed)
            raise self._connection_error(err, "execute") from None
        except ProtocolError as err:
            raise TransportError(f"{self.description}: {err}") from None
        except WsyncError:
            if not landed:
                self._kill_later(marker, kill_on_loss)
            raise
        notes: list[str] = ["stdout and stderr merged"]
        if outcome.replaced:
            notes.append("U+FFFD in output (lossy UTF-8)")
        if outcome.exit_code == -1:
            notes.append("exitCode -1 (start failure, signal or wait error)")
        if outcome.exit_code is None:
            notes.append("no exit code in the answer")
        return ExecResult(
            stdout=outcome.output,
            exit_status=outcome.exit_code,
            truncated=outcome.truncated,
            notes=tuple(notes),
        )

    def _kill_later(self, marker: str, wanted: bool) -> None:
        """Kill the abandoned command's process group, in the background (best effort)."""
        if not wanted or self._closed:
            return
        if self._kill_gate is None:
            self._kill_gate = asyncio.Semaphore(4)
        task = asyncio.get_running_loop().create_task(self._kill(marker, self._kill_gate))
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def _kill(self, marker: str, gate: asyncio.Semaphore) -> None:
        async with gate:
            try:
                await self._execute(kill_argv(marker), self.kill_timeout, 4096, kill_on_loss=False)
            except WsyncError as err:
                log.debug("daytona %s: kill of an abandoned exec failed: %s", self.sandbox_id, err)

    # -- files --------------------------------------------------------------------------

    async def read_file(self, path: str, offset: int, length: int, *, timeout: float) -> bytes:
        if offset < 0 or length < 0:
            raise UsageError("offset and length must be >= 0")
        if length == 0:
            return b""
        if not path.startswith("/"):
            raise TransportError(f"{self.description}: the file API needs an absolute path")
        if self._range_ok is False and offset + length > self.full_read_limit:
            raise TransportError(
                f"{self.description}: the file API ignores Range; "
                f"reads past {self.full_read_limit} bytes go through exec"
            )
        client = self._http()
        headers = {"Range": range_header(offset, length), "Accept-Encoding": "identity"}
        try:
            async with asyncio.timeout(timeout):
                async with client.stream(
                    "GET",
                    self._download_url,
                    params={"path": path},
                    headers=headers,
                    timeout=self._timeouts(timeout),
                ) as response:
                    self._answered_once = True
                    return await self._take_range(response, offset, length)
        except TimeoutError:
            raise TransportTimeout(timeout) from None
        except httpx.TimeoutException:
            raise TransportTimeout(timeout) from None
        except httpx.HTTPError as err:
            # a fast path never ends a pull: the engine falls back to exec reads
            raise TransportError(f"{self.description}: download: {_why(err)}") from None
        except ProtocolError as err:
            raise TransportError(f"{self.description}: download: {err}") from None

    async def _take_range(self, response: httpx.Response, offset: int, length: int) -> bytes:
        status = response.status_code
        if status == 416:
            return b""  # the file ends before offset
        if status == 206:
            self._range_ok = True
            first, last, _size = parse_content_range(response.headers.get("content-range", ""))
            if first != offset:
                raise ProtocolError(f"asked for offset {offset}, got {first}", "malformed")
            promised = min(last - first + 1, length)
            data = await self._read_some(response, promised)
            if len(data) < promised:
                raise TransportError(
                    f"{self.description}: download cut short: {len(data)} of {promised} bytes"
                )
            return data
        if status == 200:
            if self._range_ok is None:
                log.debug("daytona %s: the file API ignored Range", self.sandbox_id)
            self._range_ok = False
            if offset + length > self.full_read_limit:
                raise TransportError(
                    f"{self.description}: the file API ignores Range; "
                    f"reads past {self.full_read_limit} bytes go through exec"
                )
            declared = response.headers.get("content-length")
            data = await self._read_some(response, offset + length)
            expected = offset + length
            if declared is not None and ascii_digits(declared):
                expected = min(int(declared), expected)
            if len(data) < expected:
                raise TransportError(
                    f"{self.description}: download cut short: {len(data)} of {expected} bytes"
                )
            return data[offset : offset + length]
        return self._status_error(status, await httpbody.head(response), "download")

    async def aclose(self) -> None:
        """Let pending kills finish (a few seconds at most: Ctrl-C must stay quick), close."""
        if self._closed:
            return
        kills = list(self._kills)
        if kills:
            _, pending = await asyncio.wait(kills, timeout=self.close_wait)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
