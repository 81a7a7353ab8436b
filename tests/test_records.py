"""Guest record parsers: the index (incremental), status and probe records."""

from __future__ import annotations

import base64
import contextlib
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync.errors import ProtocolError
from wsync.protocol import producer
from wsync.protocol.hashing import ALGORITHMS
from wsync.protocol.records import (
    FIRST_CHUNK,
    GROWTH_STEPS,
    AdmitReport,
    IndexParser,
    chunk_length,
    disk_full_message,
    parse_admit,
    parse_fields,
    parse_probe,
    parse_stage_refusal,
    parse_status,
)

XXH = ALGORITHMS["xxh128"]
H = "0" * 32
INDEX = f"C 0 0 100 {H}\nC 1 100 100 {H}\nC 2 200 40 {H}\n".encode()


@pytest.mark.parametrize("step", [1, 7, len(INDEX)])
def test_index_in_any_split(step: int) -> None:
    parser = IndexParser(XXH, max_chunk=100)
    chunks = []
    for i in range(0, len(INDEX), step):
        chunks += parser.receive_data(INDEX[i : i + step])
    assert [(c.seq, c.offset, c.length) for c in chunks] == [
        (0, 0, 100),
        (1, 100, 100),
        (2, 200, 40),
    ]
    assert parser.clean and parser.consumed == len(INDEX)


def test_a_partial_last_line_waits() -> None:
    parser = IndexParser(XXH, max_chunk=100)
    assert parser.receive_data(INDEX[:-5]) and not parser.clean


@pytest.mark.parametrize(
    "bad",
    [
        f"C 1 0 100 {H}\n",  # out of order
        f"C 0 5 100 {H}\n",  # gap
        f"C 0 0 0 {H}\n",  # empty chunk
        f"C 0 0 101 {H}\n",  # larger than a chunk
        "C 0 0 100 xyz\n",  # bad hash
        f"C 0 0 50 {H}\nC 1 50 50 {H}\n",  # a short chunk that is not the last
        f"X 0 0 100 {H}\n",
        "C" * 600,  # an endless line
    ],
)
def test_bad_index_is_a_protocol_error(bad: str) -> None:
    with pytest.raises(ProtocolError):
        IndexParser(XXH, max_chunk=100).receive_data(bad.encode())


def _index(lengths: list[int]) -> bytes:
    lines, offset = [], 0
    for seq, length in enumerate(lengths):
        lines.append(f"C {seq} {offset} {length} {H}\n")
        offset += length
    return "".join(lines).encode()


def test_chunks_grow_from_the_first_to_the_chunk_size() -> None:
    """Issue 13: the first chunk is small so the host starts at once; each next one is
    four times the last until the snapshot's chunk size, which caps all (also below the
    first)."""
    cs = 8 * FIRST_CHUNK
    assert [chunk_length(seq, cs) for seq in range(5)] == [FIRST_CHUNK, 4 * FIRST_CHUNK, cs, cs, cs]
    assert chunk_length(0, 64 * 1024) == 64 * 1024 < FIRST_CHUNK
    assert chunk_length(GROWTH_STEPS, 1 << 40) == chunk_length(10**9, 1 << 40) == 1 << 40
    lengths = [FIRST_CHUNK, 4 * FIRST_CHUNK, cs, cs, 5]
    parser = IndexParser(XXH, cs)
    chunks = parser.receive_data(_index(lengths))
    assert [c.length for c in chunks] == lengths and parser.clean


@pytest.mark.parametrize(
    "lengths",
    [
        [2 * FIRST_CHUNK],  # a first chunk longer than the schedule's
        [FIRST_CHUNK, 2 * FIRST_CHUNK, 2 * FIRST_CHUNK],  # the second is short, not last
        [FIRST_CHUNK, 4 * FIRST_CHUNK, 16 * FIRST_CHUNK],  # longer than the chunk size
    ],
)
def test_an_index_off_the_schedule_is_a_protocol_error(lengths: list[int]) -> None:
    with pytest.raises(ProtocolError):
        IndexParser(XXH, 8 * FIRST_CHUNK).receive_data(_index(lengths))


