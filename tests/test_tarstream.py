"""The tar stream reader: headers, extended records, truncation, trailers, foreign streams.

Archives come from GNU tar and ``tarfile`` and are cut, padded or corrupted at known offsets;
they go through the public extractor (a refused stream must refuse the whole extraction) or,
where the parse alone is the point, through :class:`TarReader` and :func:`parse_header`.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from extract_helpers import LIMITS, SYM, T0, build, extract, gnu_tar, make_root, member, snapshot
from extract_helpers import small_archive as build_small_archive
from wsync.engine.api import MiB
from wsync.engine.extract import extract_tar_stream
from wsync.engine.tarstream import (
    Member,
    TarReader,
    _byte_sum,
    _general_number,
    _number,
    parse_header,
)
from wsync.errors import HostileArchive, HostIOError, HostOutOfMemory

NS = 1_000_000_000


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path)


@pytest.fixture
def small_archive() -> bytes:
    return build_small_archive()


# -- truncation and stream errors ---------------------------------------------------------------


def _offsets(archive: bytes) -> list[int]:
    """Start offsets of each member header in a GNU-format archive."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
        return [m.offset for m in tf.getmembers()]


def test_truncated_mid_member_is_refused(root: Path, small_archive: bytes) -> None:
    cut = _offsets(small_archive)[1] + 512 + 2000  # inside d/a's data
    with pytest.raises(HostileArchive, match="truncated"):
        extract(small_archive[:cut], root)


def test_truncated_mid_header_is_refused(root: Path, small_archive: bytes) -> None:
    cut = _offsets(small_archive)[2] + 100
    with pytest.raises(HostileArchive, match="truncated"):
        extract(small_archive[:cut], root)


@pytest.mark.parametrize("index", [1, 2, 3])
def test_cut_at_member_boundary_without_end_marker_is_refused(
    root: Path, small_archive: bytes, index: int
) -> None:
    with pytest.raises(HostileArchive, match="no end-of-archive marker"):
        extract(small_archive[: _offsets(small_archive)[index]], root)


def test_lone_zero_block_end_is_accepted(root: Path, small_archive: bytes) -> None:
    end = _offsets(small_archive)[3] + 512
    assert extract(small_archive[:end] + bytes(512), root).files == 2


def test_data_after_end_marker_is_refused(tmp_path: Path, small_archive: bytes) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(HostileArchive, match="after the end-of-archive"):
        extract(small_archive + b"garbage", tmp_path / "a")
    with pytest.raises(HostileArchive, match="header at offset"):
        extract(small_archive + b"garbage".ljust(512, b"!"), tmp_path / "b")


def test_unbounded_zeros_after_end_marker_are_refused(root: Path, small_archive: bytes) -> None:
    with pytest.raises(HostileArchive, match="zeros after an end-of-archive marker"):
        extract(small_archive + bytes(2 * 1024 * 1024), root)


