"""The Docker exec wire format, sans-I/O: frames whole, byte at a time, cut, and fuzzed.

Every parser here gets its input whole, one byte at a time and split at random, and must
give the same output every way; a cut stream and trailing bytes are errors, never output;
arbitrary bytes give output or a :class:`ProtocolError`, nothing else.
"""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync.errors import ProtocolError, UsageError
from wsync.transports.base import error_message
from wsync.transports.docker_protocol import (
    DEFAULT_SOCKET,
    STDERR,
    STDIN,
    STDOUT,
    SYSTEMERR,
    Endpoint,
    ExecCollector,
    FrameDecoder,
    Inspect,
    check_container,
    check_start_answer,
    encode_frame,
    exec_create_body,
    parse_docker_host,
    parse_exec_create,
    parse_exec_id,
    parse_inspect,
)

FRAMES = [
    (STDOUT, b"hello\n"),
    (STDERR, b"warning: x\n"),
    (STDOUT, b""),
    (STDOUT, bytes(range(256)) * 3),
    (STDIN, b"echoed"),
    (STDERR, b"\x00\r\n\xff"),
]
WIRE = b"".join(encode_frame(s, p) for s, p in FRAMES)


def decode(pieces: list[bytes]) -> tuple[bytes, bytes, int]:
    collector = ExecCollector(1 << 30)
    for piece in pieces:
        collector.feed(piece)
    collector.eof()
    result = collector.result(0)
    return result.stdout, result.stderr, collector.decoder.frames


EXPECTED = (
    b"hello\n" + bytes(range(256)) * 3 + b"echoed",
    b"warning: x\n\x00\r\n\xff",
    len(FRAMES),
)


def test_whole_byte_at_a_time_and_random_splits_agree() -> None:
    assert decode([WIRE]) == EXPECTED
    assert decode([WIRE[i : i + 1] for i in range(len(WIRE))]) == EXPECTED
    rng = random.Random(3)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(WIRE)), rng.randrange(1, 12)))
        pieces = [WIRE[a:b] for a, b in zip([0, *cuts], [*cuts, len(WIRE)], strict=True)]
        assert decode(pieces) == EXPECTED


def test_a_header_split_across_reads_is_held_back_not_output() -> None:
    decoder = FrameDecoder()
    frame = encode_frame(STDERR, b"abc")
    assert decoder.feed(frame[:5]) == []
    assert decoder.pending == 5
    assert decoder.feed(frame[5:9]) == [(STDERR, b"a")]
    assert decoder.feed(frame[9:]) == [(STDERR, b"bc")]
    assert decoder.pending == 0
    decoder.eof()


def test_payload_is_streamed_not_buffered_whole() -> None:
    """A frame may claim 4 GiB: its bytes come out as they arrive."""
    decoder = FrameDecoder()
    header = bytes([STDOUT, 0, 0, 0]) + (0xFFFFFFFF).to_bytes(4, "big")
    assert decoder.feed(header + b"x" * 10) == [(STDOUT, b"x" * 10)]
    assert decoder.pending == 0xFFFFFFFF - 10
    with pytest.raises(ProtocolError, match="payload bytes missing"):
        decoder.eof()


@pytest.mark.parametrize("cut", [1, 4, 7, 8, 9, len(WIRE) - 1])
def test_a_stream_cut_inside_a_frame_is_an_error(cut: int) -> None:
    collector = ExecCollector(1 << 20)
    collector.feed(WIRE[:cut])
    with pytest.raises(ProtocolError) as info:
        collector.eof()
    assert info.value.fault == "truncated"


def test_trailing_bytes_that_are_not_a_frame_are_an_error() -> None:
    # a partial header after complete frames: the stream ended in the middle of one
    with pytest.raises(ProtocolError, match="frame header"):
        decode([WIRE, b"\x01\x00"])
    # bytes that are no header at all (a TTY stream, a proxy's HTML): refused at once
    with pytest.raises(ProtocolError, match="unknown stream type"):
        decode([WIRE, b"<html>..."])
    with pytest.raises(ProtocolError, match="padding"):
        FrameDecoder().feed(b"\x01\x00\x01\x00\x00\x00\x00\x00")


def test_system_error_frames_are_kept_apart_and_bounded() -> None:
    collector = ExecCollector(100)
    collector.feed(encode_frame(SYSTEMERR, b"oci runtime error " * 1000))
    collector.feed(encode_frame(STDOUT, b"ok"))
    collector.eof()
    assert collector.result(0).stdout == b"ok"
    assert collector.system_error is not None
    assert collector.system_error.startswith("oci runtime error")
    assert len(collector.system_error) <= 500
    assert ExecCollector(10).system_error is None


def test_max_output_is_per_stream_and_says_truncated() -> None:
    collector = ExecCollector(5)
    collector.feed(encode_frame(STDOUT, b"0123456789") + encode_frame(STDERR, b"ab"))
    collector.eof()
    result = collector.result(None)
    assert (result.stdout, result.stderr, result.truncated) == (b"01234", b"ab", True)
    assert result.exit_status is None  # the collector never invents an exit status


def test_create_body_round_trips_and_is_never_a_tty() -> None:
    body = exec_create_body(
        ["sh", "-c", 'echo "$1"', "sh", "it's $(x)"],
        stdin=True,
        env={"A": "b=c", "WSYNC_EXEC": "t"},
        workdir="/w",
        user="1000",
    )
    parsed = parse_exec_create(body)
    assert parsed.cmd == ("sh", "-c", 'echo "$1"', "sh", "it's $(x)")
    assert parsed.stdin is True
    assert parsed.env == {"A": "b=c", "WSYNC_EXEC": "t"}
    assert (parsed.workdir, parsed.user) == ("/w", "1000")
    assert b'"Tty":false' in body
    with pytest.raises(UsageError):
        exec_create_body([], stdin=False)
    with pytest.raises(ProtocolError, match="No exec command"):
        parse_exec_create(b'{"Cmd":[]}')
    with pytest.raises(ProtocolError, match="Tty"):
        parse_exec_create(b'{"Cmd":["x"],"Tty":true}')


def test_inspect_null_is_never_zero() -> None:
    running = parse_inspect(b'{"Running":true,"ExitCode":null,"Pid":12}')
    assert running == Inspect(True, None, 12)
    assert not running.finished
    late = parse_inspect(b'{"Running":false,"ExitCode":null}')
    assert late.exit_code is None and not late.finished
    done = parse_inspect(b'{"Running":false,"ExitCode":0}')
    assert done.finished and done.exit_code == 0
    assert parse_inspect(Inspect(False, 137, 5).to_json("id", "c")) == Inspect(False, 137, 5)
    for bad in (b'{"Running":"no"}', b'{"Running":false,"ExitCode":true}', b"[]", b"x"):
        with pytest.raises(ProtocolError):
            parse_inspect(bad)


def test_exec_ids_and_errors() -> None:
    assert parse_exec_id(b'{"Id":"' + b"ab" * 32 + b'"}') == "ab" * 32
    for bad in (b'{"Id":"../x"}', b'{"Id":""}', b'{"Id":5}', b"{}", b"nope"):
        with pytest.raises(ProtocolError):
            parse_exec_id(bad)
    assert error_message(b'{"message":"No such container: x"}') == "No such container: x"
    assert error_message(b"plain text\n") == "plain text"


def test_start_answers() -> None:
    check_start_answer(101, {"upgrade": "tcp"})
    check_start_answer(200, {"content-type": "application/vnd.docker.raw-stream"})
    with pytest.raises(ProtocolError):
        check_start_answer(101, {"upgrade": "websocket"})
    with pytest.raises(ProtocolError, match="framed body"):
        check_start_answer(200, {"transfer-encoding": "chunked"})
    with pytest.raises(ProtocolError):
        check_start_answer(204, {})


def test_docker_host_forms() -> None:
    assert parse_docker_host("") == Endpoint(unix_path=DEFAULT_SOCKET)
    assert parse_docker_host("unix:///run/user/1000/docker.sock") == Endpoint(
        unix_path="/run/user/1000/docker.sock"
    )
    assert parse_docker_host("tcp://10.0.0.2:2375") == Endpoint(host="10.0.0.2", port=2375)
    assert parse_docker_host("tcp://docker") == Endpoint(host="docker", port=2375)
    assert str(parse_docker_host("tcp://[::1]:99")) == "tcp://[::1]:99"
    for bad in ("ssh://me@host", "npipe:////./pipe/docker", "unix://rel/path", "tcp://u:p@h:1"):
        with pytest.raises(UsageError):
            parse_docker_host(bad)


def test_container_names() -> None:
    for good in ("web", "My_Box.1-2", "a" * 64):
        assert check_container(good) == good
    for bad in ("", "-x", "a/b", "a b", "ü", ".hidden"):
        with pytest.raises(UsageError):
            check_container(bad)


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=300), splits=st.lists(st.integers(0, 300), max_size=6))
def test_fuzz_arbitrary_bytes_parse_or_raise_protocol_error(data: bytes, splits: list[int]) -> None:
    cuts = sorted({min(s, len(data)) for s in splits})
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    try:
        whole = decode([data])
    except ProtocolError:
        whole = None
    try:
        split = decode(pieces)
    except ProtocolError:
        split = None
    assert whole == split
    for parser in (parse_inspect, parse_exec_id, parse_exec_create):
        with contextlib.suppress(ProtocolError):
            parser(data)


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(st.tuples(st.sampled_from([STDIN, STDOUT, STDERR]), st.binary(max_size=200))),
    seed=st.integers(0, 2**16),
)
def test_fuzz_encoded_frames_always_round_trip(frames: list[tuple[int, bytes]], seed: int) -> None:
    wire = b"".join(encode_frame(s, p) for s, p in frames)
    rng = random.Random(seed)
    pieces, pos = [], 0
    while pos < len(wire):
        step = rng.randrange(1, 20)
        pieces.append(wire[pos : pos + step])
        pos += step
    stdout = b"".join(p for s, p in frames if s != STDERR)
    stderr = b"".join(p for s, p in frames if s == STDERR)
    assert decode(pieces) == (stdout, stderr, len(frames))


@pytest.mark.parametrize("host", ["a..b", "a" * 64 + ".example", "-x-.\udcff"])
def test_a_docker_host_dns_cannot_spell_is_a_usage_error(host: str) -> None:
    """Found by a red-team review: ``tcp://a..b:2375`` passed, and the resolver's
    UnicodeError (IDNA: an empty or over-long label) came out of every exec as an
    internal error (exit 1, "report this")."""
    with pytest.raises(UsageError, match="host"):
        parse_docker_host(f"tcp://{host}:2375")
