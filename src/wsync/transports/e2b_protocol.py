"""E2B envd's Connect wire format, sans-I/O: envelopes, process events, one exec's bookkeeping.

Both ends use this module: the client (:mod:`wsync.transports.e2b`) and the emulator
(:mod:`wsync.emulators.e2b`), so the emulator cannot quietly speak a dialect the client
happens to accept, and the codec can be fuzzed without sockets.

Connect streaming (``application/connect+json``), both directions: a sequence of
envelopes ``flags (1 byte) | length (uint32, big-endian) | message``.  Flag ``0x01`` means
compressed (wsync never negotiates compression, so it is refused), flag ``0x02`` marks the
*end-stream* message: the last envelope of a response, JSON, ``{}`` on success or
``{"error": {"code": ..., "message": ...}}``.  Streams are HTTP 200 even when they fail.

``process.Process/Start`` answers ``{"event": {...}}`` messages: ``start{pid}``,
``data{stdout|stderr}`` (standard base64 of at most 32 KiB of raw bytes), ``keepalive{}``
and ``end{exitCode, exited, status, error}``.  proto3 JSON omits zero values, so a clean
exit has no ``exitCode`` key: it means 0, but *only* inside an ``end`` event that arrived.

:class:`StartCollector` turns one response body into an honest
:class:`~wsync.transports.base.ExecResult`: a body that ends without the end-stream
envelope (or mid-envelope) is truncation, ``exit_status=None``, never 0.  Anything
malformed is a :class:`~wsync.errors.ProtocolError` and nothing else (fuzzed).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from wsync.errors import ProtocolError
from wsync.protocol.records import printable
from wsync.transports.base import ExecResult

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
HEADER = struct.Struct(">BI")
#: refuse messages larger than this (envd's data events carry at most 32 KiB raw)
MAX_MESSAGE = 4 * 1024 * 1024
#: envd reads a process pipe in chunks of at most this many bytes
CHUNK = 32 * 1024
#: raw stdin bytes per SendInput call
STDIN_CHUNK = 256 * 1024

CONNECT_JSON = "application/connect+json"
START_PATH = "/process.Process/Start"
SEND_INPUT_PATH = "/process.Process/SendInput"
CLOSE_STDIN_PATH = "/process.Process/CloseStdin"
SEND_SIGNAL_PATH = "/process.Process/SendSignal"
FILES_PATH = "/files"

#: Go's ``syscall.Signal.String()`` for the signals a killed command meets
SIGNAL_NAMES = {
    "hangup": 1,
    "interrupt": 2,
    "quit": 3,
    "aborted": 6,
    "killed": 9,
    "segmentation fault": 11,
    "broken pipe": 13,
    "alarm clock": 14,
    "terminated": 15,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Envelope:
    flags: int
    message: bytes

    @property
    def end_stream(self) -> bool:
        return bool(self.flags & FLAG_END_STREAM)


def encode_envelope(message: bytes, *, end_stream: bool = False) -> bytes:
    if len(message) > 0xFFFFFFFF:
        raise ValueError("message too large for one envelope")
    return HEADER.pack(FLAG_END_STREAM if end_stream else 0, len(message)) + message


class EnvelopeDecoder:
    """Incremental envelope parser: bytes in any split, envelopes out, in order.

    After the end-stream envelope nothing may follow (trailing bytes are a protocol
    error); :meth:`eof` raises if the body stopped inside an envelope.
    """

    def __init__(self, max_message: int = MAX_MESSAGE) -> None:
        self.max_message = max_message
        self._buf = bytearray()
        self.ended = False

    def feed(self, data: bytes) -> list[Envelope]:
        if data and self.ended:
            raise ProtocolError("bytes after the end-stream message", "trailing")
        self._buf += data
        out: list[Envelope] = []
        while len(self._buf) >= HEADER.size:
            flags, length = HEADER.unpack_from(self._buf)
            if flags & ~(FLAG_COMPRESSED | FLAG_END_STREAM):
                raise ProtocolError(f"unknown envelope flags 0x{flags:02x}")
            if flags & FLAG_COMPRESSED:
                raise ProtocolError("compressed envelope (no compression was negotiated)")
            if length > self.max_message:
                raise ProtocolError(f"envelope of {length} bytes exceeds {self.max_message}")
            if len(self._buf) < HEADER.size + length:
                break
            message = bytes(self._buf[HEADER.size : HEADER.size + length])
            del self._buf[: HEADER.size + length]
            out.append(Envelope(flags, message))
            if flags & FLAG_END_STREAM:
                self.ended = True
                if self._buf:
                    raise ProtocolError("bytes after the end-stream message", "trailing")
                break
        return out

    @property
    def pending(self) -> int:
        """Bytes of an envelope begun but not finished."""
        return len(self._buf)

    def eof(self) -> None:
        if self._buf:
            raise ProtocolError(
                f"stream cut inside an envelope ({len(self._buf)} bytes)", "truncated"
            )


# --------------------------------------------------------------------- events


@dataclasses.dataclass(frozen=True, slots=True)
class Start:
    pid: int


@dataclasses.dataclass(frozen=True, slots=True)
class Data:
    stream: str  # "stdout" or "stderr"
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Keepalive:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class End:
    exit_code: int
    exited: bool
    status: str
    error: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class EndStream:
    """The end-stream message: ``error_code`` is None on success."""

    error_code: str | None = None
    error_message: str = ""


Event = Start | Data | Keepalive | End


def _json_object(message: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(message)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"{what} is not JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} is not a JSON object")
    return obj


def _int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,10}", value):
        value = int(value)  # proto3 JSON may quote integers
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(f"bad {what}: {value!r:.40}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"bad {what}: {value!r:.40}")
    return value


def decode_event(message: bytes) -> Event:
    """One ``StartResponse`` message → its event."""
    obj = _json_object(message, "process event")
    event = obj.get("event")
    if not isinstance(event, dict) or len(event) != 1:
        raise ProtocolError("message without exactly one event")
    ((kind, body),) = event.items()
    if not isinstance(body, dict):
        raise ProtocolError(f"{printable(kind, 40)} event is not an object")
    if kind == "start":
        return Start(_int(body.get("pid", 0), "pid", 0, 2**32 - 1))
    if kind == "data":
        streams = [k for k in ("stdout", "stderr", "pty") if k in body]
        if len(streams) != 1 or len(body) != 1:
            raise ProtocolError("data event without exactly one stream")
        raw = _str(body[streams[0]], "data payload")
        try:
            data = base64.b64decode(raw.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise ProtocolError("data event payload is not base64") from None
        if streams[0] == "pty":
            raise ProtocolError("pty output on a non-pty exec")
        return Data(streams[0], data)
    if kind == "keepalive":
        return Keepalive()
    if kind == "end":
        code = _int(body.get("exitCode", 0), "exitCode", -(2**31), 2**31 - 1)
        exited = body.get("exited", False)
        if not isinstance(exited, bool):
            raise ProtocolError(f"bad exited: {exited!r:.40}")
        status = _str(body.get("status", ""), "status")
        error = body.get("error")
        return End(code, exited, status, None if error is None else _str(error, "error"))
    raise ProtocolError(f"unknown process event {kind!r:.40}")


def decode_end_stream(message: bytes) -> EndStream:
    obj = _json_object(message, "end-stream message")
    error = obj.get("error")
    if error is None:
        return EndStream()
    if not isinstance(error, dict):
        raise ProtocolError("end-stream error is not an object")
    # envd runs in the sandbox: its words reach messages printable (no terminal escapes)
    code = printable(_str(error.get("code", "unknown"), "error code"), 40)
    return EndStream(code or "unknown", printable(_str(error.get("message", ""), "error message")))


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_event(event: Event) -> bytes:
    """The enveloped ``StartResponse`` for ``event``, as envd writes it (zeros omitted)."""
    body: dict[str, Any]
    if isinstance(event, Start):
        body = {"start": {"pid": event.pid} if event.pid else {}}
    elif isinstance(event, Data):
        body = {"data": {event.stream: base64.b64encode(event.data).decode()}}
    elif isinstance(event, Keepalive):
        body = {"keepalive": {}}
    else:
        end: dict[str, Any] = {}
        if event.exit_code:
            end["exitCode"] = event.exit_code
        if event.exited:
            end["exited"] = True
        if event.status:
            end["status"] = event.status
        if event.error is not None:
            end["error"] = event.error
        body = {"end": end}
    return encode_envelope(_json({"event": body}))


def encode_end_stream(error_code: str | None = None, message: str = "") -> bytes:
    obj: dict[str, Any] = {}
    if error_code is not None:
        obj["error"] = {"code": error_code, "message": message}
    return encode_envelope(_json(obj), end_stream=True)


# -------------------------------------------------------------------- requests


def start_request(
    argv: Sequence[str],
    *,
    stdin: bool,
    cwd: str | None = None,
    envs: Mapping[str, str] | None = None,
    tag: str | None = None,
) -> bytes:
    """The enveloped ``StartRequest``.  ``stdin`` is always explicit: an absent field
    makes envd keep a stdin pipe open (a ``cat`` would hang until its deadline).  A
    ``tag`` names the process before its ``start`` event (and so its pid) has arrived:
    a caller that gives up earlier can still signal it by tag."""
    if not argv:
        raise ValueError("exec needs a non-empty argv")
    process: dict[str, Any] = {"cmd": argv[0], "args": list(argv[1:])}
    if envs:
        process["envs"] = dict(envs)
    if cwd:
        process["cwd"] = cwd
    request: dict[str, Any] = {"process": process, "stdin": stdin}
    if tag is not None:
        request["tag"] = tag
    return encode_envelope(_json(request))


@dataclasses.dataclass(frozen=True, slots=True)
class StartRequest:
    cmd: str
    args: tuple[str, ...]
    envs: tuple[tuple[str, str], ...]
    cwd: str | None
    #: None: the field was absent (envd then opens a stdin pipe)
    stdin: bool | None
    tag: str | None = None


def parse_start_request(message: bytes) -> StartRequest:
    obj = _json_object(message, "StartRequest")
    process = obj.get("process")
    if not isinstance(process, dict):
        raise ProtocolError("StartRequest without process")
    cmd = _str(process.get("cmd"), "cmd")
    args = process.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ProtocolError("bad args")
    envs = process.get("envs", {})
    if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
        raise ProtocolError("bad envs")
    cwd = process.get("cwd")
    stdin = obj.get("stdin")
    if stdin is not None and not isinstance(stdin, bool):
        raise ProtocolError("bad stdin")
    tag = obj.get("tag")
    return StartRequest(
        cmd=cmd,
        args=tuple(args),
        envs=tuple(sorted(envs.items())),
        cwd=None if cwd is None else _str(cwd, "cwd"),
        stdin=stdin,
        tag=None if tag is None else _str(tag, "tag"),
    )


def send_input_body(pid: int, data: bytes) -> bytes:
    return _json({"process": {"pid": pid}, "input": {"stdin": base64.b64encode(data).decode()}})


def pid_body(pid: int, **extra: str) -> bytes:
    return _json({"process": {"pid": pid}, **extra})


def tag_body(tag: str, **extra: str) -> bytes:
    """A unary body whose ``ProcessSelector`` names the process by its start tag."""
    return _json({"process": {"tag": tag}, **extra})


def parse_unary(message: bytes) -> tuple[int | str, dict[str, Any]]:
    """A unary request body → (the selector: a pid or a tag, the whole object)."""
    obj = _json_object(message, "request")
    process = obj.get("process")
    if not isinstance(process, dict):
        raise ProtocolError("request without process")
    if "tag" in process and "pid" not in process:
        return _str(process.get("tag"), "tag"), obj
    return _int(process.get("pid"), "pid", 0, 2**32 - 1), obj


def signal_status(exit_code: int, status: str) -> int | None:
    """Shell-style status for an ``end`` event: -1 with ``signal: killed`` is 137."""
    if exit_code >= 0:
        return exit_code
    if status.startswith("signal: "):
        number = SIGNAL_NAMES.get(status.removeprefix("signal: ").strip())
        if number is not None:
            return 128 + number
    return None


# ------------------------------------------------------------------- collector


class StartCollector:
    """Accumulates one ``Start`` response body into an :class:`ExecResult`, honestly.

    :meth:`feed` raw body bytes as they arrive, then :meth:`result` once the body ended.
    ``exit_status`` is set only when an ``end`` event *and* a successful end-stream
    message both arrived; a body cut anywhere before that gives ``None`` and a note.
    An end-stream error is reported through :attr:`error` for the caller to raise.
    """

    def __init__(self, max_output: int) -> None:
        if max_output < 0:
            raise ValueError("max_output must be >= 0")
        self.max_output = max_output
        self.decoder = EnvelopeDecoder()
        self._out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self.pid: int | None = None
        self.end: End | None = None
        self.end_stream: EndStream | None = None
        self.truncated = False
        self.events = 0
        self._notes: list[str] = []

    def note(self, text: str) -> None:
        if text not in self._notes:
            self._notes.append(text)

    @property
    def finished(self) -> bool:
        return self.end_stream is not None

    @property
    def error(self) -> EndStream | None:
        if self.end_stream is not None and self.end_stream.error_code is not None:
            return self.end_stream
        return None

    def feed(self, data: bytes) -> list[Event]:
        """Account for body bytes; returns the events they completed (for logging)."""
        events: list[Event] = []
        for envelope in self.decoder.feed(data):
            if envelope.end_stream:
                self.end_stream = decode_end_stream(envelope.message)
                continue
            event = decode_event(envelope.message)
            self.events += 1
            events.append(event)
            if isinstance(event, Start):
                if self.pid is not None or self.events != 1:
                    raise ProtocolError("start event out of place")
                self.pid = event.pid
            elif isinstance(event, Data):
                if self.end is not None:
                    raise ProtocolError("data event after the end event")
                buf = self._out[event.stream]
                room = self.max_output - len(buf)
                if len(event.data) > room:
                    self.truncated = True
                buf += event.data[: max(room, 0)]
            elif isinstance(event, End):
                if self.end is not None:
                    raise ProtocolError("second end event")
                self.end = event
        return events

    def result(self) -> ExecResult:
        """Call after the body ended (or was abandoned)."""
        status: int | None = None
        if self.decoder.pending:
            self.note(f"stream cut inside an envelope ({self.decoder.pending} bytes)")
        if self.end_stream is None:
            self.note("stream ended without the end-stream message")
        elif self.end is None:
            self.note("end-stream message without an end event")
        elif self.end_stream.error_code is None:
            status = signal_status(self.end.exit_code, self.end.status)
            if status is None:
                self.note(f"end event without a usable status ({self.end.status!r:.60})")
        return ExecResult(
            stdout=bytes(self._out["stdout"]),
            stderr=bytes(self._out["stderr"]),
            exit_status=status,
            truncated=self.truncated,
            notes=tuple(self._notes),
        )


# ----------------------------------------------------------------------- files


def range_header(offset: int, length: int) -> str:
    if offset < 0 or length <= 0:
        raise ValueError("offset must be >= 0 and length > 0")
    return f"bytes={offset}-{offset + length - 1}"


def parse_content_range(value: str) -> tuple[int, int, int | None]:
    """``bytes a-b/size`` → (a, b, size or None); raises ProtocolError when malformed."""
    match = re.fullmatch(r"bytes ([0-9]{1,19})-([0-9]{1,19})/([0-9]{1,19}|\*)", value.strip())
    if match is None:
        raise ProtocolError(f"bad Content-Range {value!r:.80}")
    first, last = int(match.group(1)), int(match.group(2))
    if last < first:
        raise ProtocolError(f"bad Content-Range {value!r:.80}")
    size = None if match.group(3) == "*" else int(match.group(3))
    return first, last, size


def parse_range(value: str, size: int) -> tuple[int, int] | None:
    """Server side of a single ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range.

    Returns (first, last) inclusive, or None when unsatisfiable (416).  Malformed headers
    raise :class:`ProtocolError` (the server then ignores them, like Go's ServeContent).
    """
    match = re.fullmatch(r"bytes=([0-9]{0,19})-([0-9]{0,19})", value.strip())
    if match is None or not (match.group(1) or match.group(2)):
        raise ProtocolError(f"unsupported Range {value!r:.80}")
    if not match.group(1):
        suffix = int(match.group(2))
        if suffix == 0 or size == 0:
            return None
        return max(size - suffix, 0), size - 1
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) else size - 1
    if first >= size or last < first:
        return None
    return first, min(last, size - 1)
