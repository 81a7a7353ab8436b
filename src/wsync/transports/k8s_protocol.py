"""The Kubernetes pods/exec wire format, sans-I/O: subprotocols, channel frames, Status.

Both ends use this module: the client transport (:mod:`wsync.transports.k8s`) and the
emulator (:mod:`wsync.emulators.k8s`), so the emulator cannot speak a dialect only this
client accepts, and the codec is fuzzed without sockets (``backends.md`` section 5).

* Subprotocols: ``v5.channel.k8s.io`` (stdin EOF by a CLOSE frame) is preferred, then
  ``v4.channel.k8s.io``, then the text variant ``v4.base64.channel.k8s.io``.  v1-v3 send no
  exit status on success, so they are never offered: a missing status must stay unknown.
* Binary protocols: every message is ``[channel][payload]``; an empty message is ignored;
  v5's ``[255, channel]`` half-closes a channel (``[255, 0]`` is stdin EOF).
* base64 protocols: text messages ``'0'+channel`` followed by base64 of the payload.
* Channel 3 carries one ``metav1.Status`` JSON: ``Success``; ``Failure`` with reason
  ``NonZeroExitCode`` and an ``ExitCode`` cause whose message is the code, which client-go
  parses as an unsigned 8-bit decimal (so ``256`` or ``-1`` is a protocol error, never a
  guess); or ``InternalError``.

:class:`ExecCollector` turns one exec's messages into an honest
:class:`~wsync.transports.base.ExecResult`: no Status, or a Status whose code does not parse,
or an InternalError, is ``exit_status=None`` (never 0).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import json
import re
import urllib.parse
from collections.abc import Sequence
from typing import Any

from wsync.errors import ProtocolError, UsageError
from wsync.protocol.records import printable
from wsync.transports.base import ExecResult

STDIN = 0
STDOUT = 1
STDERR = 2
ERROR = 3
RESIZE = 4
CLOSE = 255

V5 = "v5.channel.k8s.io"
V4 = "v4.channel.k8s.io"
V4_BASE64 = "v4.base64.channel.k8s.io"
#: what the client offers, best first (the server picks)
CLIENT_PROTOCOLS = (V5, V4, V4_BASE64)
BASE64_PROTOCOLS = frozenset({V4_BASE64, "base64.channel.k8s.io"})

#: DNS-1123 label (namespace) and subdomain (pod name), as the API server validates them
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def is_base64(protocol: str | None) -> bool:
    return protocol in BASE64_PROTOCOLS


def has_close(protocol: str | None) -> bool:
    """Only v5 can say "stdin ended" (kubernetes/kubernetes#89899)."""
    return protocol == V5


@dataclasses.dataclass(frozen=True, slots=True)
class Data:
    """Bytes on one channel (0-4)."""

    channel: int
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class Close:
    """v5 half-close of one channel."""

    channel: int


@dataclasses.dataclass(frozen=True, slots=True)
class Empty:
    """An empty message: ignored (binary) or the greeting on the lowest writable channel."""


Frame = Data | Close | Empty


# ---------------------------------------------------------------------- names/paths


def check_namespace(name: str) -> str:
    if len(name) > 63 or not _LABEL.fullmatch(name):
        raise UsageError(f"{name!r:.80} is not a Kubernetes namespace name (DNS-1123 label)")
    return name


def check_pod(name: str) -> str:
    if len(name) > 253 or not _SUBDOMAIN.fullmatch(name):
        raise UsageError(f"{name!r:.80} is not a Kubernetes pod name (DNS-1123 subdomain)")
    return name


def check_container(name: str) -> str:
    if len(name) > 63 or not _LABEL.fullmatch(name):
        raise UsageError(f"{name!r:.80} is not a Kubernetes container name (DNS-1123 label)")
    return name


def pod_path(namespace: str, pod: str) -> str:
    return f"/api/v1/namespaces/{check_namespace(namespace)}/pods/{check_pod(pod)}"


def exec_path(
    namespace: str, pod: str, argv: Sequence[str], *, container: str | None, stdin: bool
) -> str:
    """The exec request path; argv goes as repeated ``command`` parameters, never a string."""
    if not argv:
        raise UsageError("exec needs a command")
    query: list[tuple[str, str]] = []
    if container:
        query.append(("container", container))
    query += [("command", arg) for arg in argv]
    query += [
        ("stdin", "true" if stdin else "false"),
        ("stdout", "true"),
        ("stderr", "true"),
        ("tty", "false"),
    ]
    encoded = urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
    return f"{pod_path(namespace, pod)}/exec?{encoded}"


@dataclasses.dataclass(frozen=True, slots=True)
class ExecRequest:
    """What the server reads from an exec path (the emulator's side of :func:`exec_path`)."""

    namespace: str
    pod: str
    container: str | None
    argv: tuple[str, ...]
    stdin: bool
    stdout: bool
    stderr: bool
    tty: bool


def parse_pod_path(path: str) -> tuple[str, str, str] | None:
    """``(namespace, pod, subresource)`` of a pod URL path (subresource ``""`` or ``exec``)."""
    segments = urllib.parse.urlsplit(path).path.split("/")
    # "", "api", "v1", "namespaces", NS, "pods", POD[, SUB]
    if len(segments) not in (7, 8) or segments[:4] != ["", "api", "v1", "namespaces"]:
        return None
    if segments[5] != "pods":
        return None
    sub = segments[7] if len(segments) == 8 else ""
    return segments[4], segments[6], sub


def parse_exec_path(path: str) -> ExecRequest | None:
    """Parse an exec request path; None if it is not one.  A bad query raises ProtocolError."""
    found = parse_pod_path(path)
    if found is None or found[2] != "exec":
        return None
    namespace, pod, _ = found
    try:
        query = urllib.parse.parse_qsl(
            urllib.parse.urlsplit(path).query, keep_blank_values=True, errors="strict"
        )
    except (ValueError, UnicodeDecodeError) as err:
        raise ProtocolError(f"bad exec query: {err}") from None
    argv = tuple(v for k, v in query if k == "command")
    if not argv:
        raise ProtocolError("exec without command")
    flags = {k: v for k, v in query if k in ("stdin", "stdout", "stderr", "tty", "container")}
    return ExecRequest(
        namespace=namespace,
        pod=pod,
        container=flags.get("container") or None,
        argv=argv,
        stdin=flags.get("stdin") in ("true", "1"),
        stdout=flags.get("stdout") in ("true", "1"),
        stderr=flags.get("stderr") in ("true", "1"),
        tty=flags.get("tty") in ("true", "1"),
    )


# ---------------------------------------------------------------------- frames


def encode(channel: int, payload: bytes, protocol: str | None) -> bytes | str:
    """One message on ``channel``; text for the base64 protocols, binary otherwise."""
    if not 0 <= channel <= RESIZE:
        raise ValueError(f"not a data channel: {channel}")
    if is_base64(protocol):
        return chr(ord("0") + channel) + base64.b64encode(payload).decode("ascii")
    return bytes((channel,)) + payload


def encode_close(channel: int) -> bytes:
    """v5's half-close: ``[255, channel]`` (``[255, 0]`` is stdin EOF)."""
    if not 0 <= channel <= RESIZE:
        raise ValueError(f"not a data channel: {channel}")
    return bytes((CLOSE, channel))


def decode(message: bytes | str, protocol: str | None) -> Frame:
    """Decode one message; anything malformed is a :class:`ProtocolError` and nothing else."""
    if is_base64(protocol):
        if not isinstance(message, str):
            raise ProtocolError("binary message on a base64 channel protocol")
        if not message:
            return Empty()
        channel = ord(message[0]) - ord("0")
        if not 0 <= channel <= RESIZE:
            raise ProtocolError(f"unknown channel {message[0]!r:.10}")
        try:
            payload = base64.b64decode(message[1:].encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise ProtocolError("bad base64 in a channel message") from None
        return Data(channel, payload) if payload or len(message) > 1 else Data(channel, b"")
    if isinstance(message, str):
        raise ProtocolError("text message on a binary channel protocol")
    if not message:
        return Empty()
    channel = message[0]
    if channel == CLOSE:
        if not has_close(protocol):
            raise ProtocolError(f"CLOSE frame on {protocol or 'no protocol'}")
        if len(message) != 2 or message[1] > RESIZE:
            raise ProtocolError(f"CLOSE frame of {len(message)} bytes")
        return Close(message[1])
    if channel > RESIZE:
        raise ProtocolError(f"unknown channel {channel}")
    return Data(channel, bytes(message[1:]))


# ---------------------------------------------------------------------- status


@dataclasses.dataclass(frozen=True, slots=True)
class Status:
    """The channel-3 verdict, read honestly: ``exit_code`` None when it is not known."""

    exit_code: int | None
    reason: str
    message: str = ""


def _parse_uint8(text: Any) -> int | None:
    """client-go's ``strconv.ParseUint(msg, 10, 8)``: plain decimal digits, 0..255."""
    if not isinstance(text, str) or not text.isascii() or not text.isdigit() or len(text) > 3:
        return None
    value = int(text)
    return value if value <= 255 else None


def parse_status(payload: bytes) -> Status:
    """Parse the channel-3 ``metav1.Status``; unparsable JSON is a :class:`ProtocolError`."""
    try:
        doc = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError("channel-3 status is not JSON") from None
    if not isinstance(doc, dict):
        raise ProtocolError("channel-3 status is not a JSON object")
    status = doc.get("status")
    reason = str(doc["reason"]) if isinstance(doc.get("reason"), str) else ""
    message = str(doc["message"]) if isinstance(doc.get("message"), str) else ""
    if status == "Success":
        return Status(0, "Success", message)
    if status != "Failure":
        raise ProtocolError(f"channel-3 status {status!r:.40}")
    if reason == "NonZeroExitCode":
        details = doc.get("details")
        causes = details.get("causes") if isinstance(details, dict) else None
        codes = [
            c.get("message")
            for c in (causes if isinstance(causes, list) else [])
            if isinstance(c, dict) and c.get("reason") == "ExitCode"
        ]
        code = _parse_uint8(codes[0]) if len(codes) == 1 else None
        if code is None:
            return Status(None, "BadExitCode", f"exit code causes {codes!r:.80}")
        return Status(code, reason, message)
    return Status(None, reason or "Failure", message)


def encode_status(exit_code: int | str | None, *, reason: str | None = None) -> bytes:
    """The Status a kubelet sends: Success for 0, NonZeroExitCode with the code as its cause,
    or (``reason="InternalError"``) a 500.  A str code is sent verbatim (the fault knob)."""
    if reason == "InternalError":
        doc: dict[str, Any] = {
            "metadata": {},
            "status": "Failure",
            "message": "Internal error occurred: error executing command in container: "
            "failed to exec in container",
            "reason": "InternalError",
            "details": {"causes": [{"message": "error executing command in container"}]},
            "code": 500,
        }
    elif exit_code == 0:
        doc = {"metadata": {}, "status": "Success"}
    else:
        doc = {
            "metadata": {},
            "status": "Failure",
            "message": f"command terminated with non-zero exit code: exit status {exit_code}",
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": str(exit_code)}]},
        }
    return json.dumps(doc, separators=(",", ":")).encode()


# ---------------------------------------------------------------------- collector


#: parses of a split channel-3 status at most (see ExecCollector.feed)
_STATUS_TRIES = 8


class ExecCollector:
    """One exec's messages → an :class:`ExecResult`, honestly.

    Feed every message to :meth:`feed`, then :meth:`closed` or :meth:`drain_expired`, then
    :meth:`result`.  stdout and stderr each keep at most ``max_output`` bytes.
    """

    def __init__(self, max_output: int, protocol: str | None) -> None:
        if max_output < 0:
            raise ValueError("max_output must be >= 0")
        self.max_output = max_output
        self.protocol = protocol
        self._out: dict[int, bytearray] = {STDOUT: bytearray(), STDERR: bytearray()}
        self._status_buf = bytearray()
        self._status_tries = 0
        self.status: Status | None = None
        self.truncated = False
        self._notes: list[str] = []

    @property
    def exited(self) -> bool:
        return self.status is not None

    def note(self, text: str) -> None:
        if text not in self._notes:
            self._notes.append(text)

    def feed(self, message: bytes | str) -> Frame:
        frame = decode(message, self.protocol)
        if isinstance(frame, Close):
            return frame
        if not isinstance(frame, Data):
            return frame
        if frame.channel in (STDOUT, STDERR):
            if self.exited and frame.data:
                self.note("data after status")
            buf = self._out[frame.channel]
            room = self.max_output - len(buf)
            if len(frame.data) > room:
                self.truncated = True
            buf += frame.data[: max(room, 0)]
        elif frame.channel == ERROR:
            if self.exited:
                if frame.data:
                    self.note("second status ignored")
                return frame
            self._status_buf += frame.data
            if len(self._status_buf) > 64 * 1024:
                raise ProtocolError("channel-3 status over 64 KiB")
            # the kubelet writes the Status in one message, but a split one is
            # parsed once whole; whatever never parses stays "no status".  Tried where a
            # piece ends an object, a few times at most: a status sent a byte a message
            # was parsed again at each (64 KiB of nesting held the loop for 17 s)
            if self._status_tries < _STATUS_TRIES and frame.data.rstrip().endswith(b"}"):
                self._status_tries += 1
                with contextlib.suppress(ProtocolError):
                    self._end_status()
        elif frame.channel in (STDIN, RESIZE):
            raise ProtocolError(f"server sent data on channel {frame.channel}")
        return frame

    def _end_status(self) -> None:
        if self.status is None and self._status_buf:
            self.status = parse_status(bytes(self._status_buf))
            if self.status.exit_code is None:
                said = printable(f"{self.status.reason}: {self.status.message}", 140)
                self.note(f"status {said}")

    def closed(self, code: int | None, *, clean: bool) -> None:
        if not self.exited and self._status_buf:
            # once more, whole: a status split past the tries (see feed) still counts
            with contextlib.suppress(ProtocolError):
                self._end_status()
        if not self.exited and self._status_buf:
            self.note(f"unparsable status {bytes(self._status_buf)!r:.80}")
        elif not self.exited:
            self.note(f"closed without a status (code {code})")
        elif not clean:
            self.note(f"connection dropped after the status (code {code})")

    def drain_expired(self) -> None:
        self.note("drain deadline passed before close")

    def result(self) -> ExecResult:
        return ExecResult(
            stdout=bytes(self._out[STDOUT]),
            stderr=bytes(self._out[STDERR]),
            exit_status=self.status.exit_code if self.status is not None else None,
            truncated=self.truncated,
            notes=tuple(self._notes),
        )
