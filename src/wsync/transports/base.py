"""The one small interface every sandbox backend implements.

A transport runs **one command** in the guest, with optional stdin, under a
deadline, and reports what it saw.  It knows nothing of chunks, hashes or
envelopes, and it never interprets the output: "exit 0" is reported as what
the backend claimed, not as evidence of anything.

Honesty rules every implementation follows (the shared conformance suite in
``tests/test_transport_conformance.py`` checks them):

* ``exit_status`` is ``None`` when the backend gave no exit status (socket
  closed without an exit frame, SSE stream severed).  Never guess 0.
* Output beyond ``max_output`` bytes is dropped and ``truncated`` is set.
  A bounded read that loses its truncation flag lies (field report 3).
* A dropped connection, reset or protocol error is raised as
  :class:`~wsync.errors.TransportError`; a deadline as
  :class:`~wsync.errors.TransportTimeout`; a failure to connect or
  authenticate at all as :class:`~wsync.errors.SandboxUnreachable`.
  No foreign exception escapes ``exec``.
* ``stdin`` bytes are delivered after the command is attached and then stdin
  is closed.  wsync's read scripts wait for that first byte before printing
  anything, which defeats backends that drop output produced before attach.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import os
import shlex
import urllib.parse
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from wsync.errors import TransportError, TransportTimeout, UsageError
from wsync.protocol.records import printable

DEFAULT_MAX_OUTPUT = 64 * 1024 * 1024
#: a per-exec kill marker in the guest is ``KILL_MARK + token``.  Where a kill can land
#: before the command it is for has started (the backend took the request, the process
#: comes later), the killer creates this directory before it looks for the command, and
#: the command's wrapper checks for it before it runs anything: whichever comes second
#: sees the other.  An empty directory, removed by whoever knows it is no longer needed,
#: else by a later kill once it is :data:`KILL_MARK_TTL` minutes old
KILL_MARK = "/tmp/wsync-kill-"


def refuse_if_killed(marker: str) -> str:
    """A guest shell statement for a command's wrapper: when the kill marker ``marker``
    (a shell word naming ``KILL_MARK + token``) is there, remove it and exit 137 without
    running anything.

    /tmp is shared and other guest users are hostile: only a real directory (not a
    symlink) owned by this user counts, so no one else can stop a command this way.  The
    token is secret until the command runs, so no one else can make the marker early.
    """
    return (
        f"if [ -d {marker} ] && [ ! -h {marker} ] && [ -O {marker} ]; then "
        f"rmdir {marker} 2>/dev/null; exit 137; fi; "
    )


#: minutes after which a kill marker is stale: no backend starts a command that late
KILL_MARK_TTL = 60


def sweep_stale_kill_marks() -> str:
    """A guest shell snippet for a killer: remove this user's kill markers older than
    :data:`KILL_MARK_TTL` minutes.

    A kill whose command had already ended, or never reached the guest, cannot tell
    that it needs no marker, and leaves one; the next kill (they are rare) takes it
    away.  Only a real directory owned by this user is touched, and ``rmdir`` removes
    nothing that is not empty.  Needs globbing on (``set +f``)."""
    return (
        f"for x in {shlex.quote(KILL_MARK)}*; do\n"
        '  [ -d "$x" ] && [ ! -h "$x" ] && [ -O "$x" ] || continue\n'
        f'  [ -n "$(find "$x" -maxdepth 0 -mmin +{KILL_MARK_TTL} 2>/dev/null)" ] || continue\n'
        '  rmdir "$x" 2>/dev/null\n'
        "done\n"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ExecResult:
    """What one exec returned, exactly as seen on the wire."""

    stdout: bytes
    stderr: bytes = b""
    exit_status: int | None = None
    truncated: bool = False
    #: free-form observations ("data after exit frame", "stderr merged") for logs
    notes: tuple[str, ...] = ()


class BoundedBuffer:
    """Keeps the first ``limit`` bytes and drops the rest, remembering that it did.

    The ``max_output`` rule above, for transports that collect output as it arrives (local,
    ssh): memory stays bounded however much the guest prints, and ``truncated`` records that
    something was dropped so the result cannot pass for complete.
    """

    __slots__ = ("_chunks", "_kept", "limit", "truncated")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._chunks: list[bytes] = []
        self._kept = 0
        self.truncated = False

    def feed(self, data: bytes) -> None:
        room = self.limit - self._kept
        if len(data) > room:
            self.truncated = True
            data = data[: max(room, 0)]
        if data:
            self._chunks.append(data)
            self._kept += len(data)

    def getvalue(self) -> bytes:
        return b"".join(self._chunks)


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What the backend can do; the engine adapts its scripts to it."""

    #: stdin reaches the command (enables the stdin gate)
    stdin: bool = True
    #: stdout carries arbitrary bytes (False: line-oriented text that may be decoded
    #: lossily, gain newlines or lose long-line fragments: payloads go as base64 in
    #: short lines)
    binary_safe: bool = True
    #: stdout and stderr arrive on separate channels
    separate_stderr: bool = True
    #: :meth:`Transport.read_file` reads guest files through a file API (a fast path for
    #: staged chunks; every result is verified by the chunk hash, exec reads are the
    #: fallback)
    file_read: bool = False
    #: :meth:`Transport.open_channel` keeps one command running with a live stdin and
    #: stdout (the guest helper's pipe: many calls for one exec)
    channel: bool = False
    #: an exec's argv may run to tens of KiB: it travels in a request body or an SSH
    #: channel request.  False where it goes in a URL's query (Sprites, Kubernetes),
    #: which servers and proxies cap near 8 KiB: an admission that also answers the first
    #: status goes there only while its URL stays under ``scripts.URL_ARGV_MAX``, and a
    #: list is uploaded in small parts
    long_argv: bool = False