def test_corrupt_compressed_stream_is_refused(root: Path, small_archive: bytes) -> None:
    frame = bytearray(zstandard.ZstdCompressor().compress(small_archive))
    frame[len(frame) // 2] ^= 0xFF
    reader = zstandard.ZstdDecompressor().stream_reader(bytes(frame))
    with pytest.raises(HostileArchive), reader:
        extract_tar_stream(reader, root, LIMITS)  # type: ignore[arg-type]


def test_zstd_stream_reader_round_trip(tmp_path: Path, root: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(5 * MiB))
    os.utime(src / "f", (T0, T0))
    os.utime(src, (T0, T0))
    raw = zstandard.ZstdCompressor().compress(gnu_tar(src))
    with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
        extract_tar_stream(reader, root, LIMITS)  # type: ignore[arg-type]
    assert snapshot(root) == snapshot(src)


def test_stream_oserror_is_a_host_error(root: Path) -> None:
    class Broken(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
            raise OSError(5, "Input/output error")

    with pytest.raises(HostIOError):
        extract_tar_stream(Broken(), root, LIMITS)  # type: ignore[arg-type]


# -- headers: the struct fast path against tarfile.frombuf -------------------------------------


@st.composite
def header_blocks(draw: st.DrawFn) -> bytes:
    info = tarfile.TarInfo(draw(st.binary(max_size=120)).decode("utf-8", "surrogateescape"))
    info.type = draw(st.sampled_from([b"0", b"\0", b"1", b"2", b"5", b"7", b"L", b"x", b"S"]))
    info.linkname = draw(st.binary(max_size=99)).decode("utf-8", "surrogateescape")
    info.mode = draw(st.integers(0, 0o7777))
    info.size = draw(st.integers(0, 2**40))
    info.mtime = draw(st.integers(-(2**40), 2**40))
    fmt = draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT]))
    try:
        block = bytearray(info.tobuf(fmt, "utf-8", "surrogateescape")[-512:])
    except ValueError:  # not representable in ustar
        block = bytearray(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")[-512:])
    if draw(st.booleans()):  # a prefix (or old-GNU atime) in any format
        block[345:356] = draw(st.sampled_from([b"pre/fix", b"14724157400"])).ljust(11, b"\0")
        block[148:156] = b"        "
        block[148:156] = b"%06o\0 " % sum(block)
    for _ in range(draw(st.integers(0, 3))):
        block[draw(st.integers(0, 511))] = draw(st.integers(0, 255))
        if draw(st.booleans()):  # re-seal the checksum so the mutation is parsed
            block[148:156] = b"        "
            block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def lenient_number(field: bytes) -> bool:
    """A numeric field that ``int(..., 8)`` takes but GNU tar does not read as octal."""
    if field[0] in (0x80, 0xFF):
        return False
    text, nul, _ = field.partition(b"\0")
    digits = text.strip(b" \t\n\v\f\r")
    return bool(digits.strip(b"01234567")) if digits else not nul


@settings(max_examples=300, deadline=None)
@given(header_blocks())
def test_fast_header_parser_agrees_with_tarfile(block: bytes) -> None:
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except (tarfile.HeaderError, ValueError):
        # frombuf also rejects garbage in fields wsync ignores (uid, gid, device numbers)
        with contextlib.suppress(HostileArchive):
            parse_header(block)
        return
    numbers = [block[a:b] for a, b in ((100, 108), (124, 136), (136, 148), (148, 156))]
    if any(f[0] == 0 and f[1] != 0 for f in numbers):
        return  # GNU tar reads past one leading NUL, frombuf stops: the corpus compares
    if any(lenient_number(f[1:] if f[0] == 0 else f) for f in numbers[:3]):
        with pytest.raises(HostileArchive, match="bad tar header"):
            parse_header(block)  # "-1", "+7", "0o17", "1_0", blanks: GNU tar's rule
        return
    enc = ("utf-8", "surrogateescape")
    name = info.name.encode(*enc)
    if block[257:263] != b"ustar\0" and info.type not in (b"L", b"K", b"S"):
        # GNU tar's rule, not tarfile's: the prefix counts only under the POSIX magic
        field = block[:100].split(b"\0", 1)[0]
        name = field.rstrip(b"/") if info.type == tarfile.DIRTYPE else field
    kind, got_name, *rest = parse_header(block)
    expected = (*final(info.type, name), info.linkname.encode(*enc))
    assert (*final(kind, got_name), *rest) == (*expected, info.mode, info.size, int(info.mtime))


def final(kind: bytes, name: bytes) -> tuple[bytes, bytes]:
    """GNU tar's (and the reader's) rule on the final name: a file named ``x/`` is a
    directory, whose trailing slashes do not count; tarfile applies it before the prefix
    and only to type ``\0``."""
    if kind in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE) and name.endswith(b"/"):
        kind = tarfile.DIRTYPE
    return kind, name.rstrip(b"/") if kind == tarfile.DIRTYPE else name


