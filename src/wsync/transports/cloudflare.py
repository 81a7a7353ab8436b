"""``cloudflare://SANDBOX_ID/PATH``: exec through the Cloudflare Sandbox Bridge, reported honestly.

The Bridge (the Sandbox SDK's public HTTP surface) answers ``POST /v1/sandbox/{id}/exec``
with an SSE stream of base64 ``stdout``/``stderr`` events and an ``exit`` event.
What that channel does to output (``docs/backends/cloudflare.md``, "Faults handled"):

* it is **text**: output was decoded as UTF-8 with U+FFFD replacement before
  being base64-encoded, session mode adds ``"\\n"`` to lines and drops NULs, long
  lines can lose fragments.  So ``binary_safe=False``: the engine sends payloads
  as base64 in 76-column lines and verifies them;
* it has **no stdin** (the exec body has no field for it; the container runs
  commands with stdin ``/dev/null`` or ``ignore``), so ``stdin=False``;
* its **exit code lies**: ``exitCode ?? 0`` turns a missing code into 0, and the
  stream can end with a made-up ``exit 0`` while the command still runs
  (cloudflare/sandbox-sdk#873).  This transport reports the code it was given
  and nothing more; the engine's envelopes detect the loss.  A stream that ends
  without an ``exit`` event gives ``exit_status=None``, never 0.

Also: ``GET /v1/sandbox/{id}/file/<path>`` returns raw bytes but only under
``/workspace`` (403 elsewhere); :meth:`read_file` uses it (``file_read=True``),
reporting refusals and short bodies as :class:`TransportError`.

One ``httpx.AsyncClient`` per transport (connection reuse), created on first use
in the running loop.  httpx because it is already a dependency, streams response
bodies, has per-phase timeouts and one exception tree to map.  The token goes only
into the ``Authorization`` header: never into logs, :attr:`description`, errors or
``repr``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NoReturn

import httpx

from wsync.errors import (
    AuthFailed,
    ProtocolError,
    SandboxUnreachable,
    TransportError,
    TransportTimeout,
    UsageError,
)
from wsync.protocol.records import printable
from wsync.transports import httpbody
from wsync.transports.base import (
    DEFAULT_MAX_OUTPUT,
    Capabilities,
    ExecResult,
    Transport,
    check_base_url,
    find_secret,
)
from wsync.transports.cloudflare_protocol import (
    ExecCollector,
    SSEParser,
    check_sandbox_id,
    exec_body,
    exec_path,
    file_path,
)
from wsync.uri import SandboxURI

log = logging.getLogger(__name__)

URL_ENV = "CLOUDFLARE_SANDBOX_URL"
TOKEN_ENV = "CLOUDFLARE_SANDBOX_TOKEN"  # noqa: S105 - a variable name
#: the server-side timeout outlives ours, so our deadline (and its disconnect) kills first
SERVER_TIMEOUT_MARGIN = 5.0
#: a 503 before the stream (container starting) is retried inside one call this often
RETRIES_503 = 4


def resolve_token(options: Mapping[str, Any]) -> str:
    """``cloudflare_token``, then ``cloudflare_token_file``, then ``$CLOUDFLARE_SANDBOX_TOKEN``."""
    token = find_secret(
        options, "cloudflare_token", "cloudflare_token_file", (TOKEN_ENV,), "Cloudflare token"
    )
    if token is None:
        raise AuthFailed(f"no Cloudflare Sandbox token: set {TOKEN_ENV} or pass a token file")
    return token


def _sandbox_id(uri: SandboxURI) -> str:
    """The id as written: :func:`urllib.parse.urlsplit` lowercases ``hostname``."""
    netloc = urllib.parse.urlsplit(uri.raw).netloc
    if uri.user is not None or uri.port is not None:
        raise UsageError(f"{uri.raw!r}: cloudflare://SANDBOX_ID/PATH takes no user or port")
    return check_sandbox_id(urllib.parse.unquote(netloc))


class CloudflareTransport(Transport):
    """One sandbox behind a Bridge worker; every :meth:`exec` is one streamed POST."""

    scheme: ClassVar[str] = "cloudflare"
    capabilities: ClassVar[Capabilities] = Capabilities(
        stdin=False, binary_safe=False, separate_stderr=True, file_read=True, long_argv=True
    )

    def __init__(
        self,
        sandbox_id: str,
        *,
        token: str,
        base_url: str,
        workspace: str | None = None,
        cwd: str | None = None,
        connect_timeout: float = 15.0,
        drain_timeout: float = 0.5,
        retry_delay: float = 0.1,
        full_read_limit: int = 8 * 1024 * 1024,
    ) -> None:
        self.sandbox_id = check_sandbox_id(sandbox_id)
        #: the file API serves whole files (no ranges): a read ending past this many
        #: bytes is refused, and the engine reads it through exec (each read of a staged
        #: stream's later chunks would download all before it: quadratic in its length)
        self.full_read_limit = full_read_limit
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError(f"bad Cloudflare Bridge URL {base_url!r} (expected https://...)")
        self.base_url = check_base_url(base_url.rstrip("/"), "Cloudflare Bridge")
        self.workspace = workspace
        self.cwd = cwd
        self.connect_timeout = connect_timeout
        self.drain_timeout = drain_timeout
        self.retry_delay = retry_delay
        self._token = token
        self._client: httpx.AsyncClient | None = None
        self._connected_once = False

    @classmethod
    def from_uri(cls, uri: SandboxURI, options: Mapping[str, Any]) -> CloudflareTransport:
        base = options.get("cloudflare_url") or os.environ.get(URL_ENV, "").strip()
        if not base:
            raise UsageError(f"cloudflare:// needs the Bridge URL: --cloudflare-url or ${URL_ENV}")
        return cls(
            _sandbox_id(uri),
            token=resolve_token(options),
            base_url=str(base),
            workspace=uri.path,
            cwd=options.get("dir"),
        )

    @property
    def description(self) -> str:
        return f"cloudflare://{self.sandbox_id}"

    def __repr__(self) -> str:
        return f"CloudflareTransport({self.description}, base_url={self.base_url!r})"

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                headers={
                    "Authorization": f"Bearer {self._token}",
                    "User-Agent": "wsync",
                    **httpbody.IDENTITY,
                },
                timeout=httpx.Timeout(None, connect=self.connect_timeout),
                limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
                follow_redirects=False,
                trust_env=False,
            )
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    # ------------------------------------------------------------------ errors

    def _status_error(self, response: httpx.Response, body: bytes, what: str) -> NoReturn:
        """Map a non-200 answer (``{"error","code"}``) to wsync's errors."""
        status = response.status_code
        detail = ""
        try:
            parsed = json.loads(body)
            if isinstance(parsed, dict):
                error, code = printable(str(parsed.get("error", "")), 200), parsed.get("code")
                detail = f": {error} ({printable(str(code), 40)})"
        except (ValueError, RecursionError):
            pass
        cwd = self.cwd or "/workspace"
        if status == 403 and what == "exec" and not (cwd + "/").startswith("/workspace/"):
            # the Bridge's own refusal of a working directory (its auth failure is 401)
            raise UsageError(
                f"{self.description}: the Bridge runs commands only under /workspace, and the "
                f"working directory (option dir) is {cwd!r} (HTTP 403{detail})"
            )
        if status == 401 or (status == 403 and what == "exec"):
            raise AuthFailed(
                f"{self.description}: authentication failed (HTTP {status}{detail}); "
                f"check {TOKEN_ENV}"
            )
        if status == 404 and what == "exec":
            raise SandboxUnreachable(f"cloudflare sandbox {self.sandbox_id} not found{detail}")
        if status == 400 and what == "exec":
            raise UsageError(f"{self.description}: the Bridge refused the request{detail}")
        raise TransportError(f"{self.description}: {what} failed (HTTP {status}{detail})")

    def _connect_error(self, err: httpx.HTTPError) -> NoReturn:
        message = f"{self.description}: cannot reach {self.base_url}: {type(err).__name__}"
        if isinstance(err, httpx.ConnectError) and not self._connected_once:
            raise SandboxUnreachable(message)
        raise TransportError(message)

    # -------------------------------------------------------------------- exec

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        if stdin is not None:
            raise UsageError(f"{self.description}: the Bridge exec has no stdin")
        if max_output < 0:
            raise UsageError("max_output must be >= 0")
        body = exec_body(
            argv, timeout_ms=int((timeout + SERVER_TIMEOUT_MARGIN) * 1000), cwd=self.cwd
        )
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + timeout):
                return await self._exec(body, max_output)
        except TimeoutError:
            raise TransportTimeout(timeout) from None

    async def _exec(self, body: bytes, max_output: int) -> ExecResult:
        client = self._http()
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        for attempt in range(RETRIES_503 + 1):
            try:
                async with client.stream(
                    "POST", exec_path(self.sandbox_id), content=body, headers=headers
                ) as response:
                    self._connected_once = True
                    if response.status_code == 503 and attempt < RETRIES_503:
                        await httpbody.head(response)
                        log.debug("cloudflare %s: 503 before the stream", self.sandbox_id)
                    elif response.status_code != 200:
                        self._status_error(response, await httpbody.head(response), "exec")
                    elif not response.headers.get("content-type", "").startswith(
                        "text/event-stream"
                    ):
                        # e.g. an Access login page in front of the worker: not a Bridge
                        kind = response.headers.get("content-type", "no content type")[:60]
                        raise SandboxUnreachable(
                            f"{self.description}: {self.base_url} answered {kind}, "
                            "not an event stream (is this the Bridge URL?)"
                        )
                    else:
                        return await self._collect(response, max_output)
            except httpx.HTTPError as err:
                self._connect_error(err)
            # the command never started: waiting and asking again is safe
            await asyncio.sleep(self.retry_delay * 2**attempt)
        raise AssertionError("unreachable")

    async def _collect(self, response: httpx.Response, max_output: int) -> ExecResult:
        parser = SSEParser()
        collector = ExecCollector(max_output)
        chunks = httpbody.raw_body(response, f"{self.description}: exec").__aiter__()
        loop = asyncio.get_running_loop()
        drain_until: float | None = None
        while True:
            if collector.exited and drain_until is None:
                # the Bridge closes after ``exit``; do not wait long for a server that lingers
                drain_until = loop.time() + self.drain_timeout
            try:
                if drain_until is None:
                    chunk = await anext(chunks)
                else:
                    async with asyncio.timeout_at(drain_until):
                        chunk = await anext(chunks)
            except StopAsyncIteration:
                collector.ended(mid_event=parser.pending)
                break
            except TimeoutError:
                collector.note("stream still open after exit event")
                break
            except httpx.HTTPError as err:
                raise TransportError(
                    f"{self.description}: stream broken ({type(err).__name__}) "
                    f"{'after' if collector.exited else 'before'} the exit event"
                ) from None
            try:
                for event in parser.feed_runs(chunk):
                    collector.feed(event)
            except ProtocolError as err:
                raise TransportError(f"{self.description}: {err}") from None
        result = collector.result()
        if result.notes:
            log.debug("cloudflare %s exec notes: %s", self.sandbox_id, "; ".join(result.notes))
        return result

    # --------------------------------------------------------------- file API

    async def read_file(self, path: str, offset: int, length: int, *, timeout: float) -> bytes:
        """Bytes ``[offset, offset+length)`` of ``path`` via ``GET .../file/...``.

        The Bridge serves whole files (no ranges) under ``/workspace`` only; a
        refusal (403), a missing file, a 5xx, or a body shorter than its
        ``Content-Length`` is a :class:`TransportError`, so the engine falls back to
        exec reads.  A body without a length that ends early comes back short; the
        caller's length and hash checks catch it.
        """
        if offset < 0 or length < 0:
            raise UsageError("offset and length must be >= 0")
        if offset + length > self.full_read_limit:
            raise TransportError(
                f"{self.description}: the file API serves whole files; reads past "
                f"{self.full_read_limit} bytes go through exec"
            )
        target = file_path(self.sandbox_id, path)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + timeout):
                return await self._read(target, path, offset, length)
        except TimeoutError:
            raise TransportTimeout(timeout) from None

    async def _read(self, target: str, path: str, offset: int, length: int) -> bytes:
        client = self._http()
        out = bytearray()
        try:
            async with client.stream("GET", target) as response:
                self._connected_once = True
                if response.status_code != 200:
                    self._status_error(response, await httpbody.head(response), f"read of {path}")
                skip = offset
                body = httpbody.raw_body(response, f"{self.description}: read of {path}")
                async for chunk in body:
                    if skip:
                        cut = min(skip, len(chunk))
                        chunk, skip = chunk[cut:], skip - cut
                    out += chunk[: length - len(out)]
                    if len(out) >= length:
                        break  # closing the response drops the rest
        except httpx.HTTPError as err:
            if isinstance(err, httpx.ConnectError):
                self._connect_error(err)
            raise TransportError(
                f"{self.description}: read of {path} broken ({type(err).__name__}) "
                f"after {len(out)} bytes"
            ) from None
        return bytes(out)
