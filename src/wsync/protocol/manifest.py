"""The guest's manifest: one record per workspace entry, parsed without I/O (h11 style).

The producer's ``manifest`` mode writes, instead of a tar, one record per entry of the
workspace as its data stream (compressed, chunk-indexed and hashed like an archive, so
every byte here was verified before it is parsed).  A record is three NUL-terminated
fields::

    KIND MODE SIZE MTIME CTIME INO[:DEV] [DIGEST] \\0 PATH \\0 TARGET \\0

- ``KIND``: one letter as GNU ``find -printf %y`` prints it (``f d l p c b s``);
- ``MODE``: the permission bits in octal (``%m``);
- ``SIZE``: decimal bytes;
- ``MTIME``/``CTIME``: decimal seconds with an optional fraction and sign (``%T@``; busybox
  ``stat -c %Y`` gives whole seconds); the sign is the whole seconds' alone, the fraction
  counts forward from them (``-2.25`` is 1.75 s before the epoch, as ``find`` prints it);
  ``CTIME`` and ``INO`` are ``0`` where unknown;
- ``DEV``: the device the entry is on (``st_dev``, decimal; GNU ``find %D``, ``stat %d``).
  An inode number names a file only within its filesystem: a workspace that holds a
  mount (a volume, a bind mount, a btrfs subvolume) has files of one inode number on two
  devices, which must never be taken for one file's links.  So :attr:`Entry.ino` is the
  inode number for an entry on the workspace root's device (the first record, ``.``, as
  ``find .`` prints it first) and ``DEV << 64 | INO`` for one on any other: one number
  per file, the same as before devices were listed wherever the workspace is one
  filesystem (the state recorded then stays valid);
- ``DIGEST``: a content hash, only from guests that cannot give ctime and inode;
- ``PATH``: ``.`` or ``./``-prefixed, as ``find .`` prints it, any byte but NUL;
- ``TARGET``: a symlink's target, empty otherwise.

The guest is hostile: the parser bounds every field, accepts nothing it cannot read
exactly, and raises :class:`~wsync.errors.ProtocolError` and nothing else on bad input.
Path *meaning* (``..``, empty components) is judged by the host state
(:func:`wsync.engine.incload.check_path`), not here.

**Known records.**  Most records of a workspace's manifest are byte for byte the ones the
last pull read.  Given the fingerprints of those (``known``: xxh3_128 of the record's three
fields, which the host state keeps beside each entry it recorded), the parser does not parse
a record it finds among them: it removes the fingerprint from ``known`` and counts it in
:attr:`Known.matched`; what is left in ``known`` at the end is what the guest no
longer lists as it was.  Every other record is parsed and checked as ever, and carries its
fingerprint (:attr:`Entry.record`) for the state to keep.  A matched record was parsed and
checked when it was first read (the same bytes); hashing is a tenth of the parse.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import xxhash

from wsync.errors import ProtocolError

#: longest header, path or target accepted (bytes)
MAX_HEADER = 512
MAX_NAME = 64 * 1024
KINDS = frozenset("fdlpcbs")

_KINDS = {k.encode(): k for k in KINDS}
_NS = 1_000_000_000
#: a whole header, every field bounded (numbers up to 20 digits, a mode up to 6); one C-level
#: match validates and splits it (the parser's cost per record is mostly this and the
#: int() calls: a workspace of a million entries is a million records)
_HEADER = re.compile(
    rb"([fdlpcbs]) ([0-7]{1,6}) ([0-9]{1,20})"
    rb" (-?[0-9]{1,20})(?:\.([0-9]{0,20}))? (-?[0-9]{1,20})(?:\.([0-9]{0,20}))?"
    rb" ([0-9]{1,20})(?::([0-9]{1,20}))?(?: ([0-9a-f]{0,128}))?"
)
_PAD = b"000000000"


class Entry(NamedTuple):
    """One workspace entry as the guest saw it (paths relative, ``b"."`` is the root).

    A NamedTuple, not a frozen dataclass: it is made once per record, and a frozen
    dataclass's ``__init__`` costs more than the rest of the record's parse."""

    path: bytes
    kind: str
    mode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    #: names the file within the workspace: its inode number, with its device where that
    #: is not the root's (see DEV in the module docstring); 0 where unknown
    ino: int
    target: bytes
    digest: str = ""
    #: the record's fingerprint (see the module docstring), ``b""`` when not asked for
    record: bytes = b""


def fingerprint(header: bytes, path: bytes, target: bytes) -> bytes:
    """The fingerprint of one record, from its three fields as the guest wrote them."""
    return xxhash.xxh3_128_digest(b"\0".join((header, path, target)))


class Known:
    """Records read before, by fingerprint (see the module docstring): the parser takes
    each out of :attr:`left` as it meets it, and counts it in :attr:`matched`."""

    def __init__(self, records: set[bytes]) -> None:
        self.left = records
        self.matched = 0


def parse_time(text: bytes) -> int:
    """``b"1700000000.1234567890"`` → nanoseconds (digits beyond 9 are dropped, not
    rounded: the same guest always prints the same digits, which is all a diff needs).

    As GNU ``find -printf %T@`` prints a time: the whole seconds, signed (the floor), then
    the fraction, which counts forward: ``-2.25`` is 1.75 s before the epoch (``touch -d
    @-1.75`` makes it), not 2.25 s."""
    whole, _, frac = text.partition(b".")
    digits = whole[1:] if whole[:1] == b"-" else whole
    if not digits.isdigit() or len(digits) > 20 or len(frac) > 20 or (frac and not frac.isdigit()):
        raise ProtocolError(f"malformed manifest time: {text[:40]!r}")
    return _ns(whole, frac[:9].ljust(9, b"0"))


def _ns(whole: bytes, frac9: bytes) -> int:
    """Nanoseconds of signed whole seconds and a 9-digit fraction that counts forward."""
    if whole[:1] != b"-":
        return int(whole + frac9)  # one int() for the common case: the parser's hot path
    return int(whole) * _NS + int(frac9)


def _on_device(dev: bytes, ino: bytes) -> int:
    """The number of inode ``ino`` of device ``dev``, not the workspace root's (see DEV in
    the module docstring); 0 (unknown) stays 0."""
    number = int(ino)
    return int(dev) << 64 | number if number else 0


class ManifestParser:
    """Feed bytes with :meth:`receive_data`, take records with :meth:`entries`.

    With ``known`` every record is fingerprinted, and a known one is taken out of it
    instead of parsed (see the module docstring); :attr:`count` counts every record."""

    def __init__(self, known: Known | None = None) -> None:
        self._tail = b""
        self._fields: list[bytes] = []
        self._ready: list[Entry] = []
        self._eof = False
        self._known = known
        self.count = 0
        #: the workspace root's device (DEV of the first record, ``.``), once seen
        self._root_dev: bytes | None = None

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
        self._fields = fields[whole:]
        self._records(fields, whole)

    def _records(self, fields: list[bytes], whole: int) -> None:
        """Parse the records of ``fields[:whole]`` (header, path, target each) into
        :attr:`_ready`.  Written as one loop with the work inlined: this is the hot path."""
        ready = self._ready
        match = _HEADER.fullmatch
        kinds = _KINDS
        pad = _PAD
        new = tuple.__new__  # Entry's own __new__ adds a Python call per record
        fingerprints = self._known is not None
        known = self._known.left if self._known is not None else set()
        matched = 0
        record = b""
        if self._root_dev is None and whole:
            # from the header even where the record is known (not parsed below)
            first = match(fields[0]) if len(fields[0]) <= MAX_HEADER else None
            self._root_dev = (first.group(9) or b"") if first and fields[1] == b"." else b""
        root_dev = self._root_dev
        triples = iter(fields)  # zip stops before a partial triple (kept in _fields)
        for header, raw, target in zip(triples, triples, triples, strict=False):
            if fingerprints:
                record = fingerprint(header, raw, target)
                if record in known:
                    known.discard(record)
                    matched += 1
                    continue
            m = match(header) if len(header) <= MAX_HEADER else None
            if m is None:
                raise ProtocolError(f"malformed manifest record: {header[:80]!r}")
            kind, mode, size, mt, mf, ct, cf, ino, dev, digest = m.groups()
            if (kind == b"l") != bool(target):
                raise ProtocolError(f"manifest link target mismatch: {header[:80]!r}")
            if len(raw) > MAX_NAME or len(target) > MAX_NAME:
                raise ProtocolError("manifest field too long")
            if raw[:2] == b"./" and len(raw) > 2:
                path = raw[2:]
            elif raw == b".":
                path = raw
            else:
                raise ProtocolError(f"manifest path not under '.': {raw[:80]!r}")
            ready.append(
                new(
                    Entry,
                    (
                        path,
                        kinds[kind],
                        int(mode, 8) & 0o7777,
                        int(size),
                        _ns(mt, mf[:9] + pad[len(mf) :] if mf else pad),
                        _ns(ct, cf[:9] + pad[len(cf) :] if cf else pad),
                        int(ino) if not dev or dev == root_dev else _on_device(dev, ino),
                        target,
                        digest.decode() if digest else "",
                        record,
                    ),
                )
            )
        self.count += whole // 3
        if self._known is not None:
            self._known.matched += matched

    def entries(self) -> list[Entry]:
        """The complete records parsed so far (each returned once)."""
        ready, self._ready = self._ready, []
        return ready

    def receive_eof(self) -> None:
        self._eof = True
        if self._tail or self._fields:
            raise ProtocolError("manifest ends inside a record", fault="truncated")


class ListedBytes:
    """The sum of the regular files' sizes in a manifest stream fed in any split.

    What a guest's room check needs before the manifest is loaded (a pull without a
    baseline loads it late, while the content run goes on: see
    :mod:`wsync.engine.incphases`).  Only the headers' kind and size are looked at, a
    tenth of :class:`ManifestParser`'s work; the load parses everything afterwards.
    Raises :class:`~wsync.errors.ProtocolError` where a size is no number or a field
    runs past the parser's bounds (the caller then lets the guest measure).
    """

    def __init__(self) -> None:
        self.total = 0
        self._field = 0  # the field the next one starts: 0 header, 1 path, 2 target
        self._rest = b""

    def receive_data(self, data: bytes) -> None:
        parts = (self._rest + data).split(b"\0")
        self._rest = parts.pop()
        if len(self._rest) > MAX_NAME + MAX_HEADER:
            raise ProtocolError("a manifest field past its bound")
        for header in parts[-self._field % 3 :: 3]:
            if header[:2] == b"f ":
                size = header.split(b" ", 3)[2:3]
                if not size or not size[0].isdigit() or len(size[0]) > 20:
                    raise ProtocolError(f"bad manifest header {header[:80]!r}")
                self.total += int(size[0])
        self._field = (self._field + len(parts)) % 3
