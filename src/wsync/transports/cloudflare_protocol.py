"""The Cloudflare Sandbox Bridge wire format, sans-I/O: SSE events, paths, one exec's result.

Both ends use this module: the client (:mod:`wsync.transports.cloudflare`) and the
emulator (:mod:`wsync.emulators.cloudflare`), so the emulator cannot speak a dialect
the client happens to accept, and the codec can be fuzzed without sockets.

The Bridge worker (``packages/sandbox/src/bridge/routes.ts`` in cloudflare/sandbox-sdk):

* ``POST {base}/v1/sandbox/{id}/exec`` with ``{"argv": [...], "timeout_ms": N,
  "cwd": "/workspace..."}`` answers ``text/event-stream`` with *named* events::

      event: stdout\\ndata: <base64>\\n\\n
      event: stderr\\ndata: <base64>\\n\\n
      event: exit\\ndata: {"exit_code":0}\\n\\n
      event: error\\ndata: {"error":"...","code":"exec_error"}\\n\\n

  The base64 encodes the UTF-8 of an already *decoded* string: invalid bytes are
  U+FFFD before they reach us, so this channel is text, not bytes.
* ``GET {base}/v1/sandbox/{id}/file/<abs-path-without-leading-slash>``: raw bytes,
  403 outside ``/workspace``.

:class:`SSEParser` follows the WHATWG event-stream rules (``\\r\\n``, ``\\r`` or ``\\n``
line ends, ``field:value`` with an optional space, comments, multi-line ``data``)
and bounds memory.  :class:`ExecCollector` turns one exec's events into an honest
:class:`~wsync.transports.base.ExecResult`: no ``exit`` event means
``exit_status=None``, never 0.  Bad input raises :class:`ProtocolError` and nothing else.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import operator
import re
import urllib.parse
from collections.abc import Sequence
from typing import Any

from wsync.errors import ProtocolError, UsageError
from wsync.protocol.records import printable
from wsync.transports.base import ExecResult

#: one event's fields may not exceed this (a server streaming one endless line is hostile)
MAX_EVENT = 32 * 1024 * 1024
#: the Bridge's ``Session-Id`` header syntax
SESSION_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
#: the one event shape the Bridge writes, matched whole in C: session-mode output is one
#: event per 76-column line (75,000 events for a 4 MiB read), too many to parse line by line
_BRIDGE_EVENT = re.compile(rb"event: ([a-z]{1,16})\ndata: ([A-Za-z0-9+/]+={0,2})\n\n")
_BRIDGE_RUN = re.compile(rb"(?:event: [a-z]{1,16}\ndata: [A-Za-z0-9+/]+={0,2}\n\n)+")
OUTPUT_NAMES = ("stdout", "stderr")
#: what :func:`base64.b64decode` checks with ``validate=True``, without its per-call overhead
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
EXEC_PATH = "/v1/sandbox/{id}/exec"
FILE_PREFIX = "/v1/sandbox/{id}/file/"


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """One dispatched SSE event: its name (``message`` when none was given) and data."""

    name: str
    data: str


@dataclasses.dataclass(frozen=True, slots=True)
class OutputRun:
    """Consecutive ``stdout`` (or ``stderr``) events, each in the Bridge's exact shape:
    their data fields, each already checked against the base64 alphabet.

    What :meth:`SSEParser.feed_runs` gives for session-mode output (one event per line)
    so that thousands of events are decoded in one call instead of one call each.
    """

    name: str
    pieces: list[bytes]


class SSEParser:
    """Incremental ``text/event-stream`` parser: feed bytes, get whole events."""

    def __init__(self, max_event: int = MAX_EVENT) -> None:
        self.max_event = max_event
        self._buf = bytearray()
        self._name = ""
        self._data: list[str] = []
        self._size = 0

    @property
    def pending(self) -> bool:
        """Bytes or fields of an undispatched event are held (the stream stopped mid-event)."""
        return bool(self._buf) or bool(self._data) or bool(self._name)

    def feed(self, chunk: bytes) -> list[Event]:
        events: list[Event] = []
        for item in self._parse(chunk, runs=False):
            assert isinstance(item, Event)
            events.append(item)
        return events

    def feed_runs(self, chunk: bytes) -> list[Event | OutputRun]:
        """As :meth:`feed`, but consecutive Bridge-shaped output events of one name come as
        one :class:`OutputRun` (the same bytes, in the same order, far fewer objects)."""
        return self._parse(chunk, runs=True)

    def _parse(self, chunk: bytes, *, runs: bool) -> list[Event | OutputRun]:
        held_cr = self._buf.endswith(b"\r")
        self._buf += chunk
        if not held_cr and b"\n" not in chunk and b"\r" not in chunk:
            # still inside one line: no copy of the growing buffer (no quadratic time)
            if len(self._buf) > self.max_event:
                raise ProtocolError(f"SSE line longer than {self.max_event} bytes", "oversized")
            return []
        data = bytes(self._buf)
        tail = b""
        if b"\r" in data:
            if data.endswith(b"\r"):  # may be the first half of a CRLF: decide next time
                data, tail = data[:-1], b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        end = data.rfind(b"\n") + 1  # the complete lines end here; the rest waits
        if len(data) - end > self.max_event:
            raise ProtocolError(f"SSE line longer than {self.max_event} bytes", "oversized")
        self._buf = bytearray(data[end:] + tail)
        events: list[Event | OutputRun] = []
        pos = 0
        while pos < end:
            if not self._data and not self._name:
                # whole events in the Bridge's own shape: what the line rules would give
                match = _BRIDGE_RUN.match(data, pos, end)
                found = _BRIDGE_EVENT.findall(data, pos, match.end()) if match else []
                if match and all(len(value) <= self.max_event for _, value in found):
                    self._add(events, found, runs)
                    pos = match.end()
                    continue
            cut = data.index(b"\n", pos)
            event = self._line(data[pos:cut])
            pos = cut + 1
            if event is not None:
                events.append(event)
        return events

    @staticmethod
    def _add(events: list[Event | OutputRun], found: list[tuple[bytes, bytes]], runs: bool) -> None:
        for raw_name, group in itertools.groupby(found, key=operator.itemgetter(0)):
            name = raw_name.decode("ascii")
            if runs and name in OUTPUT_NAMES:
                events.append(OutputRun(name, [value for _, value in group]))
            else:
                events.extend(Event(name, value.decode("ascii")) for _, value in group)

    def _line(self, raw: bytes) -> Event | None:
        if not raw:
            data = "\n".join(self._data)
            name = self._name or "message"
            self._name, self._data, self._size = "", [], 0
            # the spec dispatches nothing for an empty data buffer
            return Event(name, data) if data else None
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("SSE line is not UTF-8", "malformed") from None
        if line.startswith(":"):
            return None  # comment / heartbeat
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "event":
            self._name = value
        elif field == "data":
            self._size += len(raw)
            if self._size > self.max_event:
                raise ProtocolError(f"SSE event larger than {self.max_event} bytes", "oversized")
            self._data.append(value)
        # id, retry and unknown fields are ignored, as the spec says
        return None


def encode_event(name: str, data: str) -> bytes:
    """One SSE event as the Bridge writes it (single-line data)."""
    if "\n" in data or "\r" in data or "\n" in name or "\r" in name:
        raise ValueError("SSE field values are single lines here")
    return f"event: {name}\ndata: {data}\n\n".encode()


def encode_output(name: str, text: str) -> bytes:
    """A ``stdout``/``stderr`` event: base64 of the UTF-8 of already decoded text."""
    payload = base64.b64encode(text.encode("utf-8", "surrogatepass")).decode("ascii")
    return encode_event(name, payload)


def encode_outputs(name: str, texts: Sequence[str]) -> bytes:
    """Many ``stdout``/``stderr`` events at once, byte for byte what :func:`encode_output`
    writes for each (the emulator's session mode sends one event per line)."""
    head = encode_event(name, "")[: -len(b"\n\n")]
    b2a = binascii.b2a_base64
    return b"".join(
        [head + b2a(t.encode("utf-8", "surrogatepass"), newline=False) + b"\n\n" for t in texts]
    )


def encode_exit(code: int | None) -> bytes:
    """``exit``; the Bridge writes ``exitCode ?? 0``, so ``None`` is sent as 0."""
    body = {"exit_code": 0 if code is None else code}
    return encode_event("exit", json.dumps(body, separators=(",", ":")))


def encode_error(message: str, code: str = "exec_error") -> bytes:
    return encode_event(
        "error", json.dumps({"error": message, "code": code}, separators=(",", ":"))
    )


def exec_body(argv: Sequence[str], *, timeout_ms: int, cwd: str | None = None) -> bytes:
    if not argv:
        raise UsageError("empty argv")
    body: dict[str, Any] = {"argv": list(argv), "timeout_ms": timeout_ms}
    if cwd is not None:
        body["cwd"] = cwd
    return json.dumps(body).encode()


@dataclasses.dataclass(frozen=True, slots=True)
class ExecRequest:
    argv: list[str]
    timeout_ms: int | None
    cwd: str | None


def parse_exec_body(raw: bytes) -> ExecRequest:
    """The emulator's side of :func:`exec_body`; anything off is a ProtocolError (HTTP 400)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("invalid JSON body") from None
    if not isinstance(body, dict):
        raise ProtocolError("body must be a JSON object")
    argv = body.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ProtocolError("argv must be a non-empty array of strings")
    timeout = body.get("timeout_ms")
    if timeout is not None and (not isinstance(timeout, int) or timeout <= 0):
        raise ProtocolError("timeout_ms must be a positive integer")
    cwd = body.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ProtocolError("cwd must be a string")
    return ExecRequest(argv, timeout, cwd)


def check_sandbox_id(sandbox_id: str) -> str:
    if (
        not sandbox_id
        or len(sandbox_id) > 255
        or not sandbox_id.isprintable()
        or "/" in sandbox_id
        or sandbox_id in (".", "..")
    ):
        raise UsageError(f"bad Cloudflare sandbox id {sandbox_id!r}")
    return sandbox_id


def exec_path(sandbox_id: str) -> str:
    return EXEC_PATH.format(id=urllib.parse.quote(check_sandbox_id(sandbox_id), safe=""))


def file_path(sandbox_id: str, path: str) -> str:
    if not path.startswith("/"):
        raise UsageError(f"file API paths are absolute: {path!r}")
    if any(part in ("", ".", "..") for part in path[1:].split("/")):
        # the URL's path would be resolved, and the token sent to another route
        raise UsageError(f"file API paths have no empty, '.' or '..' parts: {path!r}")
    prefix = FILE_PREFIX.format(id=urllib.parse.quote(check_sandbox_id(sandbox_id), safe=""))
    return prefix + urllib.parse.quote(path.lstrip("/"), safe="/")


def split_route(path: str) -> tuple[str, str, str] | None:
    """``(sandbox_id, "exec"|"file", rest)`` for a request path, or None (unknown route).

    ``path`` is the still-quoted request path; ``rest`` is the unquoted file path.
    """
    parts = path.split("/", 5)
    if len(parts) < 5 or parts[:3] != ["", "v1", "sandbox"]:
        return None
    try:
        sandbox_id = urllib.parse.unquote(parts[3], errors="strict")
        if parts[4] == "exec" and len(parts) == 5:
            return sandbox_id, "exec", ""
        if parts[4] == "file" and len(parts) == 6:
            return sandbox_id, "file", "/" + urllib.parse.unquote(parts[5], errors="strict")
    except UnicodeDecodeError:
        return None
    return None


class ExecFailed(ProtocolError):
    """The Bridge sent an ``error`` event: the exec failed on its side (retryable)."""

    template = "{}"

    def __init__(self, message: str, code: str) -> None:
        super().__init__(f"bridge error event ({code}): {message}", "error-event")
        self.code = code


class ExecCollector:
    """One exec's events into an :class:`ExecResult`, honestly.

    Each of stdout and stderr keeps at most ``max_output`` bytes; the rest is
    dropped and ``truncated`` set.  Output after the ``exit`` event is kept and
    noted; an ``error`` event raises :class:`ExecFailed`.
    """

    def __init__(self, max_output: int) -> None:
        if max_output < 0:
            raise ValueError("max_output must be >= 0")
        self.max_output = max_output
        self._out = {"stdout": bytearray(), "stderr": bytearray()}
        self.exit_status: int | None = None
        self.truncated = False
        self._notes: list[str] = []

    @property
    def exited(self) -> bool:
        return self.exit_status is not None

    def note(self, text: str) -> None:
        if text not in self._notes:
            self._notes.append(text)

    def feed(self, event: Event | OutputRun) -> None:
        if isinstance(event, OutputRun):
            try:  # each piece passed the alphabet check in the parser
                self._output(event.name, b"".join(map(binascii.a2b_base64, event.pieces)))
            except binascii.Error:
                raise ProtocolError(f"{event.name} event is not base64", "malformed") from None
        elif event.name in self._out:
            try:
                if not _BASE64.fullmatch(event.data):
                    raise ValueError
                data = binascii.a2b_base64(event.data)
            except (binascii.Error, ValueError):
                raise ProtocolError(f"{event.name} event is not base64", "malformed") from None
            self._output(event.name, data)
        elif event.name == "exit":
            code = _json_object(event)["exit_code"] if event.data else None
            if isinstance(code, bool) or not isinstance(code, int):
                raise ProtocolError(f"exit event without an integer exit_code: {event.data[:80]!r}")
            if self.exit_status is None:
                self.exit_status = code
            elif code != self.exit_status:
                self.note(f"conflicting exit events ({self.exit_status}, then {code})")
        elif event.name == "error":
            try:
                body = _json_object(event)
            except ProtocolError:
                body = {"error": event.data[:200]}
            # the sandbox's words (a command's failure): printable, as every backend's
            raise ExecFailed(
                printable(str(body.get("error", "")), 200),
                printable(str(body.get("code", "?")), 40),
            )
        else:
            self.note(f"unknown event {event.name[:40]!r} ignored")

    def _output(self, name: str, data: bytes) -> None:
        if self.exited and data:
            self.note("data after exit event")
        buf = self._out[name]
        room = self.max_output - len(buf)
        if len(data) > room:
            self.truncated = True
        buf += data[: max(room, 0)]

    def ended(self, *, mid_event: bool) -> None:
        """The body ended cleanly; ``mid_event``: it stopped inside an event."""
        if mid_event:
            self.note("stream ended inside an event")
        if not self.exited:
            self.note("stream ended without exit event")

    def result(self) -> ExecResult:
        return ExecResult(
            stdout=bytes(self._out["stdout"]),
            stderr=bytes(self._out["stderr"]),
            exit_status=self.exit_status,
            truncated=self.truncated,
            notes=tuple(self._notes),
        )


def _json_object(event: Event) -> dict[str, Any]:
    try:
        body = json.loads(event.data)
    except (ValueError, RecursionError):
        raise ProtocolError(f"{event.name} event is not JSON: {event.data[:80]!r}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{event.name} event is not a JSON object")
    if event.name == "exit" and "exit_code" not in body:
        raise ProtocolError("exit event without exit_code")
    return body
