"""Sandbox URIs: ``local:PATH``, ``ssh://[user@]host[:port]/PATH``, ``sprites://NAME/PATH``.

A URI names a sandbox *and* the workspace directory inside it.  Parsing is
strict: an empty path, a NUL, or a string that is not well-formed Unicode is a
:class:`~wsync.errors.UsageError` (malformed ids must not alias each other,
field report 3 finding 5).  The scheme table itself lives in
:mod:`wsync.transports.registry`; this module only splits the string.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from collections.abc import Collection

from wsync.errors import UsageError

#: schemes whose sandbox is named by two segments, ``k8s://NAMESPACE/POD/PATH``: the
#: name is ``NAMESPACE/POD`` and the path is what follows
TWO_SEGMENT_NAMES = frozenset({"k8s"})
#: what names the sandbox in each scheme's ``SCHEME://NAME/PATH`` (``wsync pull --help``)
NAME_HINTS = {
    "ssh": "host",
    "sprites": "NAME",
    "e2b": "SANDBOX_ID",
    "daytona": "SANDBOX_ID",
    "cloudflare": "SANDBOX_ID",
    "docker": "CONTAINER",
    "k8s": "NAMESPACE/POD",
}


def unknown_scheme(scheme: str, known: Collection[str]) -> UsageError:
    return UsageError(
        f"unknown sandbox scheme {scheme!r} (known: {', '.join(f'{s}:' for s in sorted(known))})"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class SandboxURI:
    scheme: str
    #: the workspace directory in the guest (absolute, or ``~/...``)
    path: str
    raw: str
    user: str | None = None
    host: str | None = None
    port: int | None = None
    #: for named-sandbox backends (``sprites://NAME/...``): the sandbox name
    name: str | None = None

    def __str__(self) -> str:
        return self.raw


def check_text(value: str, what: str) -> str:
    """Reject strings that are not well-formed, NUL-free Unicode."""
    try:
        value.encode("utf-8", "strict")
    except UnicodeEncodeError:
        # the bytes as given (b'...\xff'): "replace" showed a "?" the name does not have
        try:
            shown = value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate no byte decoded to
            shown = value.encode("utf-8", "backslashreplace")
        raise UsageError(f"{what} is not valid UTF-8: {shown!r}") from None
    if "\x00" in value:
        raise UsageError(f"{what} contains a NUL byte")
    return value


def parse(raw: str, known: Collection[str] | None = None) -> SandboxURI:
    """Split a sandbox URI.  With ``known`` (the registry's schemes) an unknown scheme is
    the error, before anything else is: ``file:///x`` said "missing host"."""
    check_text(raw, "sandbox URI")
    if not raw.strip():
        raise UsageError("sandbox URI is empty (try local:/path/to/workspace)")
    scheme, sep, rest = raw.partition(":")
    if not sep or not scheme or not scheme.isascii() or not scheme.isalnum():
        raise UsageError(f"not a sandbox URI: {raw!r} (expected SCHEME:..., e.g. local:/path)")
    scheme = scheme.lower()
    if known is not None and scheme not in known:
        raise unknown_scheme(scheme, known)
    if not rest.startswith("//"):
        # opaque form: local:PATH
        if not rest:
            raise UsageError(f"{raw!r}: missing workspace path")
        if scheme == "local":
            # the guest is this machine: pin a relative path to the current
            # directory now, so the journal key and the guest agree on it
            rest = os.path.abspath(os.path.expanduser(rest))
            raw = f"local:{rest}"
        return SandboxURI(scheme=scheme, path=rest, raw=raw)
    try:
        parts = urllib.parse.urlsplit(raw)
    except ValueError as err:  # an unclosed "[" of an IPv6 host, and the like
        raise UsageError(f"{raw!r}: {err}") from None
    if parts.query or parts.fragment:
        raise UsageError(f"{raw!r}: query strings and fragments are not supported")
    try:
        path = urllib.parse.unquote(parts.path, errors="strict")
    except UnicodeDecodeError:
        raise UsageError(f"{raw!r}: the path's %-escapes are not valid UTF-8") from None
    check_text(path, "workspace path")
    if path.startswith("/~"):
        path = path[1:]
    if not path or path == "/":
        hint = NAME_HINTS.get(scheme, "host")
        raise UsageError(
            f"{raw!r}: missing workspace path after the {hint} (e.g. {scheme}://{hint}/work)"
        )
    try:
        port = parts.port
    except ValueError:
        raise UsageError(f"{raw!r}: bad port") from None
    host = parts.hostname
    if not host:
        raise UsageError(f"{raw!r}: missing host or sandbox name")
    user = urllib.parse.unquote(parts.username) if parts.username else None
    name = host
    if scheme in TWO_SEGMENT_NAMES:
        second, sep, rest = path.lstrip("/").partition("/")
        if not second or not sep or not rest.strip("/"):
            raise UsageError(f"{raw!r}: expected {scheme}://NAMESPACE/POD/PATH")
        name = f"{host}/{second}"
        path = rest if rest.startswith("~") else "/" + rest
    return SandboxURI(scheme=scheme, path=path, raw=raw, user=user, host=host, port=port, name=name)