def test_status_with_done_failed_and_tar_errors() -> None:
    payload = (
        f"exists 1\ndone_chunks 3\ndone_length 240\ndone_hash {H}\ndone_tar_rc 1\n"
        "done_comp_rc 0\ndone_unstable_bytes 0\ndone_gone_bytes 0\nalive 0\nlaunched 1\nindex_size 120\ndata_size 240\n"
        "tar_err_follows\ntar: x: file changed\x1b[31m\n"
    ).encode()
    st_ = parse_status(payload, XXH)
    assert st_.done is not None and st_.done.chunks == 3 and st_.done.tar_rc == 1
    assert "file changed" in st_.tar_errors and "\x1b" not in st_.tar_errors
    assert not parse_status(b"exists 0\n", XXH).exists


STATUS_HEAD = b"exists 1\nalive 1\nlaunched 1\nindex_size 300\ndata_size 240"


@pytest.mark.parametrize("digit", ["\u00b2", "\u0663", "\uff11"])  # superscript, Arabic, fullwidth
@pytest.mark.parametrize("field", ["done_chunks", "done_gone_bytes", "index_size", "data_size"])
def test_a_number_of_other_digits_than_ascii_is_a_protocol_error(digit: str, field: str) -> None:
    """``str.isdigit`` takes them and ``int`` refuses them: found by a review as a crash
    ("internal error") where a guest's ``sed`` appended one to a done record."""
    payload = (
        f"exists 1\ndone_chunks 3\ndone_length 240\ndone_hash {H}\ndone_tar_rc 0\n"
        "done_comp_rc 0\ndone_unstable_bytes 0\ndone_gone_bytes 0\nalive 0\nlaunched 1\n"
        "index_size 120\ndata_size 240\n"
    ).replace(f"{field} ", f"{field} 1{digit}")
    with pytest.raises(ProtocolError):
        parse_status(payload.encode(), XXH)
    probe = f"proto 1\nhas_tar 1\nstage_free_kb 9{digit}\n".encode()
    assert parse_probe(probe).stage_free_kb is None


@pytest.mark.parametrize(
    ("words", "shown"),
    [
        (b"tar exited 2: tar: ./caf\xe9: Cannot open", "./caf\\xe9: Cannot open"),
        # U+2028 and U+0085 end a line to str.splitlines(): a record ends at "\n" only
        ("tar exited 2: ./a\u2028b\x85c: gone".encode(), "./a\\u2028b\\x85c: gone"),
        # the producer cuts the message at 400 bytes, inside a character
        (("x" * 10 + "\u00e9").encode()[:-1], "xxxxxxxxxx\\xc3"),
    ],
)
def test_a_failed_record_in_any_bytes_is_read(words: bytes, shown: str) -> None:
    """The guest's failure message names files, in whatever bytes they have: it is read
    (escaped for a terminal), or no run would ever learn that the run failed."""
    for index in (b"", b"\nindex_from 0\nindex_tail 0\nindex_follows\n"):
        payload = b"exists 1\nfailed " + words + b"\nalive 0\nlaunched 1\nindex_size 0\n"
        st_ = parse_status(payload + b"data_size 0" + index, XXH, index_from=0 if index else -1)
        assert st_.failed is not None and shown in st_.failed, st_.failed
        assert not st_.alive and st_.index_size == 0


def test_only_the_failure_message_may_be_any_bytes() -> None:
    with pytest.raises(ProtocolError, match="'alive' is not UTF-8"):
        parse_status(STATUS_HEAD.replace(b"alive 1", b"alive 1\xe9"), XXH)
    with pytest.raises(ProtocolError, match="not UTF-8"):
        parse_fields(b"proto 1\nworkspace \xe9")


@pytest.mark.parametrize("errors", [b"", b"\ntar_err_follows\ntar: x: file changed\n"])
def test_status_carries_the_index_from_the_asked_offset(errors: bytes) -> None:
    tail = INDEX[10:]
    payload = (
        STATUS_HEAD + b"\nindex_from 10\nindex_tail %d\nindex_follows\n" % len(tail) + tail + errors
    )
    st_ = parse_status(payload, XXH, index_from=10)
    assert st_.index_tail == tail and st_.index_size == 300 and st_.alive
    assert ("file changed" in st_.tar_errors) == bool(errors)
    # an index tail ending without a newline is whole too (the parser keeps the partial line)
    cut = STATUS_HEAD + b"\nindex_from 10\nindex_tail 5\nindex_follows\n" + tail[:5]
    assert parse_status(cut, XXH, index_from=10).index_tail == tail[:5]
    assert parse_status(STATUS_HEAD, XXH, index_from=10).index_tail == b""


def test_status_carries_a_small_stream_whole() -> None:
    """``data_b64`` is the stream (``data_size`` bytes) in base64, beside an index tail;
    one that does not decode, or decodes to another size, is no stream: the chunks are
    read then, never taken from it."""
    stream = bytes(range(256)) * 3
    text = base64.b64encode(stream)
    head = b"exists 1\nalive 0\nlaunched 1\nindex_size 300\ndata_size %d" % len(stream)
    tail = INDEX[10:]
    payload = (
        head
        + b"\ndata_b64 "
        + text
        + b"\nindex_from 10\nindex_tail %d\nindex_follows\n" % len(tail)
        + tail
    )
    st_ = parse_status(payload, XXH, index_from=10)
    assert st_.inline == stream and st_.index_tail == tail
    assert parse_status(head, XXH).inline is None
    for bad in (text[:-4], text + b"AAAA", text[:8] + b"*" + text[9:], b"", b"a b"):
        assert parse_status(head + b"\ndata_b64 " + bad, XXH).inline is None, bad


@pytest.mark.parametrize(
    ("payload", "asked"),
    [
        # from another offset than the one asked for, or not asked for at all
        (STATUS_HEAD + b"\nindex_from 0\nindex_tail 3\nindex_follows\nC 0", 10),
        (STATUS_HEAD + b"\nindex_from 10\nindex_tail 3\nindex_follows\nC 0", -1),
        # shorter than it says, or followed by anything but the tar errors
        (STATUS_HEAD + b"\nindex_from 10\nindex_tail 9\nindex_follows\nC 0", 10),
        (STATUS_HEAD + b"\nindex_from 10\nindex_tail 3\nindex_follows\nC 0 junk", 10),
        (STATUS_HEAD + b"\nindex_from 10\nindex_tail x\nindex_follows\nC 0", 10),
    ],
)
def test_a_bad_index_tail_is_a_protocol_error(payload: bytes, asked: int) -> None:
    with pytest.raises(ProtocolError):
        parse_status(payload, XXH, index_from=asked)


def test_probe_report() -> None:
    report = parse_probe(
        b"proto 1\nhas_tar 1\nhas_zstd 0\ntest_xxh128 abc  stdin\nstage_free_kb 42\n"
    )
    assert report.has("tar") and not report.has("zstd")
    assert report.self_tests["xxh128"] == "abc" and report.stage_free_kb == 42
    with pytest.raises(ProtocolError):
        parse_probe(b"proto 2\n")


def test_probe_reports_the_resolved_staging_root() -> None:
    report = parse_probe(b"proto 1\nstage_root /tmp/wsync-1000\nstage_free_kb 7\n")
    assert report.stage_root == "/tmp/wsync-1000"
    assert parse_probe(b"proto 1\n").stage_root == ""


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"admitted", AdmitReport(False)),
        (b"reconciled 120 4000", AdmitReport(True, 120, 4000)),
        (b"admitted  4000", AdmitReport(False, None, 4000)),
        (b"admitted 12 ", AdmitReport(False, 12, None)),
    ],
)
def test_admit_answers(payload: bytes, expected: AdmitReport) -> None:
    assert parse_admit(payload) == expected


@pytest.mark.parametrize("payload", [b"adopted", b"admitted 1 2 3", b""])
def test_bad_admit_answers(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_admit(payload)


def test_stage_refusals_name_the_path_and_owner() -> None:
    owner = parse_stage_refusal("owner 65534 0 nobody\n/tmp/wsync-0")
    assert owner is not None and not owner.usage
    assert "/tmp/wsync-0 is owned by nobody (uid 65534)" in owner.message
    inside = parse_stage_refusal("inside\n/w/stage\n/w")
    assert inside is not None and inside.usage and "\n" not in inside.message
    hostile = parse_stage_refusal("symlink\n/tmp/\x1b[31mx")
    assert hostile is not None and "\x1b" not in hostile.message
    assert parse_stage_refusal("something else") is None


def test_the_disk_full_message_shape() -> None:
    assert disk_full_message(2048, "/tmp/wsync-0", 6 * 1024 + 10) == (
        "guest staging disk full: 2.0 MiB free at /tmp/wsync-0, the workspace needs about 6.0 MiB"
    )
    assert disk_full_message(0, "/s", None).endswith("the workspace needs more")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_parsers_raise_only_protocol_error(data: bytes) -> None:
    for parse in (
        lambda: IndexParser(XXH, 4096).receive_data(data),
        lambda: parse_status(data, XXH),
        lambda: parse_status(STATUS_HEAD + b"\nindex_from 7\n" + data, XXH, index_from=7),
        lambda: parse_status(STATUS_HEAD + b"\ndata_b64 " + data, XXH),
        lambda: parse_probe(data),
        lambda: parse_fields(data),
        lambda: parse_admit(data),
        lambda: parse_stage_refusal(data.decode("utf-8", "replace")),
    ):
        with contextlib.suppress(ProtocolError):
            parse()


def _index_upto() -> str:
    """The producer's ``index_upto`` function, as the guest runs it."""
    text = producer._PRODUCER
    start = text.index("index_upto() {")
    return text[start : text.index("\n}\n", start) + 3]


@pytest.mark.parametrize("shell", ["sh", "busybox"])
@pytest.mark.parametrize(
    ("chunk_size", "length"),
    [
        (64 * 1024, 300_000),  # below the first chunk: all of the chunk size
        (320 * 1024, 3_000_000),  # not a power of four
        (4 * 1024 * 1024, 50_000_000),
        (256 * 1024 * 1024, 3 << 30),  # the largest chunk size: every step, and past them
    ],
)
def test_the_producer_cuts_chunks_as_the_host_expects(
    tmp_path: Path, shell: str, chunk_size: int, length: int
) -> None:
    """The guest's ``index_upto`` (under dash and busybox sh, with the hash tool and dd
    stubbed) writes exactly the lengths :func:`chunk_length` gives, and the host's parser
    takes its index."""
    argv = ["busybox", "sh"] if shell == "busybox" else ["sh"]
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} is not installed")
    with (tmp_path / "data").open("wb") as f:
        f.truncate(length)  # sparse: only its size is read
    script = (
        'set -u\nfail() { echo "$*" >&2; exit 1; }\n'
        f"dd() {{ :; }}\nh() {{ echo {H}; }}\ncs={chunk_size} seq=0 off=0\n: > index\n"
        + _index_upto()
        + "index_upto final\n"
    )
    subprocess.run([*argv, "-c", script], cwd=tmp_path, check=True, timeout=60)
    chunks = IndexParser(XXH, chunk_size).receive_data((tmp_path / "index").read_bytes())
    lengths = [c.length for c in chunks]
    assert sum(lengths) == length
    assert lengths[:-1] == [chunk_length(seq, chunk_size) for seq in range(len(lengths) - 1)]


def test_ascii_digits_takes_ascii_digits_only() -> None:
    from wsync.digits import ascii_digits

    assert ascii_digits("0") and ascii_digits("1234567890")
    for text in ("", "-1", "1.0", " 1", "1\n", "\u00b2", "1\u0663", "\uff11"):
        assert not ascii_digits(text), text