class Channel(abc.ABC):
    """One long-running guest command with a live stdin and stdout, from
    :meth:`Transport.open_channel`.

    Bytes only, no meaning: what arrives is judged by the caller (envelopes, as for an
    exec).  stderr is dropped.  The same honesty rules as for ``exec`` apply: failures are
    :class:`~wsync.errors.TransportError`, a deadline :class:`~wsync.errors.TransportTimeout`,
    and nothing foreign escapes.
    """

    @abc.abstractmethod
    async def send(self, data: bytes) -> None:
        """Queue ``data`` for the command's stdin."""

    @abc.abstractmethod
    async def receive(self, timeout: float) -> bytes:
        """The stdout bytes that arrived since the last call, waiting up to ``timeout``
        seconds for some; ``b""`` once the command's stdout has ended."""

    @property
    def ended(self) -> bool:
        """The command's stdout has ended (a lost connection, the command exited): the
        channel carries nothing more."""
        return False

    @abc.abstractmethod
    async def aclose(self, *, abort: bool = False) -> None:
        """End stdin and let go: the command ends by itself once stdin ends (or is stopped
        if it does not, soon).  ``abort`` stops it now, with whatever it was running (a
        call that timed out).  Idempotent, bounded."""


#: most stdout bytes a channel buffers before it stops reading from the guest (a guest
#: that floods a channel between requests costs bounded memory)
CHANNEL_BUFFER = 8 * 1024 * 1024