@pytest.mark.parametrize(
    "value", [b"-1", b"+7", b"0o17", b"1_0", b" " * 12, b"12 x", b"\x81" + bytes(7)]
)
@pytest.mark.parametrize(
    "field", [(100, 108), (124, 136), (136, 148)], ids=["mode", "size", "mtime"]
)
def test_numbers_python_reads_but_gnu_tar_does_not_are_refused(
    field: tuple[int, int], value: bytes
) -> None:
    block = bytearray(member("f")[0].tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
    width = field[1] - field[0]
    block[field[0] : field[1]] = value[:width].ljust(width, b"\0")  # blanks fill the field
    block[148:156] = b"        "
    block[148:156] = b"%06o\0 " % sum(block)
    with pytest.raises(HostileArchive, match="bad tar header"):
        parse_header(bytes(block))


def number_or_refusal(read: Any, field: bytes) -> int | str:
    try:
        return int(read(field, "size"))
    except HostileArchive as exc:
        return str(exc)


#: odd bytes for a numeric field: blanks, NUL, non-octal digits and signs, base-256 marks
_ODD = [0, 0x20, 0x09, 0x38, 0x78, 0x2D, 0x2B, 0x80, 0xFF]


@st.composite
def number_fields(draw: st.DrawFn) -> bytes:
    """A field of 8 or 12 bytes: maybe an odd byte or two, octal digits, NULs and spaces,
    and half the time one odd byte among those, so that fields of the usual form and
    ones a byte away from it both come up often."""
    width = draw(st.sampled_from([8, 12]))
    lead = bytes(draw(st.lists(st.sampled_from(_ODD), max_size=2)))
    digits = bytes(draw(st.lists(st.sampled_from(b"01234567"), min_size=1, max_size=width)))
    tail = bytearray(draw(st.lists(st.sampled_from(b"\0 "), min_size=width, max_size=width)))
    if draw(st.booleans()):
        tail[draw(st.integers(0, width - 1))] = draw(st.sampled_from(_ODD))
    return (lead + digits + tail)[:width]


@settings(max_examples=1000, deadline=None)
@given(number_fields())
def test_the_usual_number_shortcut_reads_as_the_rules_do(field: bytes) -> None:
    """Digits then NULs or spaces (what tars write) take a shortcut: it must read every
    field exactly as GNU tar's rules do, and leave every other field to them."""
    assert number_or_refusal(_number, field) == number_or_refusal(_general_number, field)


@pytest.mark.parametrize(
    "field", [b"0000644\0", b"00000001750\0", b"012345\0 ", b"644 \0\0\0\0", b"7" * 12]
)
def test_fields_as_tars_write_them_take_the_shortcut_to_the_same_number(field: bytes) -> None:
    assert _number(field, "size") == _general_number(field, "size") == int(field.strip(b"\0 "), 8)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=512, max_size=512))
def test_a_header_checksum_sums_every_byte(block: bytes) -> None:
    assert _byte_sum(block) == sum(block)
    assert _byte_sum(b"\xff" * 512) == 255 * 512 and _byte_sum(bytes(512)) == 0


# -- members as parsed --------------------------------------------------------------------------


def parse_all(data: bytes, tmp_path: Path) -> tuple[list[Member], list[bytes], list[bytes]]:
    """Every member of ``data`` as :class:`TarReader` returns it, their payloads, and the
    global headers it reported."""
    globals_seen: list[bytes] = []
    members: list[Member] = []
    payloads: list[bytes] = []
    out = tmp_path / "payload"
    reader = TarReader(io.BytesIO(data), globals_seen.append)
    try:
        while (m := reader.next_member()) is not None:
            members.append(m)
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                reader.copy_to(fd, m[4], m[1])
            finally:
                os.close(fd)
            reader.skip_padding(m[4])
            payloads.append(out.read_bytes())
    finally:
        reader.close()
    return members, payloads, globals_seen


def test_gnu_long_name_and_long_link_replace_the_header_fields(tmp_path: Path) -> None:
    data = build(member("n" * 150, data=b"long"), member("l", SYM, link="t" * 120))
    members, payloads, globals_seen = parse_all(data, tmp_path)
    assert members == [
        (tarfile.REGTYPE, b"n" * 150, b"", 0o644, 4, T0 * NS),
        (tarfile.SYMTYPE, b"l", b"t" * 120, 0o644, 0, T0 * NS),
    ]
    assert payloads == [b"long", b""]
    assert globals_seen == []


