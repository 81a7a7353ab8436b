"""The Sprites exec wire format, sans-I/O: frames, URLs and one exec's bookkeeping.

Both ends use this module: the client transport (:mod:`wsync.transports.sprites`)
and the emulator (:mod:`wsync.emulators.sprites`).  Keeping the codec in one
pure place means the emulator cannot quietly speak a dialect the client
happens to accept, and the codec can be fuzzed without sockets.

Non-TTY exec messages (WebSocket):

* binary frames, first byte the stream id: ``0`` stdin, ``1`` stdout,
  ``2`` stderr, ``3`` exit (``[0x03, code]``, exactly two bytes), ``4`` stdin
  EOF (``[0x04]``, exactly one byte);
* text frames holding one JSON object with a ``type``: ``session_info``,
  ``debug``, ``exit`` (``{"type": "exit", "exit_code": N}``), port notices and
  whatever the service adds later (kept as :class:`Control`).

Anything else is a :class:`~wsync.errors.ProtocolError` and nothing else: the
channel lies, so the caller retries.

:class:`ExecCollector` turns the message sequence of one exec into an honest
:class:`~wsync.transports.base.ExecResult`: no exit frame means
``exit_status=None`` (never 0), output past ``max_output`` sets ``truncated``,
and data after the exit frame is kept and noted.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from wsync.errors import ProtocolError, UsageError
from wsync.transports.base import ExecResult

STDIN = 0
STDOUT = 1
STDERR = 2
EXIT = 3
STDIN_EOF = 4

STREAM_NAMES = {STDIN: "stdin", STDOUT: "stdout", STDERR: "stderr"}

#: the only path the exec endpoint lives at, below the base URL
EXEC_PATH = "/v1/sprites/{name}/exec"


@dataclasses.dataclass(frozen=True, slots=True)
class Data:
    """Bytes on one stream (stdin from the client, stdout/stderr from the server)."""

    stream: int
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Exit:
    """The command's exit status, from a binary ``[0x03, code]`` or a JSON ``exit``."""

    code: int


@dataclasses.dataclass(frozen=True, slots=True)
class StdinEOF:
    """The client closed stdin (``[0x04]``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Control:
    """A JSON text message other than ``exit``: ``session_info``, ``debug``, ports."""

    type: str
    payload: Mapping[str, Any]


Frame = Data | Exit | StdinEOF | Control


# --------------------------------------------------------------------- encode


def encode_data(stream: int, data: bytes) -> bytes:
    if stream not in STREAM_NAMES:
        raise ValueError(f"not a data stream id: {stream}")
    return bytes((stream,)) + data


def encode_exit(code: int) -> bytes:
    """``[0x03, code]``; the wire has one byte, so the code must fit in it."""
    if not 0 <= code <= 255:
        raise ValueError(f"exit code {code} does not fit the one-byte exit frame")
    return bytes((EXIT, code))


def encode_stdin_eof() -> bytes:
    return bytes((STDIN_EOF,))


def encode_control(type_: str, **fields: Any) -> str:
    return json.dumps({"type": type_, **fields}, separators=(",", ":"))


def encode_exit_text(code: int) -> str:
    return encode_control("exit", exit_code=code)


# --------------------------------------------------------------------- decode


def decode_binary(frame: bytes) -> Frame:
    """Decode one binary message; raise :class:`ProtocolError` for anything malformed."""
    if not frame:
        raise ProtocolError("empty binary frame")
    stream = frame[0]
    if stream in STREAM_NAMES:
        return Data(stream, bytes(frame[1:]))
    if stream == EXIT:
        if len(frame) != 2:
            raise ProtocolError(f"exit frame of {len(frame)} bytes (expected 2)")
        return Exit(frame[1])
    if stream == STDIN_EOF:
        if len(frame) != 1:
            raise ProtocolError(f"stdin-EOF frame of {len(frame)} bytes (expected 1)")
        return StdinEOF()
    raise ProtocolError(f"unknown stream id {stream}")


def decode_text(text: str) -> Exit | Control:
    """Decode one JSON text message; only ``exit`` has a meaning the client acts on."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ProtocolError(f"text frame is not JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("text frame is not a JSON object")
    kind = obj.get("type")
    if not isinstance(kind, str) or not kind:
        raise ProtocolError("text frame without a string 'type'")
    if kind == "exit":
        code = obj.get("exit_code")
        if not isinstance(code, int) or isinstance(code, bool) or not -255 <= code <= 65535:
            raise ProtocolError(f"exit message with a bad exit_code: {code!r:.40}")
        return Exit(code)
    return Control(kind, obj)


def decode(message: bytes | str) -> Frame:
    if isinstance(message, str):
        return decode_text(message)
    return decode_binary(message)


# ----------------------------------------------------------------------- URLs


def exec_url(
    base_url: str,
    name: str,
    argv: Sequence[str],
    *,
    stdin: bool,
    workdir: str | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """The WebSocket URL of one exec: ``http(s)`` bases become ``ws(s)``."""
    if not argv:
        raise UsageError("exec needs a non-empty argv")
    if not name:
        raise UsageError("sprite name is empty")
    parts = urllib.parse.urlsplit(base_url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme.lower())
    if scheme is None or not parts.netloc:
        raise UsageError(f"Sprites API URL must be http(s):// or ws(s)://, got {base_url!r}")
    path = parts.path.rstrip("/") + EXEC_PATH.format(name=urllib.parse.quote(name, safe=""))
    query: list[tuple[str, str]] = [("cmd", arg) for arg in argv]
    query += [("stdin", "true" if stdin else "false"), ("tty", "false")]
    if workdir is not None:
        query.append(("dir", workdir))
    for key, value in (env or {}).items():
        query.append(("env", f"{key}={value}"))
    encoded = urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, encoded, ""))


@dataclasses.dataclass(frozen=True, slots=True)
class ExecRequest:
    """What the server reads from an exec URL (the emulator's side of :func:`exec_url`)."""

    name: str
    argv: tuple[str, ...]
    stdin: bool
    tty: bool
    workdir: str | None
    env: tuple[tuple[str, str], ...]


def parse_exec_path(path: str) -> ExecRequest | None:
    """Parse a request path; ``None`` when it is not the exec endpoint at all.

    A malformed query on the exec endpoint raises :class:`ProtocolError`.
    """
    parts = urllib.parse.urlsplit(path)
    segments = parts.path.split("/")
    # "", "v1", "sprites", NAME, "exec"
    if len(segments) != 5 or segments[:3] != ["", "v1", "sprites"] or segments[4] != "exec":
        return None
    name = urllib.parse.unquote(segments[3], errors="strict")
    if not name or "/" in name or "\x00" in name or name in (".", ".."):
        raise ProtocolError(f"bad sprite name {name!r:.60}")
    try:
        query = urllib.parse.parse_qsl(
            parts.query, keep_blank_values=True, strict_parsing=bool(parts.query), errors="strict"
        )
    except (ValueError, UnicodeDecodeError) as err:
        raise ProtocolError(f"bad exec query: {err}") from None
    argv = tuple(v for k, v in query if k == "cmd")
    if not argv:
        raise ProtocolError("exec without cmd")
    flags = {k: v for k, v in query if k in ("stdin", "tty", "dir")}
    env: list[tuple[str, str]] = []
    for key, value in query:
        if key == "env":
            var, sep, val = value.partition("=")
            if not sep or not var:
                raise ProtocolError(f"bad env parameter {value!r:.60}")
            env.append((var, val))
    return ExecRequest(
        name=name,
        argv=argv,
        stdin=flags.get("stdin", "false") == "true",
        tty=flags.get("tty", "false") == "true",
        workdir=flags.get("dir") or None,
        env=tuple(env),
    )


# ------------------------------------------------------------------ collector


class ExecCollector:
    """Accumulates one exec's messages into an :class:`ExecResult`, honestly.

    Feed every received message to :meth:`feed`, then call :meth:`closed`
    (socket closed) or :meth:`drain_expired` (stopped waiting after the exit
    frame), then :meth:`result`.  Each of stdout and stderr keeps at most
    ``max_output`` bytes; the rest is dropped and ``truncated`` is set.
    """

    def __init__(self, max_output: int) -> None:
        if max_output < 0:
            raise ValueError("max_output must be >= 0")
        self.max_output = max_output
        self._out: dict[int, bytearray] = {STDOUT: bytearray(), STDERR: bytearray()}
        self.exit_status: int | None = None
        self.truncated = False
        self.bytes_after_exit = 0
        self.session_info: Mapping[str, Any] | None = None
        self._notes: list[str] = []

    @property
    def exited(self) -> bool:
        return self.exit_status is not None

    def note(self, text: str) -> None:
        if text not in self._notes:
            self._notes.append(text)

    def feed(self, message: bytes | str) -> Frame:
        """Account for one message; returns the decoded frame (for logging)."""
        frame = decode(message)
        if isinstance(frame, Data):
            if frame.stream == STDIN:
                raise ProtocolError("server sent a stdin frame")
            if self.exited and frame.data:
                self.bytes_after_exit += len(frame.data)
                self.note("data after exit frame")
            buf = self._out[frame.stream]
            room = self.max_output - len(buf)
            if len(frame.data) > room:
                self.truncated = True
            buf += frame.data[: max(room, 0)]
        elif isinstance(frame, Exit):
            if self.exit_status is None:
                self.exit_status = frame.code
            elif frame.code != self.exit_status:
                self.note(f"conflicting exit frames ({self.exit_status}, then {frame.code})")
        elif isinstance(frame, StdinEOF):
            raise ProtocolError("server sent a stdin-EOF frame")
        elif frame.type == "session_info":
            # ``is_owner: false`` even for the socket that started the exec: the
            # session model behind the ring.  Kept for doctor, not a per-exec note.
            self.session_info = frame.payload
        return frame

    def closed(self, code: int | None, *, clean: bool) -> None:
        """The socket closed; ``clean`` is a close frame with a normal code (1000/1001)."""
        if not self.exited:
            self.note(f"closed without exit frame (code {code})")
        elif not clean:
            self.note(f"connection dropped after exit frame (code {code})")

    def drain_expired(self) -> None:
        self.note("drain deadline passed before close")

    def result(self) -> ExecResult:
        return ExecResult(
            stdout=bytes(self._out[STDOUT]),
            stderr=bytes(self._out[STDERR]),
            exit_status=self.exit_status,
            truncated=self.truncated,
            notes=tuple(self._notes),
        )