class ChannelInbox:
    """What a channel's callbacks deliver, waiting for :meth:`Channel.receive`.

    Callbacks :meth:`feed` stdout pieces and :meth:`end` the stream (with a reason when
    it broke); :meth:`take` hands them out.  Past :data:`CHANNEL_BUFFER` unread bytes
    it calls ``pause`` (stop reading the socket or pipe) until the next take ``resume``s.
    """

    def __init__(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._pieces: list[bytes] = []
        self._size = 0
        self._ready = asyncio.Event()
        self._pause, self._resume = pause, resume
        self._paused = False
        self.ended = False
        self.error: str | None = None

    def feed(self, data: bytes) -> None:
        if not data:
            return  # (an empty take means the stream ended)
        self._pieces.append(data)
        self._size += len(data)
        self._ready.set()
        if self._size > CHANNEL_BUFFER and not self._paused:
            self._paused = True
            self._pause()

    def end(self, error: str | None = None) -> None:
        self.ended = True
        self.error = self.error or error
        self._ready.set()

    async def take(self, timeout: float, what: str) -> bytes:
        if not self._pieces and not self.ended:
            self._ready.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._ready.wait()
            except TimeoutError:
                raise TransportTimeout(timeout) from None
        if self._pieces:
            data = b"".join(self._pieces)
            self._pieces, self._size = [], 0
            if self._paused:
                self._paused = False
                self._resume()
            return data
        if self.error is not None:
            raise TransportError(f"{what}: {self.error}")
        return b""


class PumpedChannel(Channel):
    """A channel whose stdout a reading task of its own (the subclass's, started with
    :meth:`_start_reading`) hands to a :class:`ChannelInbox`, waiting on :attr:`_flowing`
    while the inbox is full: the WebSocket and hijacked-socket channels (docker, k8s,
    sprites), which have no protocol object to pause as ssh's and local's do."""

    def __init__(self, description: str) -> None:
        self._description = description
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._inbox = ChannelInbox(self._flowing.clear, self._flowing.set)
        self._open = True
        self._pump: asyncio.Task[None] | None = None

    def _start_reading(self, reading: Coroutine[Any, Any, None]) -> None:
        self._pump = asyncio.get_running_loop().create_task(reading)

    async def _stop_reading(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            # (wait, not await: a cancel of this task must not be taken for the pump's)
            await asyncio.wait([self._pump])

    async def receive(self, timeout: float) -> bytes:
        return await self._inbox.take(timeout, self._description)

    @property
    def ended(self) -> bool:
        return self._inbox.ended or not self._open


def find_secret(
    options: Mapping[str, Any], option: str, file_option: str, env: Sequence[str], what: str
) -> str | None:
    """A credential: ``options[option]``, then the file ``options[file_option]`` names,
    then the first environment variable of ``env`` that is set; None if none is.

    Explicit options beat the environment.  The value goes into an HTTP header, so only
    visible ASCII is taken (:func:`header_safe`); anything else is refused, never echoed.
    """
    token = options.get(option)
    if not token and options.get(file_option):
        path = Path(str(options[file_option])).expanduser()
        try:
            token = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"cannot read the {what} file {path}: {err}") from None
    for var in env:
        token = token or os.environ.get(var, "").strip()
    if not token:
        return None
    return header_safe(str(token), what)


def header_safe(value: str, what: str) -> str:
    """``value`` if it is visible ASCII only (what a bearer token or an id in a header may
    hold), else a :class:`UsageError` that does not echo it.  (A form feed or vertical tab
    passed an older check, and h11's refusal of the header, which quotes it whole, reached
    every retry's log line.)"""
    if not value or any(not "!" <= c <= "~" for c in value):
        raise UsageError(f"the {what} contains a space, control character or non-ASCII text")
    return value


def float_options(
    options: Mapping[str, Any], keys: Sequence[str], prefix: str = ""
) -> dict[str, Any]:
    """The tuning options among ``keys`` that are set (looked up as ``prefix + key``), as
    floats keyed without the prefix, ready for a transport's constructor."""
    return {k: float(options[prefix + k]) for k in keys if options.get(prefix + k) is not None}


def dns_spellable(host: str) -> bool:
    """Whether a resolver can spell ``host``: it encodes it in IDNA first, whose
    UnicodeError (an empty or over-long label, ``a..b``) would otherwise come out of every
    exec as an internal error, where the user's URL or option is to blame."""
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


def check_base_url(url: str, what: str) -> str:
    """A backend's base URL, refused when it carries credentials (``user:pass@``): they
    would show in every message and job record; tokens go in their own option."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise UsageError(f"the {what} URL carries credentials: give the token separately")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"the {what} URL must be http(s)://HOST[:PORT][/PATH]")
    return url


def error_message(body: bytes, limit: int = 200) -> str:
    """``message`` of a JSON error body (Docker's ``ErrorResponse``, Connect's and envd's
    errors), at most ``limit`` characters, else a bounded head of the body; printable
    either way (envd runs in the sandbox: its words may carry terminal escapes)."""
    try:
        obj = json.loads(body)
        if isinstance(obj, dict) and isinstance(obj.get("message"), str):
            return printable(str(obj["message"]).strip(), limit)
    except (ValueError, RecursionError):
        pass
    return printable(body[:limit].decode("utf-8", "replace").strip(), limit)


class Transport(abc.ABC):
    """An exec channel into one sandbox.  Safe to call ``exec`` concurrently."""

    scheme: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities()

    @abc.abstractmethod
    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        """Run ``argv`` in the guest and return what was seen.

        ``argv[0]`` is looked up on the guest's PATH.  Backends that take a
        command string instead of an argv join it with :func:`shlex.join`.
        """

    async def read_file(self, path: str, offset: int, length: int, *, timeout: float) -> bytes:
        """Up to ``length`` bytes of the guest file ``path`` from ``offset``, raw.

        Only for transports whose capabilities say ``file_read``.  The result is not
        trusted: it may be short or wrong, and the caller checks it against the chunk's
        hash.  Raises :class:`~wsync.errors.TransportError` when the backend fails or
        refuses the read (a path outside what its file API serves), and nothing foreign.
        """
        raise NotImplementedError(f"{self.scheme}: no file API")

    async def open_channel(self, argv: Sequence[str], *, timeout: float) -> Channel:
        """Start ``argv`` in the guest with a live stdin and stdout (see :class:`Channel`).

        Only for transports whose capabilities say ``channel``.
        """
        raise NotImplementedError(f"{self.scheme}: no channels")

    @property
    def channel_limit(self) -> int:
        """How many channels may be open at once while execs still get through."""
        return 64

    async def aclose(self) -> None:
        """Release connections.  Idempotent."""

    @property
    def description(self) -> str:
        """A human-readable name without secrets, for logs and errors."""
        return self.scheme

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
