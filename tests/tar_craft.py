"""Raw tar blocks written byte by byte, for archives no well-behaved writer produces.

``tarfile`` and GNU tar only write what they consider valid; the corpus tests need v7 and
star headers, old-GNU access times where ustar keeps its prefix, base-256 numbers of any
value, pax records of every length and headers cut or damaged in each field.  Modelled on the
oddities of Go's ``archive/tar`` testdata, CPython's ``test_tarfile`` archives and
libarchive's test archives (written here from their descriptions; no binary is copied).
"""

from __future__ import annotations

T0 = 1_600_000_000
BLOCK = 512
END = bytes(2 * BLOCK)

USTAR = b"ustar\x0000"  # POSIX magic and version
GNU = b"ustar  \x00"  # old GNU magic (GNU tar's default format)
V7 = bytes(8)  # no magic at all

#: (offset, length) of every ustar header field, in order
FIELDS: dict[str, tuple[int, int]] = {
    "name": (0, 100),
    "mode": (100, 8),
    "uid": (108, 8),
    "gid": (116, 8),
    "size": (124, 12),
    "mtime": (136, 12),
    "chksum": (148, 8),
    "typeflag": (156, 1),
    "linkname": (157, 100),
    "magic": (257, 6),
    "version": (263, 2),
    "uname": (265, 32),
    "gname": (297, 32),
    "devmajor": (329, 8),
    "devminor": (337, 8),
    "prefix": (345, 155),
    "pad": (500, 12),
}


def octal(value: int, width: int) -> bytes:
    """``value`` as zero-padded octal ending in NUL, ``width`` bytes in all."""
    return b"%0*o\0" % (width - 1, value)


def base256(value: int, width: int = 12) -> bytes:
    """GNU's base-256 number: high bit set, two's complement big-endian (negative: 0xff...)."""
    raw = (value % 256**width).to_bytes(width, "big")
    return raw if value < 0 else b"\x80" + raw[1:]


def seal(block: bytearray | bytes) -> bytes:
    """``block`` with a correct (unsigned) checksum."""
    out = bytearray(block)
    out[148:156] = b"        "
    out[148:156] = b"%06o\0 " % sum(out)
    return bytes(out)


def header(
    name: bytes,
    kind: bytes = b"0",
    size: int = 0,
    *,
    mode: int = 0o644,
    mtime: int = T0,
    link: bytes = b"",
    magic: bytes = GNU,
    prefix: bytes = b"",
    fields: dict[str, bytes] | None = None,
) -> bytes:
    """One sealed header block; ``fields`` overrides any field's raw bytes (padded with NUL)."""
    block = bytearray(BLOCK)

    def put(field: str, value: bytes) -> None:
        off, length = FIELDS[field]
        if len(value) > length:
            raise ValueError(f"{field}: {len(value)} bytes > {length}")
        block[off : off + length] = value.ljust(length, b"\0")

    put("name", name)
    put("mode", octal(mode, 8))
    put("uid", octal(0, 8))
    put("gid", octal(0, 8))
    put("size", octal(size, 12) if size < 8**11 else base256(size))
    put("mtime", octal(mtime, 12) if 0 <= mtime < 8**11 else base256(mtime))
    put("typeflag", kind)
    put("linkname", link)
    block[257:265] = magic
    if magic != V7:
        put("uname", b"root")
        put("gname", b"root")
    put("prefix", prefix)
    fields = fields or {}
    for field, value in fields.items():
        put(field, value)
    block[:] = seal(block)
    if "chksum" in fields:  # a wrong checksum on purpose
        put("chksum", fields["chksum"])
    return bytes(block)


def payload(data: bytes) -> bytes:
    """File data padded to whole blocks."""
    return data + bytes(-len(data) % BLOCK)


def file(name: bytes, data: bytes = b"", **kw: object) -> bytes:
    """A regular-file member: header and padded data."""
    return header(name, b"0", len(data), **kw) + payload(data)  # type: ignore[arg-type]


def record(key: bytes, value: bytes) -> bytes:
    """One pax record ``"%d %s=%s\\n"`` whose length counts its own digits."""
    body = b" " + key + b"=" + value + b"\n"
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def ext(kind: bytes, data: bytes, name: bytes = b"././@PaxHeader") -> bytes:
    """An extended header (pax ``x``/``g`` or GNU ``L``/``K``) carrying ``data``."""
    return header(name, kind, len(data), magic=USTAR if kind in b"xg" else GNU) + payload(data)


def pax(*records: bytes) -> bytes:
    return ext(b"x", b"".join(records))


def longname(name: bytes) -> bytes:
    return ext(b"L", name + b"\0", b"././@LongLink")


def longlink(target: bytes) -> bytes:
    return ext(b"K", target + b"\0", b"././@LongLink")