def test_pax_records_and_global_header_apply_exactly(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(
        fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"mtime": "1600000001.25"}
    ) as tf:
        for info, payload in (
            member("p", data=b"pax", pax={"mtime": "1600000000.5", "path": "paxname"}),
            member("g", data=b"global"),
            member("l", SYM, link="t" * 120),
        ):
            tf.addfile(info, io.BytesIO(payload) if info.isreg() else None)
    members, payloads, globals_seen = parse_all(buf.getvalue(), tmp_path)
    assert members == [
        (tarfile.REGTYPE, b"paxname", b"", 0o644, 3, 1_600_000_000_500_000_000),
        (tarfile.REGTYPE, b"g", b"", 0o644, 6, 1_600_000_001_250_000_000),
        (tarfile.SYMTYPE, b"l", b"t" * 120, 0o644, 0, 1_600_000_001_250_000_000),
    ]
    assert payloads == [b"pax", b"global", b""]
    assert globals_seen == [b"header at offset 0"]


def test_prefix_counts_only_under_the_posix_magic(tmp_path: Path) -> None:
    """An old-GNU header with an access time where ustar has its prefix (``tar -G``)."""
    info, payload = member("f", data=b"x")
    block = bytearray(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
    block[345:357] = b"14724157400\0"
    block[148:156] = b"        "
    block[148:156] = b"%06o\0 " % sum(block)
    data = bytes(block) + payload.ljust(512, b"\0") + bytes(1024)
    listed = subprocess.run(["tar", "-tf", "-"], input=data, capture_output=True, check=True)
    assert listed.stdout == b"f\n"  # what GNU tar makes of it
    members, _payloads, _globals = parse_all(data, tmp_path)
    assert [m[1] for m in members] == [b"f"]


@pytest.mark.parametrize("digits", [21, 5000])
def test_pax_size_with_too_many_digits_is_refused(root: Path, digits: int) -> None:
    """5000 digits used to escape as a foreign ValueError (int() digit limit)."""
    data = build(member("f", data=b"x", pax={"size": "1" * digits}), fmt=tarfile.PAX_FORMAT)
    with pytest.raises(HostileArchive, match="malformed pax size"):
        extract(data, root)


def test_a_host_out_of_memory_is_not_a_hostile_archive() -> None:
    """MemoryError (a ``ulimit -v``) or zstd's "Allocation error" while decoding is the
    host's limit, not the guest's archive: HostOutOfMemory (exit 8), which keeps the
    snapshot for the next run, where HostileArchive (exit 7) would throw it away."""

    class Starved(io.RawIOBase):
        def __init__(self, error: Exception) -> None:
            self.error = error

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            raise self.error

    for error in (MemoryError(), zstandard.ZstdError("Allocation error : not enough memory")):
        reader = TarReader(Starved(error), lambda _: None)
        with pytest.raises(HostOutOfMemory) as info:
            reader.read(512, "a header")
        assert info.value.exit_code == 8
    with pytest.raises(HostileArchive):
        TarReader(Starved(zstandard.ZstdError("Unknown frame descriptor")), lambda _: None).read(
            512, "a header"
        )


def test_a_host_out_of_memory_on_the_manifest_path_is_not_hostile_either() -> None:
    """The manifest is decoded by ``consume_feed`` itself (no tar reader): the same
    mapping, so a listing that cannot be decoded for want of memory keeps its snapshot."""
    from wsync.engine.feed import ChunkFeed, consume_feed
    from wsync.protocol.hashing import PROBE_ALGORITHM

    def starved(stream: Any) -> None:
        raise MemoryError

    def allocation(stream: Any) -> None:
        raise zstandard.ZstdError("zstd decompress error: Allocation error : not enough memory")

    for use in (starved, allocation):
        feed = ChunkFeed(PROBE_ALGORITHM)
        feed.finish(0)
        with pytest.raises(HostOutOfMemory):
            consume_feed(feed, "zstd", use)


def test_the_type_flags_are_tarfiles() -> None:
    """The header type flags the reader and the extractor use are the stdlib's (defined
    in wsync so that a pull need not import tarfile)."""
    import tarfile

    from wsync.engine import tarstream

    names = [n for n in dir(tarstream) if n.endswith("TYPE") or n.startswith("GNUTYPE_")]
    assert len(names) == 14
    for name in names:
        assert getattr(tarstream, name) == getattr(tarfile, name), name
