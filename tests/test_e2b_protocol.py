"""The envd Connect codec and collector: pure functions, fed whole, byte at a time,
with trailing bytes, and fuzzed ("parses or raises our ProtocolError")."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync.errors import ProtocolError
from wsync.transports.e2b_protocol import (
    FLAG_END_STREAM,
    Data,
    End,
    EndStream,
    Envelope,
    EnvelopeDecoder,
    Keepalive,
    Start,
    StartCollector,
    decode_end_stream,
    decode_event,
    encode_end_stream,
    encode_envelope,
    encode_event,
    parse_content_range,
    parse_range,
    parse_start_request,
    parse_unary,
    send_input_body,
    signal_status,
    start_request,
)

PAYLOAD = bytes(range(256)) * 300  # every byte value, several envelopes


def body(*events: Start | Data | Keepalive | End, end_stream: bytes | None = None) -> bytes:
    """A whole Start response body as envd writes it."""
    out = b"".join(encode_event(e) for e in events)
    return out + (encode_end_stream() if end_stream is None else end_stream)


def happy_body() -> bytes:
    chunks = [PAYLOAD[i : i + 32 * 1024] for i in range(0, len(PAYLOAD), 32 * 1024)]
    return body(
        Start(4321),
        *(Data("stdout", c) for c in chunks),
        Data("stderr", b"warn\n"),
        Keepalive(),
        End(0, True, "exit status 0"),
    )


def test_wire_bytes_match_the_documented_format() -> None:
    assert encode_envelope(b"{}", end_stream=True) == b"\x02\x00\x00\x00\x02{}"
    assert encode_event(Data("stdout", b"hello\n")) == (
        b"\x00\x00\x00\x00\x28" + b'{"event":{"data":{"stdout":"aGVsbG8K"}}}'
    )
    # proto3 JSON omits zero values: a clean exit has no exitCode key
    clean = json.loads(encode_event(End(0, True, "exit status 0"))[5:])
    assert clean == {"event": {"end": {"exited": True, "status": "exit status 0"}}}
    killed = json.loads(encode_event(End(-1, False, "signal: killed", "signal: killed"))[5:])
    assert killed["event"]["end"]["exitCode"] == -1
    assert json.loads(encode_end_stream("deadline_exceeded", "x")[5:]) == {
        "error": {"code": "deadline_exceeded", "message": "x"}
    }


def test_start_request_always_says_stdin_and_round_trips() -> None:
    raw = start_request(["/bin/sh", "-c", "x"], stdin=False, cwd="/w", envs={"A": "b"})
    decoder = EnvelopeDecoder()
    (env,) = decoder.feed(raw)
    obj = json.loads(env.message)
    assert obj["stdin"] is False
    req = parse_start_request(env.message)
    assert (req.cmd, req.args, req.cwd, req.envs, req.stdin) == (
        "/bin/sh",
        ("-c", "x"),
        "/w",
        (("A", "b"),),
        False,
    )
    absent = parse_start_request(b'{"process":{"cmd":"cat"}}')
    assert absent.stdin is None  # envd then keeps a stdin pipe open
    pid, obj = parse_unary(send_input_body(7, b"\x00\xff"))
    assert pid == 7
    assert base64.b64decode(obj["input"]["stdin"]) == b"\x00\xff"


def collect(chunks: list[bytes], max_output: int = 1 << 22) -> StartCollector:
    collector = StartCollector(max_output)
    for chunk in chunks:
        collector.feed(chunk)
    return collector


def test_whole_and_byte_at_a_time_agree() -> None:
    raw = happy_body()
    whole = collect([raw]).result()
    split = collect([raw[i : i + 1] for i in range(len(raw))]).result()
    assert whole == split
    assert whole.stdout == PAYLOAD
    assert whole.stderr == b"warn\n"
    assert whole.exit_status == 0
    assert whole.notes == ()


def test_trailing_bytes_after_end_stream_are_a_protocol_error() -> None:
    raw = happy_body()
    with pytest.raises(ProtocolError, match="after the end-stream"):
        collect([raw + b"\x00"])
    with pytest.raises(ProtocolError, match="after the end-stream"):
        collect([raw, b"x"])


@pytest.mark.parametrize("cut", [0, 3, 5, 40, -6, -1])
def test_a_body_without_end_stream_is_truncation_never_success(cut: int) -> None:
    raw = happy_body()
    end_stream_len = len(encode_end_stream())
    if cut < 0:
        cut = len(raw) - end_stream_len + cut + 1  # inside or just before the end-stream
    result = collect([raw[:cut]]).result()
    assert result.exit_status is None
    assert any("end-stream" in n or "inside an envelope" in n for n in result.notes)


def test_missing_exit_code_is_zero_only_inside_a_received_end_event() -> None:
    ended = collect([body(Start(1), End(0, True, "exit status 0"))]).result()
    assert ended.exit_status == 0
    no_end = collect([body(Start(1), Data("stdout", b"x"))]).result()
    assert no_end.exit_status is None
    assert "end-stream message without an end event" in no_end.notes
    failed = collect([body(Start(1), End(3, True, "exit status 3", "exit status 3"))]).result()
    assert failed.exit_status == 3


def test_killed_is_137_and_errors_are_reported_not_success() -> None:
    killed = collect([body(Start(1), End(-1, False, "signal: killed", "signal: killed"))])
    assert killed.result().exit_status == 137
    odd = collect([body(Start(1), End(-1, False, "signal: weird"))]).result()
    assert odd.exit_status is None
    race = collect(
        [
            body(
                Start(1),
                End(0, True, "exit status 0"),
                end_stream=encode_end_stream("deadline_exceeded"),
            )
        ]
    )
    assert race.error == EndStream("deadline_exceeded", "")
    assert race.result().exit_status is None
    assert signal_status(2, "exit status 2") == 2
    assert signal_status(-1, "signal: terminated") == 143


def test_max_output_truncates_and_says_so() -> None:
    result = collect([happy_body()], max_output=1000).result()
    assert result.stdout == PAYLOAD[:1000]
    assert result.truncated
    assert result.exit_status == 0


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"not json",
        b"[]",
        b'{"event":{}}',
        b'{"event":{"start":{},"end":{}}}',
        b'{"event":{"data":{"stdout":"!!notbase64"}}}',
        b'{"event":{"data":{"stdout":"aGk=","stderr":"aGk="}}}',
        b'{"event":{"data":{"pty":"aGk="}}}',
        b'{"event":{"end":{"exitCode":"x"}}}',
        b'{"event":{"end":{"exitCode":true}}}',
        b'{"event":{"end":{"exited":1}}}',
        b'{"event":{"start":{"pid":-1}}}',
        b'{"event":{"bogus":{}}}',
        b"[" * 100_000,
    ],
)
def test_malformed_events_are_protocol_errors(message: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_event(message)


def test_event_sequence_rules() -> None:
    with pytest.raises(ProtocolError, match="after the end event"):
        collect([body(Start(1), End(0, True, ""), Data("stdout", b"late"))])
    with pytest.raises(ProtocolError, match="second end"):
        collect([body(Start(1), End(0, True, ""), End(0, True, ""))])
    with pytest.raises(ProtocolError, match="start event out of place"):
        collect([body(Data("stdout", b"x"), Start(1))])
    with pytest.raises(ProtocolError, match="compressed"):
        EnvelopeDecoder().feed(b"\x01\x00\x00\x00\x00")
    with pytest.raises(ProtocolError, match="flags"):
        EnvelopeDecoder().feed(b"\x80\x00\x00\x00\x00")
    with pytest.raises(ProtocolError, match="exceeds"):
        EnvelopeDecoder(max_message=10).feed(b"\x00\x00\x00\x00\x0b")
    decoder = EnvelopeDecoder()
    decoder.feed(b"\x00\x00\x00")
    with pytest.raises(ProtocolError, match="inside an envelope"):
        decoder.eof()
    assert decode_end_stream(b"{}") == EndStream()
    assert decode_end_stream(b'{"metadata":{}}') == EndStream()


def test_ranges() -> None:
    assert parse_range("bytes=0-9", 100) == (0, 9)
    assert parse_range("bytes=90-", 100) == (90, 99)
    assert parse_range("bytes=95-200", 100) == (95, 99)
    assert parse_range("bytes=-10", 100) == (90, 99)
    assert parse_range("bytes=100-", 100) is None
    with pytest.raises(ProtocolError):
        parse_range("bytes=1-2,5-6", 100)
    assert parse_content_range("bytes 5-9/100") == (5, 9, 100)
    assert parse_content_range("bytes 5-9/*") == (5, 9, None)
    with pytest.raises(ProtocolError):
        parse_content_range("bytes 9-5/100")


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=300), splits=st.lists(st.integers(0, 300), max_size=6))
def test_fuzz_arbitrary_bytes_parse_or_raise_protocol_error(data: bytes, splits: list[int]) -> None:
    cuts = sorted({min(s, len(data)) for s in splits})
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    collector = StartCollector(1 << 16)
    try:
        for piece in pieces:
            collector.feed(piece)
    except ProtocolError:
        return
    result = collector.result()
    if collector.end_stream is None:
        assert result.exit_status is None


@settings(max_examples=300, deadline=None)
@given(
    prefix=st.integers(0, 6),
    flags=st.sampled_from([0, FLAG_END_STREAM]),
    message=st.binary(max_size=80) | st.sampled_from([b"{}", b'{"event":{"keepalive":{}}}']),
)
def test_fuzz_framed_garbage_parses_or_raises_protocol_error(
    prefix: int, flags: int, message: bytes
) -> None:
    raw = happy_body()[: prefix * 7] + bytes([flags]) + len(message).to_bytes(4, "big") + message
    try:
        collector = collect([raw])
    except ProtocolError:
        return
    if collector.end_stream is None:
        assert collector.result().exit_status is None


def test_envelope_dataclass() -> None:
    assert Envelope(FLAG_END_STREAM, b"{}").end_stream
    assert not Envelope(0, b"{}").end_stream
