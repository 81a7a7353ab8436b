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
import re

from wsync.errors import ProtocolError

#: longest header, path or target accepted (bytes)
MAX_HEADER = 512
MAX_NAME = 64 * 1024
KINDS = frozenset("fdlpcbs")

_HEADER = re.compile(
    rb"([fdlpcbs]) ([0-7]{1,6}) ([0-9]{1,20}) (-?[0-9]{1,20}(?:\.[0-9]{0,20})?)"
    rb" (-?[0-9]{1,20}(?:\.[0-9]{0,20})?) ([0-9]{1,20})(?: ([0-9a-f]{8,128}))?"
)
_NS = 1_000_000_000


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
    negative = text.startswith(b"-")
    whole, _, frac = text.lstrip(b"-").partition(b".")
    ns = int(whole) * _NS + int((frac[:9] or b"0").ljust(9, b"0"))
    return -ns if negative else ns


def _path(raw: bytes) -> bytes:
    if raw == b".":
        return raw
    if not raw.startswith(b"./") or len(raw) == 2:
        raise ProtocolError(f"manifest path not under '.': {raw[:80]!r}")
    return raw[2:]


class ManifestParser:
    """Feed bytes with :meth:`receive_data`, take records with :meth:`entries`."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._fields: list[bytes] = []
        self._ready: list[Entry] = []
        self._eof = False
        self.count = 0

    def receive_data(self, data: bytes) -> None:
        if self._eof:
            raise ProtocolError("manifest data after its end")
        self._buf += data
        buf = self._buf
        start = 0
        while True:
            limit = MAX_HEADER if not self._fields else MAX_NAME
            end = buf.find(b"\0", start, start + limit + 1)
            if end < 0:
                if len(buf) - start > limit:
                    raise ProtocolError("manifest field too long")
                break
            self._fields.append(bytes(buf[start:end]))
            start = end + 1
            if len(self._fields) == 3:
                self._ready.append(self._record(*self._fields))
                self._fields = []
        del buf[:start]

    def _record(self, header: bytes, raw_path: bytes, target: bytes) -> Entry:
        match = _HEADER.fullmatch(header)
        if match is None:
            raise ProtocolError(f"malformed manifest record: {header[:80]!r}")
        kind, mode, size, mtime, ctime, ino, digest = match.groups()
        if (kind == b"l") != bool(target):
            raise ProtocolError(f"manifest link target mismatch: {header[:80]!r}")
        self.count += 1
        return Entry(
            path=_path(raw_path),
            kind=kind.decode(),
            mode=int(mode, 8) & 0o7777,
            size=int(size),
            mtime_ns=parse_time(mtime),
            ctime_ns=parse_time(ctime),
            ino=int(ino),
            target=target,
            digest=(digest or b"").decode(),
        )

    def entries(self) -> list[Entry]:
        """The complete records parsed so far (each returned once)."""
        ready, self._ready = self._ready, []
        return ready

    def receive_eof(self) -> None:
        self._eof = True
        if self._buf or self._fields:
            raise ProtocolError("manifest ends inside a record", fault="truncated")
