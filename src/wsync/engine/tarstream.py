"""The tar stream reader: the extractor's input parsed into members, every short read an error.

The guest is hostile (docs/design.md, guarantee 5), so nothing in the archive is trusted.  Python's
``tarfile`` is not used to read it, nor imported: headers, the stream and the pax
and GNU long-name records are parsed here, because ``tarfile``

* treats an invalid or short header in mid-archive as a normal end of archive, so a truncated
  or corrupted stream "succeeds" with part of the tree;
* reads a pax or GNU long-name record of any declared size into memory (a memory bomb), and
  recurses once per chained extended header;
* reads some headers differently from GNU tar (numbers, the ustar prefix, names ending in
  ``/``; :func:`parse_header` lists them), and this Python (3.11.7) predates the 2025 fixes
  to its extraction filters.

The reference is GNU tar, which the guest runs: an archive is read as GNU tar reads it, or
refused (``tests/test_extract_corpus.py`` compares the two trees on crafted archives).

Refused here: bad headers, an extended header larger than 1 MiB, repeated or dangling extended
headers, malformed pax records, pax sparse files, more than 1 MiB of zeros after an
end-of-archive marker, and a stream that ends without one.  A stream may hold several archives
one after the other (the producer appends archives of files it read again); each member says
which archive it came from, and the extractor decides what a later one may do.  Truncation is
reported as :class:`HostileArchive` ("truncated"): the pull driver has already checked length
and hash, so a stream that still ends early is the guest's fault.  What the members *mean*
(names, types, modes, links) is judged by the extractor (:mod:`wsync.engine.extract`), which
owns confinement and limits.

Speed: the stream is read into one reused 1 MiB buffer (``readinto``), file data is handed to
the extractor as writes straight from memoryview slices of it, and a header is parsed with one
``struct`` call.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO

from wsync.engine.api import MiB
from wsync.errors import HostileArchive, HostIOError, HostOutOfMemory, WsyncError

__all__ = ["BLOCK", "Member", "TarReader", "out_of_memory", "parse_header", "show_name"]

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_BUFSIZE = 1 * MiB
#: largest pax / GNU long-name record we read into memory
_MAX_EXT_HEADER = 1 * MiB
#: zero padding accepted after the end-of-archive marker (GNU tar pads to 10 KiB records)
_MAX_TRAILER = 1 * MiB
_NS = 1_000_000_000

# The type flags of a tar header (POSIX ustar, pax and GNU), as the stdlib's tarfile names
# them; defined here so that a pull does not import tarfile (and what it imports) for
# fourteen one-byte constants
REGTYPE, AREGTYPE, LNKTYPE, SYMTYPE = b"0", b"\0", b"1", b"2"
CHRTYPE, BLKTYPE, DIRTYPE, FIFOTYPE, CONTTYPE = b"3", b"4", b"5", b"6", b"7"
XHDTYPE, XGLTYPE = b"x", b"g"
GNUTYPE_LONGNAME, GNUTYPE_LONGLINK, GNUTYPE_SPARSE = b"L", b"K", b"S"

_EXTENDED = frozenset((XHDTYPE, XGLTYPE, GNUTYPE_LONGNAME, GNUTYPE_LONGLINK))
#: pax keywords we act on; every other keyword is ignored (uid, uname, atime, xattrs...)
_PAX_KEYS = frozenset((b"path", b"linkpath", b"size", b"mtime"))

#: ``(type, name, linkname, mode, size, mtime_ns)`` of one member, extended headers applied;
#: a plain tuple because one is built per member on the hot path
Member = tuple[bytes, bytes, bytes, int, int, int]


def show_name(name: bytes) -> str:
    """A member name for a one-line message: quoted, non-printables escaped, shortened."""
    text = repr(name.decode("utf-8", "backslashreplace"))
    return text if len(text) <= 160 else text[:120] + "..." + text[-30:]


#: name, mode, (uid, gid), size, mtime, chksum, type, linkname, magic,
#: (version..devminor), prefix, (pad)
_HEADER = struct.Struct("100s8s16x12s12s8sc100s6s82x155s12x")
_GNU_TYPES = (GNUTYPE_LONGNAME, GNUTYPE_LONGLINK, GNUTYPE_SPARSE)
_USTAR_MAGIC = b"ustar\0"
#: a member of these types whose (final) name ends in "/" is a directory, as in GNU tar
_FILE_TYPES = (REGTYPE, AREGTYPE, CONTTYPE)


def parse_header(block: bytes) -> tuple[bytes, bytes, bytes, int, int, int]:
    """``(type, name, linkname, mode, size, mtime)`` of one header block.

    Parsed here with one ``struct`` call (three times faster than
    :meth:`tarfile.TarInfo.frombuf`, whose rules it follows where they are GNU tar's; a test
    compares the two on fuzzed headers).  These rules are GNU tar's instead:

    * numbers are octal digits between optional blanks, or GNU base-256, after at most one
      leading NUL; ``frombuf`` hands the field to ``int(..., 8)``, which also takes ``-1``,
      ``+7``, ``0o17`` and ``1_0`` (GNU tar reads the first two as base-64 and refuses the
      others), reads an all-blank field as 0 (GNU tar: "Blanks in header where numeric
      value expected") and a field after a leading NUL as 0 (GNU tar reads on);
    * the 155-byte prefix is part of the name only under the POSIX magic ``ustar\0``.
      Old-GNU headers (``ustar  \0``) keep access and change times there (``tar -G``) and
      v7 headers have no prefix; ``frombuf`` would make ``atime/name`` of them.

    The name comes back as stored (a directory's trailing ``/`` kept): whether a member is a
    directory by its name is decided on the final name, after any long name or pax path
    (:meth:`TarReader.next_member`), as GNU tar does; ``frombuf`` decides it on the
    header's truncated field.  Fields wsync does not use (uid, gid, user and group names,
    device numbers) are not read at all.
    """
    name, mode, size, mtime, chksum, kind, link, magic, prefix = _HEADER.unpack(block)
    checksum = _number(chksum, "checksum")
    unsigned = _byte_sum(block) - sum(chksum) + 256
    if checksum != unsigned and checksum != unsigned - 256 * _high_bytes(block):
        raise HostileArchive("bad tar header (bad checksum)")
    imode = _number(mode, "mode")
    isize = _number(size, "size")
    imtime = _number(mtime, "mtime")
    name = name.split(b"\0", 1)[0]
    prefix = prefix.split(b"\0", 1)[0] if magic == _USTAR_MAGIC else b""
    if prefix and kind not in _GNU_TYPES:
        name = prefix + b"/" + name
    return kind, name, link.split(b"\0", 1)[0], imode, isize, imtime


_BLANKS = b" \t\n\v\f\r"
_OCTAL = b"01234567"
#: what every tar writes in a numeric field: octal digits, then NULs or spaces.  Such a
#: field reads as its digits whatever the rules below say of the rest, so it takes one
#: C-level match instead of the partition and strips (a third of a header's parse)
_PLAIN_NUMBER = re.compile(rb"([0-7]+)[\0 ]*")


def _byte_sum(block: bytes, adler32: Callable[[bytes], int] = zlib.adler32) -> int:
    """The sum of a 512-byte block's bytes.  Adler-32's first half is one plus the sum of
    the bytes modulo 65521: over 256 bytes (at most 65280) it never wraps, so two halves
    give the exact sum in C, five times faster than ``sum(block)``."""
    return (adler32(block[:256]) & 0xFFFF) + (adler32(block[256:]) & 0xFFFF) - 2


def _number(field: bytes, what: str) -> int:
    """A numeric header field as GNU tar reads it: octal between blanks, or base-256.

    Like GNU tar, one leading NUL is skipped ("buggy tar of unknown vintage, which outputs
    leading NUL if the previous field overflows"); ``frombuf`` reads such a field as 0.
    """
    plain = _PLAIN_NUMBER.fullmatch(field)
    if plain is not None:
        return int(plain[1], 8)
    return _general_number(field, what)


def _general_number(field: bytes, what: str) -> int:
    """:func:`_number` for any field (the rules, without the usual form's shortcut)."""
    if not field[0]:
        field = field[1:]
    first = field[0]
    if first == 0x80:  # base-256, positive: the marker byte then big-endian
        return int.from_bytes(field[1:], "big")
    if first == 0xFF:  # base-256, negative: two's complement over the whole field
        return int.from_bytes(field, "big", signed=True)
    text, nul, _ = field.partition(b"\0")
    digits = text.strip(_BLANKS)
    if not digits:
        if nul:
            return 0
        raise HostileArchive(f"bad tar header (blank {what} field)")
    if digits.strip(_OCTAL):
        raise HostileArchive(f"bad tar header ({what} field is not octal)")
    return int(digits, 8)


def _high_bytes(block: bytes) -> int:
    """How many bytes outside the checksum field are >= 128 (old signed-char checksums)."""
    return sum(1 for b in block[:148] if b & 0x80) + sum(1 for b in block[156:] if b & 0x80)


def _parse_pax(data: bytes, where: str) -> dict[bytes, bytes]:
    """Parse pax records (``"%d %s=%s\\n"``) strictly; keep only the keywords we act on."""
    out: dict[bytes, bytes] = {}
    pos = 0
    end = len(data)
    while pos < end:
        space = data.find(b" ", pos, pos + 12)
        digits = data[pos:space] if space > pos else b""
        if not digits.isdigit():
            raise HostileArchive(f"{where}: malformed pax record")
        length = int(digits)
        record_end = pos + length
        if length < len(digits) + 3 or record_end > end or data[record_end - 1] != 0x0A:
            raise HostileArchive(f"{where}: malformed pax record")
        key, eq, value = data[space + 1 : record_end - 1].partition(b"=")
        if not eq or not key:
            raise HostileArchive(f"{where}: malformed pax record")
        if key.startswith(b"GNU.sparse."):
            raise HostileArchive(f"{where}: sparse files are not supported")
        if key in _PAX_KEYS:
            out[key] = value
        pos = record_end
    return out


def _pax_time_ns(value: bytes, name: bytes) -> int:
    """An exact pax timestamp (``[-]seconds[.fraction]``) in nanoseconds, no float rounding.

    A date is never refused: more than 30 digits of seconds (far beyond any ``time_t``) reads
    as ``10**30`` s, which the extractor clamps to what the host holds, like any large value.
    """
    neg = value.startswith(b"-")
    whole, _, frac = (value[1:] if neg else value).partition(b".")
    if not whole.isdigit() or (frac and not frac.isdigit()):  # bytes: ASCII digits only
        raise HostileArchive(f"{show_name(name)}: malformed pax mtime")
    seconds = int(whole) if len(whole) <= 30 else 10**30
    ns = seconds * _NS + int((frac[:9] or b"0").ljust(9, b"0"))
    if neg:  # round toward the past, as GNU tar does (-1.0000000009 s is -1000000001 ns)
        return -ns - (frac[9:].strip(b"0") != b"")
    return ns


def out_of_memory(exc: BaseException) -> bool:
    """Whether a decompressor's failure is the host running out of memory (a ``ulimit
    -v``, a container's limit): not the archive's fault, so its snapshot is kept."""
    return isinstance(exc, MemoryError) or "Allocation error" in str(exc)  # zstd's word


class TarReader:
    """The tar stream through one reused buffer; every short read is an error.

    :meth:`next_member` returns the next member's header with its extended headers applied;
    the caller then consumes a regular file's payload with :meth:`copy_to` and
    :meth:`skip_padding` before asking for the next member.  ``on_global_header`` is called
    with a description of each pax global header as it is read, so that the caller counts it
    against its member limit (each one is a record in memory).
    """

    def __init__(self, stream: BinaryIO, on_global_header: Callable[[bytes], None]) -> None:
        self._stream = stream
        self._on_global_header = on_global_header
        self.pax_global: dict[bytes, bytes] = {}
        #: which archive of the stream the last member came from (0: the first)
        self.archive = 0
        self._buf = bytearray(_BUFSIZE)
        self._mv = memoryview(self._buf)
        self._pos = 0
        self._end = 0
        self.offset = 0  # stream offset of _buf[_pos], for messages
        self._readinto: Callable[[memoryview], int | None] | None = getattr(
            stream, "readinto", None
        )

    def close(self) -> None:
        self._mv.release()

    def _fill(self) -> int:
        """Refill the (exhausted) buffer; 0 at end of stream."""
        try:
            if self._readinto is not None:
                n = self._readinto(self._mv) or 0
            else:
                data = self._stream.read(_BUFSIZE)
                n = len(data)
                if n > _BUFSIZE:
                    raise HostileArchive("archive stream returned more than asked")
                self._mv[:n] = data
        except WsyncError:
            raise
        except OSError as exc:
            raise HostIOError(f"reading the archive stream: {exc}") from exc
        except Exception as exc:  # the decompressor is foreign code: corrupt input lands here
            if out_of_memory(exc):
                raise HostOutOfMemory(f"decoding the archive stream ({exc!r})") from exc
            raise HostileArchive(
                f"undecodable archive stream: {type(exc).__name__}: {exc}"
            ) from exc
        self._pos = 0
        self._end = n
        return n

    def read(self, size: int, what: str, *, short_ok: bool = False) -> bytes:
        """Exactly ``size`` bytes; at a clean end of stream before any byte, ``b""``
        (with ``short_ok``, whatever is left at the end of the stream)."""
        pos = self._pos
        if self._end - pos >= size:
            self._pos = pos + size
            self.offset += size
            return bytes(self._mv[pos : pos + size])
        parts: list[bytes] = []
        need = size
        while need:
            if self._pos == self._end and not self._fill():
                if need == size or short_ok:
                    self.offset += size - need
                    return b"".join(parts)
                raise HostileArchive(f"truncated archive: stream ends inside {what}")
            take = min(need, self._end - self._pos)
            parts.append(bytes(self._mv[self._pos : self._pos + take]))
            self._pos += take
            need -= take
        self.offset += size
        return b"".join(parts)

    def skip(self, size: int, what: str) -> None:
        if self._end - self._pos >= size:  # buffered (a member's padding, mostly): no copy
            self._pos += size
            self.offset += size
        elif len(self.read(size, what)) != size:
            raise HostileArchive(f"truncated archive: stream ends inside {what}")

    def skip_padding(self, size: int) -> None:
        """Skip the zero padding that rounds ``size`` bytes of payload up to whole blocks."""
        self.skip(-size % BLOCK, "padding")

    def copy_to(self, fd: int, size: int, name: bytes, digest: Any = None) -> None:
        """Write the next ``size`` payload bytes to ``fd`` straight from the buffer
        (and into ``digest``, a hash object, when given)."""
        mv = self._mv
        while size:
            if self._pos == self._end and not self._fill():
                raise HostileArchive(f"truncated archive: stream ends inside {show_name(name)}")
            take = min(size, self._end - self._pos)
            start = self._pos
            stop = start + take
            if digest is not None:
                digest.update(mv[start:stop])
            while start < stop:
                start += os.write(fd, mv[start:stop])
            self._pos = stop
            self.offset += take
            size -= take

    def _next_archive(self) -> bytes | None:
        """After an end-of-archive marker: ``None`` at the end of the stream, or the first
        header block of the next archive (the producer appends archives of files it read
        again because they changed while read, like ``tar --ignore-zeros`` reads them).

        Only bounded zero padding may come between archives.
        """
        seen = 0
        while True:
            block = self.read(BLOCK, "the end-of-archive padding", short_ok=True)
            if len(block) < BLOCK:  # the end of the stream: a partial block of zeros is fine
                if block.count(0) != len(block):
                    raise HostileArchive("data after the end-of-archive marker")
                return None
            if block != _ZERO_BLOCK:
                self.archive += 1
                self.pax_global = {}
                return block
            seen += BLOCK
            if seen > _MAX_TRAILER:
                raise HostileArchive("more than 1 MiB of zeros after an end-of-archive marker")

    def next_member(self) -> Member | None:
        """The next member, extended headers applied; ``None`` after the end-of-archive marker."""
        pax: dict[bytes, bytes] | None = None
        long_name: bytes | None = None
        long_link: bytes | None = None
        while True:
            at = self.offset
            block = self.read(BLOCK, "a header")
            if not block:
                raise HostileArchive("truncated archive: no end-of-archive marker")
            if block == _ZERO_BLOCK:
                if pax is not None or long_name is not None or long_link is not None:
                    raise HostileArchive(f"header at offset {at}: extended header alone")
                following = self._next_archive()
                if following is None:
                    return None
                block, at = following, self.offset - BLOCK
            try:
                kind, name, link, mode, size, mtime = parse_header(block)
            except HostileArchive as exc:
                raise HostileArchive(f"header at offset {at}: {exc.args[0]}") from exc
            if kind not in _EXTENDED:
                break
            where = f"header at offset {at}"
            if not 0 <= size <= _MAX_EXT_HEADER:
                raise HostileArchive(f"{where}: extended header of {size} bytes")
            data = self.read(size, "an extended header")
            if len(data) != size:
                raise HostileArchive("truncated archive: stream ends inside an extended header")
            self.skip_padding(size)
            if kind == XHDTYPE:
                if pax is not None:
                    raise HostileArchive(f"{where}: repeated pax header")
                pax = _parse_pax(data, where)
            elif kind == XGLTYPE:
                self._on_global_header(where.encode())
                self.pax_global.update(_parse_pax(data, where))
            elif kind == GNUTYPE_LONGNAME:
                if long_name is not None:
                    raise HostileArchive(f"{where}: repeated GNU long name")
                long_name = data.split(b"\0", 1)[0]
            else:
                if long_link is not None:
                    raise HostileArchive(f"{where}: repeated GNU long link")
                long_link = data.split(b"\0", 1)[0]

        mtime_ns = mtime * _NS
        if pax is not None or self.pax_global or long_name is not None or long_link is not None:
            # An empty pax value deletes the field (POSIX), header field included: an empty
            # path (or GNU long name) is an empty name, an empty mtime or size is malformed
            # (GNU tar agrees).
            ext = {**self.pax_global, **(pax or {})}
            name = ext.get(b"path", name if long_name is None else long_name)
            link = ext.get(b"linkpath", link if long_link is None else long_link)
            if b"mtime" in ext:
                mtime_ns = _pax_time_ns(ext[b"mtime"], name)
            if b"size" in ext:
                if not ext[b"size"].isdigit() or len(ext[b"size"]) > 20:  # 2**64 has 20
                    raise HostileArchive(f"{show_name(name)}: malformed pax size")
                size = int(ext[b"size"])
        if kind in _FILE_TYPES and name.endswith(b"/"):  # of the final name, as in GNU tar
            kind = DIRTYPE
        return kind, name, link, mode, size, mtime_ns
