"""The guest's manifest: one record per workspace entry, parsed without I/O (h11 style).

The producer's ``manifest`` mode writes, instead of a tar, one record per entry of the
workspace as its data stream (compressed, chunk-indexed and hashed like an archive, so
every byte here was verified before it is parsed).  A record is three NUL-terminated
fields::

    KIND MODE SIZE MTIME CTIME INO [DIGEST] \\0 PATH \\0 TARGET \\0

- ``KIND``: one letter as GNU ``find -printf %y`` prints it (``f d l p c b s``);
- ``MODE``: the permission bits in octal (``%m``);
- ``SIZE``: decimal bytes;
- ``MTIME``/``CTIME``: decimal seconds with an optional fraction and sign (``%T@``; busybox
  ``stat -c %Y`` gives whole seconds); ``CTIME`` and ``INO`` are ``0`` where unknown;
- ``DIGEST``: a content hash, only from guests that cannot give ctime and inode;
- ``PATH``: ``.`` or ``./``-prefixed, as ``find .`` prints it, any byte but NUL;
- ``TARGET``: a symlink's target, empty otherwise.

The guest is hostile: the parser bounds every field, accepts nothing it cannot read
exactly, and raises :class:`~wsync.errors.ProtocolError` and nothing else on bad input.
Path *meaning* (``..``, empty components) is judged by the host state
(:func:`wsync.engine.incstate.check_path`), not here.
"""

from __future__ import annotations

import dataclasses

from wsync.errors import ProtocolError

#: longest header, path or target accepted (bytes)
MAX_HEADER = 512
MAX_NAME = 64 * 1024
KINDS = frozenset("fdlpcbs")

_KINDS = {k.encode(): k for k in KINDS}
_NS = 1_000_000_000
_DIGEST_CHARS = frozenset(b"0123456789abcdef")


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One workspace entry as the guest saw it (paths relative, ``b"."`` is the root)."""

    path: bytes
    kind: str
    mode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    target: bytes
    digest: str = ""


def parse_time(text: bytes) -> int:
    """``b"1700000000.1234567890"`` → nanoseconds (digits beyond 9 are dropped, not
    rounded: the same guest always prints the same digits, which is all a diff needs)."""
    negative = text[:1] == b"-"
    whole, _, frac = (text[1:] if negative else text).partition(b".")
    if not whole.isdigit() or len(whole) > 20 or len(frac) > 20 or (frac and not frac.isdigit()):
        raise ProtocolError(f"malformed manifest time: {text[:40]!r}")
    ns = int(whole) * _NS + (int(frac[:9].ljust(9, b"0")) if frac else 0)
    return -ns if negative else ns


def _number(text: bytes, base: int = 10) -> int:
    if not text.isdigit() or len(text) > 20:
        raise ProtocolError(f"malformed manifest number: {text[:40]!r}")
    try:
        return int(text, base)
    except ValueError:
        raise ProtocolError(f"malformed manifest number: {text[:40]!r}") from None


def _path(raw: bytes) -> bytes:
    if raw == b".":
        return raw
    if not raw.startswith(b"./") or len(raw) == 2:
        raise ProtocolError(f"manifest path not under '.': {raw[:80]!r}")
    return raw[2:]


class ManifestParser:
    """Feed bytes with :meth:`receive_data`, take records with :meth:`entries`."""

    def __init__(self) -> None:
        self._tail = b""
        self._fields: list[bytes] = []
        self._ready: list[Entry] = []
        self._eof = False
        self.count = 0

    def receive_data(self, data: bytes) -> None:
        if self._eof:
            raise ProtocolError("manifest data after its end")
        if b"\0" not in data:
            self._tail += data
            if len(self._tail) > MAX_NAME:
                raise ProtocolError("manifest field too long")
            return
        fields = (self._tail + data).split(b"\0")
        self._tail = fields.pop()
        if len(self._tail) > MAX_NAME:
            raise ProtocolError("manifest field too long")
        if self._fields:
            fields = self._fields + fields
        whole = len(fields) - len(fields) % 3
        record = self._record
        self._ready.extend(
            [record(fields[i], fields[i + 1], fields[i + 2]) for i in range(0, whole, 3)]
        )
        self._fields = fields[whole:]

    def _record(self, header: bytes, raw_path: bytes, target: bytes) -> Entry:
        parts = header.split(b" ")
        kind = _KINDS.get(parts[0])
        if len(header) > MAX_HEADER or kind is None or len(parts) not in (6, 7):
            raise ProtocolError(f"malformed manifest record: {header[:80]!r}")
        if len(raw_path) > MAX_NAME or len(target) > MAX_NAME:
            raise ProtocolError("manifest field too long")
        if (kind == "l") != bool(target):
            raise ProtocolError(f"manifest link target mismatch: {header[:80]!r}")
        digest = parts[6] if len(parts) == 7 else b""
        if digest and (len(digest) > 128 or not _DIGEST_CHARS.issuperset(digest)):
            raise ProtocolError(f"malformed manifest digest: {header[:80]!r}")
        mode = parts[1]
        if len(mode) > 6:
            raise ProtocolError(f"malformed manifest mode: {header[:80]!r}")
        self.count += 1
        return Entry(
            _path(raw_path),
            kind,
            _number(mode, 8) & 0o7777,
            _number(parts[2]),
            parse_time(parts[3]),
            parse_time(parts[4]),
            _number(parts[5]),
            target,
            digest.decode(),
        )

    def entries(self) -> list[Entry]:
        """The complete records parsed so far (each returned once)."""
        ready, self._ready = self._ready, []
        return ready

    def receive_eof(self) -> None:
        self._eof = True
        if self._tail or self._fields:
            raise ProtocolError("manifest ends inside a record", fault="truncated")
