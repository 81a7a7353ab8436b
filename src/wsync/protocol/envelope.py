"""The envelope: how one exec's output proves it is whole.

Theory of operation
-------------------
Exec channels lie (see ``docs/design.md``): they drop the head of the output,
drop the tail, splice stderr into stdout, append frames after the exit frame,
or report exit 0 for a stream that was cut.  So no exec output is believed
unless it is wrapped like this::

    WSYNC1 BEGIN <nonce> <status> <length> <encoding>\\n
    <payload: exactly length bytes (raw) or base64 text of them in lines (b64)>
    \\nWSYNC1 END <nonce> <hash>\\n

* ``nonce`` is fresh random hex per call, chosen by the host: output from any
  other call (a retry, a replayed history buffer) cannot match.
* ``length`` fixes where the payload ends, so bytes lost or added *inside* the
  payload shift the trailer and are caught ("trailer-mismatch").
* ``hash`` is the guest's digest of the payload, checked by the host
  ("hash-mismatch" catches bit flips that keep the length).
* A missing header (head lost) is "no-envelope"; end of output before the
  trailer is "truncated".  Bytes before the header or after the trailer are
  tolerated and counted (``noise``, ``trailing``): they cannot alter a
  payload whose length and hash are both verified.
* ``status`` is ``ok`` or ``err``; an ``err`` payload is a one-line reason
  from the guest script (e.g. "short-file").
* ``b64`` is for text channels, which decode output lossily, add newlines and
  cut long lines: base64 in lines of 76 characters, as ``base64`` prints it.
  Its payload ends where the trailer begins; whitespace in it is dropped, and
  then the decoded length and hash are checked as for ``raw``.  Its wire size
  is bounded by :func:`wire_length` ("oversize" beyond).

The parser is sans-I/O in the style of h11 and websockets: feed it bytes with
:meth:`EnvelopeParser.receive_data` (in any split, one byte at a time works),
call :meth:`EnvelopeParser.receive_eof`, then take :meth:`EnvelopeParser.result`.
It raises :class:`~wsync.errors.ProtocolError` and nothing else on bad input.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum

from wsync.digits import figure
from wsync.errors import ProtocolError
from wsync.protocol.hashing import Algorithm

MAGIC = b"WSYNC1"
_MAX_HEADER = 256
_MAX_TRAILER_HASH = 160


class State(enum.Enum):
    SEEK = "seek"  # looking for the header
    HEADER = "header"  # header found, waiting for its newline
    PAYLOAD = "payload"  # collecting the payload bytes
    TRAILER = "trailer"  # collecting the trailer line
    DONE = "done"  # trailer parsed; anything more is trailing noise


@dataclasses.dataclass(frozen=True, slots=True)
class Envelope:
    ok: bool
    payload: bytes
    digest: str
    noise: int = 0
    trailing: int = 0

    @property
    def text(self) -> str:
        return self.payload.decode("utf-8", "replace")


def wire_length(length: int, encoding: str) -> int:
    """Most payload bytes on the wire for ``length`` payload bytes.

    ``b64`` allows a line break of up to two bytes (``\\r\\n``) per 76 characters, and a
    few more, since text channels were seen to add them.
    """
    if encoding == "raw":
        return length
    text = 4 * ((length + 2) // 3)
    return text + 2 * (text // 76) + 64


def trailer_prefix(nonce: str) -> bytes:
    """How the trailer line of call ``nonce`` starts (its hash and a newline follow)."""
    return b"\n" + MAGIC + b" END " + nonce.encode("ascii") + b" "


class EnvelopeParser:
    """Incremental parser for one envelope identified by ``nonce``."""

    def __init__(
        self,
        nonce: str,
        *,
        algorithm: Algorithm | None,
        max_length: int,
        allow_unhashed: bool = False,
    ) -> None:
        self._begin = MAGIC + b" BEGIN " + nonce.encode("ascii") + b" "
        self._end = trailer_prefix(nonce)
        self._algorithm = algorithm
        #: accept a ``-`` trailer (a guest without the hash tool; the probe only)
        self._allow_unhashed = allow_unhashed
        self._max_length = max_length
        self._buf = bytearray()
        self.state = State.SEEK
        self._ok = False
        self._length = 0
        self._encoding = "raw"
        self._wire_length = 0
        self._payload = bytearray()
        self._digest = ""
        self.noise = 0
        self.trailing = 0
        self._eof = False
        self._result: Envelope | None = None

    # -- feeding -------------------------------------------------------------

    def receive_buffer(self, buf: bytearray) -> None:
        """:meth:`receive_data`, taking ``buf`` over instead of copying it: the caller
        gives it up.  When ``buf`` holds a whole raw envelope it is cut in place and
        becomes the payload, so a helper's 4 MiB answer reaches :meth:`result` without
        a copy on the way; otherwise (base64, or the payload only in part) the parser
        copies out of it as :meth:`receive_data` would."""
        if self._buf or self._eof or self.state is State.DONE:
            self.receive_data(buf)
            return
        self._buf = buf
        self._advance()

    def receive_data(self, data: bytes | bytearray) -> None:
        if self._eof:
            raise ProtocolError("data after end of output", "malformed")
        if self.state is State.DONE:
            self.trailing += len(data)
            return
        self._buf += data
        self._advance()

    def receive_eof(self) -> None:
        self._eof = True

    # -- results -------------------------------------------------------------

    def result(self) -> Envelope:
        """The verified envelope; raises ProtocolError if it is not complete."""
        if self.state is not State.DONE:
            raise self._incomplete()
        if self._result is not None:
            # bytes that arrived after the first call still count as trailing
            return dataclasses.replace(self._result, trailing=self.trailing)
        payload = bytes(self._payload)
        if self._encoding == "b64":
            try:
                payload = base64.b64decode(payload.translate(None, b" \t\r\n"), validate=True)
            except (binascii.Error, ValueError):
                raise ProtocolError("payload is not valid base64", "trailer-mismatch") from None
        if len(payload) != self._length:
            raise ProtocolError(
                f"payload is {len(payload)} bytes, header said {self._length}", "trailer-mismatch"
            )
        if self._digest == "-" and self._allow_unhashed:
            pass
        elif self._algorithm is not None:
            actual = self._algorithm.digest(payload)
            if actual != self._digest:
                raise ProtocolError(
                    f"payload hash {actual[:16]}… != trailer {self._digest[:16]}…", "hash-mismatch"
                )
        self._result = Envelope(self._ok, payload, self._digest, self.noise, self.trailing)
        self._payload = bytearray()  # copied into the result: a chunk read's buffer goes
        return self._result

    def _incomplete(self) -> ProtocolError:
        if self.state is State.SEEK:
            return ProtocolError("no envelope header in output (head lost?)", "no-envelope")
        if self.state is State.HEADER:
            return ProtocolError("output ends inside the envelope header", "truncated")
        have = len(self._payload)
        return ProtocolError(
            f"output ends early ({self.state.value}, {have} of {self._wire_length} payload bytes)",
            "truncated",
        )

    # -- the state machine ---------------------------------------------------

    def _advance(self) -> None:
        while True:
            before = self.state
            if self.state is State.SEEK:
                self._seek()
            elif self.state is State.HEADER:
                self._header()
            elif self.state is State.PAYLOAD:
                self._take_payload()
            elif self.state is State.TRAILER:
                self._trailer()
            if self.state is State.DONE:
                self.trailing += len(self._buf)
                self._buf.clear()
                return
            if self.state is before:
                return

    def _seek(self) -> None:
        at = self._buf.find(self._begin)
        if at < 0:
            keep = len(self._begin) - 1
            if len(self._buf) > keep:
                cut = len(self._buf) - keep
                self.noise += cut
                del self._buf[:cut]
            return
        self.noise += at
        del self._buf[: at + len(self._begin)]
        self.state = State.HEADER

    def _header(self) -> None:
        nl = self._buf.find(b"\n")
        if nl < 0:
            if len(self._buf) > _MAX_HEADER:
                raise ProtocolError("envelope header too long", "malformed")
            return
        line = bytes(self._buf[:nl]).removesuffix(b"\r")  # text channels may add CRs
        del self._buf[: nl + 1]
        fields = line.split(b" ")
        if len(fields) != 3:
            raise ProtocolError(f"bad envelope header {line[:80]!r}", "malformed")
        status, length, encoding = fields
        if status not in (b"ok", b"err") or encoding not in (b"raw", b"b64"):
            raise ProtocolError(f"bad envelope header {line[:80]!r}", "malformed")
        size = figure(length)
        if size is None:
            raise ProtocolError(f"bad envelope length {length[:40]!r}", "malformed")
        self._length = size
        if self._length > self._max_length:
            raise ProtocolError(
                f"envelope length {self._length} exceeds {self._max_length}", "oversize"
            )
        self._ok = status == b"ok"
        self._encoding = encoding.decode("ascii")
        self._wire_length = wire_length(self._length, self._encoding)
        self.state = State.PAYLOAD

    def _take_payload(self) -> None:
        if self._encoding == "b64":
            self._take_lines()
            return
        need = self._wire_length - len(self._payload)
        take = min(need, len(self._buf))
        if take and not self._payload and take == need:
            # the whole payload is buffered: the buffer becomes the payload and only what
            # follows it (the trailer) is copied, not the payload (4 MiB for a chunk read)
            rest = self._buf[take:]
            del self._buf[take:]
            self._payload, self._buf = self._buf, rest
        elif take:
            # through a view: a 4 MiB chunk is not copied once more into a temporary
            with memoryview(self._buf) as view:
                self._payload += view[:take]
            del self._buf[:take]
        if len(self._payload) == self._wire_length:
            self.state = State.TRAILER

    def _take_lines(self) -> None:
        """b64: the payload runs up to the trailer, at most ``_wire_length`` bytes."""
        at = self._buf.find(self._end)
        take = at if at >= 0 else max(0, len(self._buf) - len(self._end) + 1)
        if len(self._payload) + take > self._wire_length:
            raise ProtocolError(
                f"base64 payload longer than {self._wire_length} bytes", "trailer-mismatch"
            )
        if take:
            self._payload += self._buf[:take]
            del self._buf[:take]
        if at >= 0:
            self.state = State.TRAILER

    def _trailer(self) -> None:
        prefix = self._end
        have = bytes(self._buf[: len(prefix)])
        if not prefix.startswith(have):
            raise ProtocolError(
                "envelope trailer not where the length says (bytes lost or added)",
                "trailer-mismatch",
            )
        if len(self._buf) < len(prefix):
            return
        nl = self._buf.find(b"\n", len(prefix))
        if nl < 0:
            if len(self._buf) - len(prefix) > _MAX_TRAILER_HASH:
                raise ProtocolError("envelope trailer too long", "malformed")
            return
        token = bytes(self._buf[len(prefix) : nl]).removesuffix(b"\r")
        if not token or not all(c in b"0123456789abcdef-" for c in token):
            raise ProtocolError(f"bad trailer hash {token[:40]!r}", "malformed")
        self._digest = token.decode("ascii")
        del self._buf[: nl + 1]
        self.state = State.DONE


def parse_envelope(
    output: bytes, nonce: str, *, algorithm: Algorithm | None, max_length: int
) -> Envelope:
    """Parse a whole exec output (convenience for the common case)."""
    parser = EnvelopeParser(nonce, algorithm=algorithm, max_length=max_length)
    parser.receive_data(output)
    parser.receive_eof()
    return parser.result()


def render_envelope(
    nonce: str, payload: bytes, *, algorithm: Algorithm | None, ok: bool = True, b64: bool = False
) -> bytes:
    """What a well-behaved guest prints; used by tests and emulators."""
    digest = algorithm.digest(payload) if algorithm is not None else "-"
    body = base64.encodebytes(payload) if b64 else payload
    status = b"ok" if ok else b"err"
    encoding = b"b64" if b64 else b"raw"
    fields = (MAGIC, b"BEGIN", nonce.encode(), status, str(len(payload)).encode(), encoding)
    trailer = b"\n" + MAGIC + b" END " + nonce.encode() + b" " + digest.encode() + b"\n"
    return b" ".join(fields) + b"\n" + body + trailer
