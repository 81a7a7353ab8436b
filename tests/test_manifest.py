"""The manifest parser and the listed-size counter: fed whole, byte at a time, with
trailing bytes, and fuzzed."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wsync.errors import ProtocolError
from wsync.protocol.manifest import (
    MAX_HEADER,
    MAX_NAME,
    Entry,
    Known,
    ListedBytes,
    ManifestParser,
    fingerprint,
    parse_time,
)

SAMPLE = (
    b"d 755 4096 1796108389.0447479200 1796108389.0447479200 2173675\0.\0\0"
    b"l 777 1 1796108389.0447479200 1796108389.0447479200 2173678\0./l\0a\nb\0"
    b"f 4644 3 -2.5 0 0 00ff00ff00ff00ff\0./d/\xff\nx\0\0"
)
EXPECTED = [
    Entry(b".", "d", 0o755, 4096, 1796108389044747920, 1796108389044747920, 2173675, b""),
    Entry(b"l", "l", 0o777, 1, 1796108389044747920, 1796108389044747920, 2173678, b"a\nb"),
    Entry(b"d/\xff\nx", "f", 0o4644, 3, -1_500_000_000, 0, 0, b"", "00ff00ff00ff00ff"),
]


def parse(chunks: list[bytes]) -> list[Entry]:
    parser = ManifestParser()
    out: list[Entry] = []
    for chunk in chunks:
        parser.receive_data(chunk)
        out += parser.entries()
    parser.receive_eof()
    return out + parser.entries()


def test_whole() -> None:
    assert parse([SAMPLE]) == EXPECTED


def test_byte_at_a_time() -> None:
    assert parse([SAMPLE[i : i + 1] for i in range(len(SAMPLE))]) == EXPECTED


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(ProtocolError):
        parse([SAMPLE + b"f 644 1 1 1 1\0./x"])
    parser = ManifestParser()
    parser.receive_data(SAMPLE)
    parser.receive_eof()
    with pytest.raises(ProtocolError):
        parser.receive_data(b"x")


@pytest.mark.parametrize(
    "record",
    [
        b"x 644 1 1 1 1\0./a\0\0",  # unknown kind
        b"f 648 1 1 1 1\0./a\0\0",  # not octal
        b"f 644 1 1 1\0./a\0\0",  # a field short
        b"f 644 1 1 1 1\0a\0\0",  # not under "."
        b"f 644 1 1 1 1\0./\0\0",  # empty name
        b"l 777 1 1 1 1\0./a\0\0",  # a link without a target
        b"f 644 1 1 1 1\0./a\0t\0",  # a target on a file
        b"f 644 1 1 1 1 " + b"9" * 600 + b"\0./a\0\0",  # header too long
    ],
)
def test_malformed(record: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse([record])


def test_times() -> None:
    assert parse_time(b"12") == 12_000_000_000
    assert parse_time(b"12.5") == 12_500_000_000
    assert parse_time(b"12.") == 12_000_000_000
    # find prints the floor of the seconds, then the fraction forward from it
    assert parse_time(b"-1.75") == -250_000_000
    assert parse_time(b"-77984598.4000000000") == -77_984_597_600_000_000
    assert parse_time(b"-3") == -3_000_000_000


def test_a_time_before_1970_reads_as_find_prints_it(tmp_path: Path) -> None:
    """The parser and GNU find agree on a pre-1970 time with a fraction."""
    target = tmp_path / "old"
    target.write_text("x")
    os.utime(target, ns=(-77_984_597_600_000_000, -77_984_597_600_000_000))
    printed = subprocess.run(
        ["find", str(target), "-printf", "%T@"], capture_output=True, check=True
    ).stdout
    assert parse_time(printed) == -77_984_597_600_000_000


@given(st.binary(max_size=400), st.integers(min_value=1, max_value=50))
def test_fuzz_parses_or_raises_protocol_error(data: bytes, step: int) -> None:
    with contextlib.suppress(ProtocolError):
        parse([data[i : i + step] for i in range(0, len(data), step)])


@given(st.lists(st.tuples(st.sampled_from("fdl"), st.binary(min_size=1, max_size=20))))
def test_fuzz_round_trip(items: list[tuple[str, bytes]]) -> None:
    data = b""
    want = []
    for kind, name in items:
        name = name.replace(b"\0", b"_")
        target = b"t" if kind == "l" else b""
        data += kind.encode() + b" 644 7 3.25 4 9\0./" + name + b"\0" + target + b"\0"
        want.append(Entry(name, kind, 0o644, 7, 3_250_000_000, 4_000_000_000, 9, target))
    assert parse([data]) == want


# -- devices: one inode number on two filesystems is two files ----------------------------

#: the root on device 64, a file on it, two on device 65 (a mount), one of them of the same
#: inode number as the root's file, and one of unknown inode
DEVICES = (
    b"d 755 4096 1 1 2:64\0.\0\0"
    b"f 644 1 1 1 7:64\0./a\0\0"
    b"d 755 4096 1 1 2:65\0./m\0\0"
    b"f 644 1 1 1 7:65\0./m/b\0\0"
    b"f 644 1 1 1 0:65\0./m/c\0\0"
)


def test_an_inode_of_another_device_than_the_roots_carries_its_device() -> None:
    for chunks in ([DEVICES], [DEVICES[i : i + 1] for i in range(len(DEVICES))]):
        got = {e.path: e.ino for e in parse(chunks)}
        # the root's own device: the inode number alone, as before devices were listed
        assert got[b"."] == 2 and got[b"a"] == 7
        assert got[b"m"] == 65 << 64 | 2 and got[b"m/b"] == 65 << 64 | 7
        assert got[b"m/c"] == 0  # unknown stays unknown


def test_the_roots_device_is_read_from_its_record_even_when_that_is_known() -> None:
    """A known record is not parsed, the root's included: its device is still the one the
    others are compared with."""
    root = DEVICES.split(b"\0", 3)
    known = Known({fingerprint(*root[:3])})
    parser = ManifestParser(known)
    parser.receive_data(DEVICES)
    parser.receive_eof()
    got = {e.path: e.ino for e in parser.entries()}
    assert b"." not in got and known.matched == 1
    assert got[b"a"] == 7 and got[b"m/b"] == 65 << 64 | 7


# -- ListedBytes: the sizes of regular files, before the manifest loads --------------------


def listed(chunks: list[bytes]) -> int:
    counter = ListedBytes()
    for chunk in chunks:
        counter.receive_data(chunk)
    return counter.total


#: a file whose name looks like a header, and a symlink whose target does: neither counts
TRICKY = (
    SAMPLE + b"f 600 10 1 1 1\0./f 644 999 1 1 1\0\0" + b"l 777 9 1 1 1\0./k\0f 644 777 1 1 1\0"
)


def test_listed_bytes_whole_and_byte_at_a_time() -> None:
    assert listed([TRICKY]) == 3 + 10
    assert listed([TRICKY[i : i + 1] for i in range(len(TRICKY))]) == 13


def test_listed_bytes_counts_what_the_parser_reads() -> None:
    files = [e for e in parse([TRICKY]) if e.kind == "f"]
    assert listed([TRICKY]) == sum(e.size for e in files)


@pytest.mark.parametrize(
    "data",
    [b"f 644 x 1 1 1\0./a\0\0", b"f 644 " + b"9" * 21 + b" 1 1 1\0./a\0\0", b"f 644\0./a\0\0"],
    ids=["not-a-number", "too-long", "no-size"],
)
def test_listed_bytes_refuses_a_bad_size(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        listed([data])


def test_listed_bytes_bounds_a_field_without_its_end() -> None:
    with pytest.raises(ProtocolError):
        listed([b"x" * (MAX_NAME + MAX_HEADER + 1)])


@given(st.binary(max_size=400), st.integers(1, 50))
def test_fuzz_listed_bytes_counts_or_raises_protocol_error(data: bytes, step: int) -> None:
    with contextlib.suppress(ProtocolError):
        assert listed([data[i : i + step] for i in range(0, len(data), step)]) >= 0
