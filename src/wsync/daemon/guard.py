"""The door of the HTTP API: the token and a body cap, checked before any body is read.

Why a pure ASGI middleware rather than the routes' ``Depends(auth)``: FastAPI
reads the whole request body and parses it *before* it resolves a route's
dependencies, so with the token checked only there, one unauthenticated
300 MiB ``POST`` took the daemon to almost 1 GB (the sidecar's limit is
512 MiB).  Here a ``/v1`` request without the right token is answered 401
from its headers alone, and an authenticated one may send at most
:data:`MAX_BODY` bytes (the largest valid body, two 4096-character fields, is
far below it): a larger ``Content-Length`` is refused at once, and a chunked
body is counted as it arrives and refused as soon as it passes the cap, so
the daemon never holds more than that of anyone's body.  Both answers have
the API's error shape, ``{"error", "kind"}``.  The routes keep their own token
check too (and the OpenAPI document keeps describing it).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

#: largest request body accepted on ``/v1`` (bytes)
MAX_BODY = 64 * 1024

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def token_ok(authorization: str | None, token: str) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), token.encode()
    )


async def send_error(send: Send, status: int, message: str, kind: str, **headers: str) -> None:
    """One JSON error answer in the API's shape, written straight to the ASGI ``send``."""
    # the same bytes as the routes' JSONResponse (compact separators)
    body = json.dumps({"error": message, "kind": kind}, separators=(",", ":")).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Guard:
    """ASGI middleware: token and body cap on ``/v1``; other paths pass untouched."""

    def __init__(self, app: ASGIApp, token: Callable[[], str], max_body: int = MAX_BODY) -> None:
        self.app = app
        #: read per request: a reload changes the token
        self.token = token
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or not (path == "/v1" or path.startswith("/v1/")):
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {k.lower(): v for k, v in scope.get("headers", [])}
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        if not token_ok(authorization, self.token()):
            await send_error(
                send, 401, "missing or wrong bearer token", "auth", **{"WWW-Authenticate": "Bearer"}
            )
            return
        length = headers.get(b"content-length", b"").strip()
        if length.isdigit() and int(length) > self.max_body:
            await self._too_large(send)
            return
        body = bytearray()
        while True:  # at most max_body bytes are ever held
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.max_body:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _too_large(self, send: Send) -> None:
        await send_error(
            send, 413, f"request body over {self.max_body} bytes; refused", "too-large"
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then the real one (for
    ``http.disconnect``, which event streams wait on)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay
