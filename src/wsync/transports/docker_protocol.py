"""The Docker Engine API's exec wire format, sans-I/O: frames, request bodies, inspect.

Both ends use this module: the client (:mod:`wsync.transports.docker`) and the emulator
(:mod:`wsync.emulators.docker`), so the emulator cannot quietly speak a dialect that only
this client accepts, and the codec is tested whole, byte at a time and fuzzed without
sockets.

An exec is three calls (moby ``api/swagger.yaml``, ``daemon/server/router/container/
exec.go``):

* ``POST /containers/{id}/exec`` with ``{"AttachStdin", "AttachStdout", "AttachStderr",
  "Tty": false, "Cmd", "Env", "WorkingDir", "User"}`` → 201 ``{"Id"}``; errors are
  ``{"message"}`` (404 no such container, 409 paused or not running);
* ``POST /exec/{id}/start`` with ``{"Detach": false, "Tty": false}``: the connection is
  hijacked (``101 UPGRADED`` when the client asked for ``Upgrade: tcp``, else ``200 OK``
  with a raw-stream content type *even though the stream is multiplexed*: trust ``Tty``,
  not the header), then raw socket bytes both ways.  Output is a sequence of frames
  ``[type, 0, 0, 0, size (uint32 big-endian)] payload``; type 0 (stdin, shown as stdout),
  1 stdout, 2 stderr, 3 system error.  Frames are write-sized chunks, not lines, and a
  header may be split across reads.  The end of output is the daemon closing the
  connection; **no exit code travels in the stream**.  stdin ends by a half-close;
* ``GET /exec/{id}/json`` → ``{"Running", "ExitCode": int | null, "Pid", ...}``.
  ``ExitCode`` is ``null`` until the daemon has processed the exit event, which can be
  *after* the stream's EOF (moby#19607, testcontainers-go#3766): ``null`` is never 0.

:class:`FrameDecoder` streams payload out as it arrives (a frame may claim 4 GiB; memory
stays bounded by what one read returns).  Anything malformed is a
:class:`~wsync.errors.ProtocolError` and nothing else (fuzzed).
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from wsync.errors import ProtocolError, UsageError
from wsync.protocol.records import printable
from wsync.transports.base import BoundedBuffer, ExecResult, dns_spellable

STDIN, STDOUT, STDERR, SYSTEMERR = 0, 1, 2, 3
STREAM_NAMES = {STDIN: "stdin", STDOUT: "stdout", STDERR: "stderr", SYSTEMERR: "systemerr"}
HEADER = struct.Struct(">B3sI")
HEADER_SIZE = HEADER.size  # 8
#: the daemon's copy loop writes at most this much per frame (stdcopy's buffer)
CHUNK = 32 * 1024
#: how much of a system-error frame's text is kept for the error message
SYSTEMERR_KEEP = 4096

MULTIPLEXED = "application/vnd.docker.multiplexed-stream"
RAW_STREAM = "application/vnd.docker.raw-stream"
START_BODY = b'{"Detach":false,"Tty":false}'
DEFAULT_SOCKET = "/var/run/docker.sock"
DEFAULT_TCP_PORT = 2375

#: container names (``[a-zA-Z0-9][a-zA-Z0-9_.-]+``, moby ``daemon/names``) and ids
CONTAINER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")
#: exec ids are 64 hex digits from moby; anything path-safe is accepted, nothing else
EXEC_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


# --------------------------------------------------------------------- frames


def encode_frame(stream: int, payload: bytes) -> bytes:
    """One multiplexed frame (header and payload)."""
    if stream not in STREAM_NAMES:
        raise ValueError(f"unknown stream type {stream}")
    if len(payload) > 0xFFFFFFFF:
        raise ValueError("payload too large for one frame")
    return HEADER.pack(stream, b"\0\0\0", len(payload)) + payload


class FrameDecoder:
    """Incremental demultiplexer: bytes in any split, ``(stream, piece)`` out, in order.

    A frame's payload is handed out piece by piece as it arrives, so a huge frame is never
    buffered whole; only a header (at most 7 bytes) is ever held back.  A header with an
    unknown type or non-zero padding means the byte stream is out of step (a raw TTY
    stream, a proxy's bytes): that is a :class:`ProtocolError`, never output.
    """

    def __init__(self) -> None:
        self._header = bytearray()
        self._stream = STDOUT
        self._left = 0
        #: complete frames seen (a frame of size 0 counts when its header is complete)
        self.frames = 0

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            if self._left:
                take = min(self._left, len(view) - pos)
                out.append((self._stream, bytes(view[pos : pos + take])))
                pos += take
                self._left -= take
                if not self._left:
                    self.frames += 1
                continue
            need = HEADER_SIZE - len(self._header)
            self._header += view[pos : pos + need]
            pos += min(need, len(view) - pos)
            if len(self._header) < HEADER_SIZE:
                break
            stream, pad, size = HEADER.unpack(self._header)
            self._header.clear()
            if stream not in STREAM_NAMES:
                raise ProtocolError(f"unknown stream type {stream} in a frame header")
            if pad != b"\0\0\0":
                raise ProtocolError(f"frame header padding is not zero: {pad.hex()}")
            self._stream = stream
            self._left = size
            if not size:
                self.frames += 1
        return out

    @property
    def pending(self) -> int:
        """Bytes still owed by a frame begun (or a header begun) but not finished."""
        return len(self._header) or self._left

    def eof(self) -> None:
        """The connection closed: raise if it closed inside a header or a payload."""
        if self._header:
            raise ProtocolError(
                f"stream cut inside a frame header ({len(self._header)} of 8 bytes)", "truncated"
            )
        if self._left:
            raise ProtocolError(
                f"stream cut inside a frame ({self._left} payload bytes missing)", "truncated"
            )


class ExecCollector:
    """One exec's output: demultiplexed, bounded per stream, system errors kept apart.

    ``max_output`` applies to stdout and to stderr each (the transport contract); what is
    beyond it is read and dropped (the command is drained, not blocked) and ``truncated``
    says so.  Stdin frames (type 0) count as stdout, as moby's ``stdcopy`` does.
    """

    def __init__(self, max_output: int) -> None:
        self.decoder = FrameDecoder()
        self.stdout = BoundedBuffer(max_output)
        self.stderr = BoundedBuffer(max_output)
        self.systemerr = bytearray()
        self.received = 0

    def feed(self, data: bytes) -> None:
        self.received += len(data)
        for stream, piece in self.decoder.feed(data):
            if stream == STDERR:
                self.stderr.feed(piece)
            elif stream == SYSTEMERR:
                self.systemerr += piece[: max(SYSTEMERR_KEEP - len(self.systemerr), 0)]
            else:
                self.stdout.feed(piece)

    def eof(self) -> None:
        self.decoder.eof()

    @property
    def system_error(self) -> str | None:
        """The daemon's system-error text, if it sent any (printable, bounded)."""
        if not self.systemerr:
            return None
        return printable(bytes(self.systemerr).strip(), 499) or "(empty)"

    def result(self, exit_status: int | None, notes: Sequence[str] = ()) -> ExecResult:
        return ExecResult(
            stdout=self.stdout.getvalue(),
            stderr=self.stderr.getvalue(),
            exit_status=exit_status,
            truncated=self.stdout.truncated or self.stderr.truncated,
            notes=tuple(notes),
        )


# ------------------------------------------------------------------ requests


def exec_create_body(
    cmd: Sequence[str],
    *,
    stdin: bool,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    user: str | None = None,
) -> bytes:
    """The ``POST /containers/{id}/exec`` body.  ``Tty`` is always false: a TTY merges
    stdout and stderr and turns ``\\n`` into ``\\r\\n``."""
    if not cmd:
        raise UsageError("exec needs a non-empty argv")
    body: dict[str, Any] = {
        "AttachStdin": stdin,
        "AttachStdout": True,
        "AttachStderr": True,
        "Tty": False,
        "Cmd": list(cmd),
    }
    if env:
        body["Env"] = [f"{k}={v}" for k, v in env.items()]
    if workdir:
        body["WorkingDir"] = workdir
    if user:
        body["User"] = user
    return json.dumps(body, separators=(",", ":")).encode()


@dataclasses.dataclass(frozen=True, slots=True)
class ExecConfig:
    """A parsed create body (the emulator's view of it)."""

    cmd: tuple[str, ...]
    stdin: bool
    env: dict[str, str]
    workdir: str | None
    user: str | None


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        raise ProtocolError(f"{what} is not JSON: {body[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} is not a JSON object")
    return obj


def parse_exec_create(body: bytes) -> ExecConfig:
    obj = _json_object(body, "exec create body")
    cmd = obj.get("Cmd")
    if not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) for a in cmd):
        raise ProtocolError("No exec command specified")
    env: dict[str, str] = {}
    raw_env = obj.get("Env") or []
    if not isinstance(raw_env, list) or not all(isinstance(e, str) for e in raw_env):
        raise ProtocolError("Env must be a list of strings")
    for entry in raw_env:
        key, _, value = entry.partition("=")
        env[key] = value
    workdir, user = obj.get("WorkingDir") or None, obj.get("User") or None
    if obj.get("Tty"):
        raise ProtocolError("Tty exec is not emulated")
    if not isinstance(workdir, str | None) or not isinstance(user, str | None):
        raise ProtocolError("WorkingDir and User must be strings")
    return ExecConfig(tuple(cmd), bool(obj.get("AttachStdin")), env, workdir, user)


def parse_exec_id(body: bytes) -> str:
    """The ``Id`` of a 201 create answer, checked to be path-safe."""
    exec_id = _json_object(body, "exec create answer").get("Id")
    if not isinstance(exec_id, str) or not EXEC_ID.fullmatch(exec_id):
        raise ProtocolError(f"exec create answered a bad Id: {str(exec_id)[:80]!r}")
    return exec_id


@dataclasses.dataclass(frozen=True, slots=True)
class Inspect:
    """What ``GET /exec/{id}/json`` said about one exec."""

    running: bool
    #: None while the daemon has not recorded the exit: never read as 0
    exit_code: int | None
    pid: int = 0

    @property
    def finished(self) -> bool:
        return not self.running and self.exit_code is not None

    def to_json(self, exec_id: str, container: str) -> bytes:
        return json.dumps(
            {
                "ID": exec_id,
                "Running": self.running,
                "ExitCode": self.exit_code,
                "ProcessConfig": {"tty": False},
                "OpenStdin": False,
                "OpenStdout": True,
                "OpenStderr": True,
                "CanRemove": False,
                "ContainerID": container,
                "DetachKeys": "",
                "Pid": self.pid,
            },
            separators=(",", ":"),
        ).encode()


def parse_inspect(body: bytes) -> Inspect:
    obj = _json_object(body, "exec inspect answer")
    running, code, pid = obj.get("Running"), obj.get("ExitCode"), obj.get("Pid", 0)
    if not isinstance(running, bool):
        raise ProtocolError("exec inspect: Running is not a boolean")
    if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
        raise ProtocolError(f"exec inspect: ExitCode is not an integer: {str(code)[:40]!r}")
    if isinstance(pid, bool) or not isinstance(pid, int):
        pid = 0
    return Inspect(running, code, pid)


def error_body(message: str) -> bytes:
    return json.dumps({"message": message}, separators=(",", ":")).encode()


def check_start_answer(status: int, headers: Mapping[str, str]) -> None:
    """Raise unless a start answer hijacked the connection (101, or 200 without body
    framing: the raw stream runs to the connection's close)."""
    if status == 101:
        if headers.get("upgrade", "").lower() != "tcp":
            raise ProtocolError(f"101 answer upgrades to {headers.get('upgrade', '')!r}, not tcp")
        return
    if status != 200:
        raise ProtocolError(f"exec start answered HTTP {status}")
    if "transfer-encoding" in headers or "content-length" in headers:
        # a proxy re-framed the hijacked stream: the frames would mix with chunk sizes
        raise ProtocolError("exec start answered a framed body instead of a hijacked stream")


# ------------------------------------------------------------------ endpoint


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the Docker daemon listens: a unix socket path, or a TCP host and port."""

    unix_path: str | None = None
    host: str | None = None
    port: int = DEFAULT_TCP_PORT

    def __str__(self) -> str:
        if self.unix_path is not None:
            return f"unix://{self.unix_path}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


def parse_docker_host(text: str) -> Endpoint:
    """``DOCKER_HOST`` / ``--docker-host``: ``unix:///path`` or ``tcp://HOST[:PORT]``.

    TLS (``DOCKER_TLS_VERIFY``), ``ssh://`` and ``npipe://`` are refused by name rather
    than half-supported.
    """
    raw = text.strip()
    if not raw:
        return Endpoint(unix_path=DEFAULT_SOCKET)
    if raw.startswith("unix://"):
        path = raw[len("unix://") :]
        if not path.startswith("/"):
            raise UsageError(f"docker host {raw!r}: a unix socket needs an absolute path")
        return Endpoint(unix_path=path)
    if raw.startswith("/"):
        return Endpoint(unix_path=raw)
    parts = urllib.parse.urlsplit(raw)
    if parts.scheme in ("tcp", "http"):
        try:
            port = parts.port
        except ValueError:
            raise UsageError(f"docker host {raw!r}: bad port") from None
        if not parts.hostname or parts.username or parts.password:
            raise UsageError(f"docker host {raw!r}: expected tcp://HOST[:PORT]")
        if parts.path not in ("", "/") or parts.query:
            raise UsageError(f"docker host {raw!r}: a path or query is not supported")
        if not dns_spellable(parts.hostname):
            raise UsageError(f"docker host {raw!r}: not a host name DNS can spell")
        return Endpoint(host=parts.hostname, port=port or DEFAULT_TCP_PORT)
    raise UsageError(
        f"docker host {raw!r}: only unix:///PATH and tcp://HOST[:PORT] are supported "
        "(no ssh://, npipe:// or TLS)"
    )


def check_container(name: str) -> str:
    if not CONTAINER_NAME.fullmatch(name):
        raise UsageError(
            f"bad container name or id {name!r} (letters, digits, '_', '.', '-'; "
            "starting with a letter or digit)"
        )
    return name
