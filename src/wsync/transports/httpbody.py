"""Response bodies of the HTTP backends (Cloudflare, Daytona, E2B), read as sent.

httpx undoes whatever ``Content-Encoding`` a server names (gzip, deflate, br, zstd, or
several stacked) as the bytes arrive, a whole network read at a time, before a caller's
bound sees a byte.  A zstd frame of run-length blocks decodes to some 30,000 times its
size, so 16 KiB from a hostile toolbox (Daytona's runs inside the sandbox) or a broken
proxy became a gigabyte in one call: a 4 KiB read killed the pull, or a daemon and every
pull in it, for want of memory.  wsync never asks for an encoding (``Accept-Encoding:
identity`` on every request: :data:`IDENTITY`) and reads bodies raw; a body that names
an encoding anyway is refused before a byte of it is read.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx

from wsync.errors import TransportError

#: the header every client of these backends sends: no content encoding, ever
IDENTITY = {"Accept-Encoding": "identity"}
#: the most of an error answer's body read (for its message)
ERROR_BODY = 4096


def coding(response: httpx.Response) -> str:
    """The content encoding ``response`` names, lowercased ("" for none or identity)."""
    named = response.headers.get("content-encoding", "").strip().lower()
    return "" if named == "identity" else named


def refuse_encoded(response: httpx.Response, what: str) -> None:
    """A :class:`TransportError` for a body that names a content encoding."""
    named = coding(response)
    if named:
        raise TransportError(
            f"{what}: the server sent a body encoded as {named[:40]!r}, which wsync did not "
            "ask for (it reads only identity bodies)"
        )


def raw_body(response: httpx.Response, what: str) -> AsyncIterator[bytes]:
    """The body of ``response`` as it came off the wire (transfer decoding only), after
    :func:`refuse_encoded`."""
    refuse_encoded(response, what)
    return response.aiter_raw()


async def head(response: httpx.Response, limit: int = ERROR_BODY) -> bytes:
    """At most ``limit`` bytes of an error body (a hostile server's 800 MiB 500 page must
    not be read into memory); nothing of one that names a content encoding, and what
    came before a connection lost within it: the status still says what failed."""
    if coding(response):
        return b""
    out = bytearray()
    with contextlib.suppress(httpx.HTTPError):
        async for chunk in response.aiter_raw():
            out += chunk[: limit - len(out)]
            if len(out) >= limit:
                break
    return bytes(out)
