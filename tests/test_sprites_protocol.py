"""The Sprites exec codec and collector: pure functions, fed whole, split and fuzzed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync.errors import ProtocolError, UsageError
from wsync.transports.sprites_protocol import (
    STDERR,
    STDIN,
    STDOUT,
    Control,
    Data,
    ExecCollector,
    Exit,
    StdinEOF,
    decode,
    decode_binary,
    decode_text,
    encode_control,
    encode_data,
    encode_exit,
    encode_exit_text,
    encode_stdin_eof,
    exec_url,
    parse_exec_path,
)


def test_round_trip_every_frame_kind() -> None:
    assert decode(encode_data(STDOUT, b"\x00\xffabc")) == Data(STDOUT, b"\x00\xffabc")
    assert decode(encode_data(STDERR, b"")) == Data(STDERR, b"")
    assert decode(encode_data(STDIN, b"x")) == Data(STDIN, b"x")
    assert decode(encode_exit(0)) == Exit(0)
    assert decode(encode_exit(255)) == Exit(255)
    assert decode(encode_stdin_eof()) == StdinEOF()
    assert decode(encode_exit_text(7)) == Exit(7)
    info = decode(encode_control("session_info", session_id="5", is_owner=False))
    assert isinstance(info, Control)
    assert info.type == "session_info"
    assert info.payload["is_owner"] is False


def test_wire_bytes_match_the_documented_format() -> None:
    assert encode_exit(3) == b"\x03\x03"
    assert encode_stdin_eof() == b"\x04"
    assert encode_data(STDIN, b"a") == b"\x00a"
    assert json.loads(encode_exit_text(2)) == {"type": "exit", "exit_code": 2}
    with pytest.raises(ValueError, match="one-byte"):
        encode_exit(256)
    with pytest.raises(ValueError):
        encode_data(3, b"x")


@pytest.mark.parametrize(
    "frame",
    [
        b"",  # empty
        b"\x03",  # exit without a code
        b"\x03\x00\x00",  # exit with trailing bytes
        b"\x04\x00",  # stdin EOF with trailing bytes
        b"\x05hello",  # unknown stream id
        b"\xff",
    ],
)
def test_malformed_binary_frames_are_protocol_errors(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_binary(frame)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        '{"type":"exit","exit_code":0} trailing',  # trailing bytes after the JSON
        "[1,2]",
        '{"no_type":1}',
        '{"type":""}',
        '{"type":"exit"}',
        '{"type":"exit","exit_code":"0"}',
        '{"type":"exit","exit_code":true}',
        '{"type":"exit","exit_code":1e9}',
        "[" * 100_000,  # deep nesting must not escape as RecursionError
    ],
)
def test_malformed_text_frames_are_protocol_errors(text: str) -> None:
    with pytest.raises(ProtocolError):
        decode_text(text)


def test_unknown_text_types_are_kept_as_control() -> None:
    frame = decode_text('{"type":"port_opened","port":8080}')
    assert frame == Control("port_opened", {"type": "port_opened", "port": 8080})


def feed_all(messages: list[bytes | str], max_output: int = 1 << 20) -> ExecCollector:
    collector = ExecCollector(max_output)
    for message in messages:
        collector.feed(message)
    return collector


def test_collector_whole_and_byte_at_a_time_agree() -> None:
    payload = bytes(range(256)) * 4
    whole = feed_all([encode_data(STDOUT, payload), encode_exit(0)])
    split = feed_all([encode_data(STDOUT, payload[i : i + 1]) for i in range(len(payload))])
    split.feed(encode_exit(0))
    assert whole.result() == split.result()
    assert whole.result().stdout == payload
    assert whole.result().exit_status == 0


def test_collector_without_exit_frame_reports_none_never_zero() -> None:
    collector = feed_all([encode_data(STDOUT, b"partial")])
    collector.closed(1000, clean=True)
    result = collector.result()
    assert result.exit_status is None
    assert result.stdout == b"partial"
    assert any("closed without exit frame" in note for note in result.notes)


def test_collector_keeps_data_after_exit_and_notes_it() -> None:
    collector = feed_all(
        [encode_data(STDOUT, b"head"), encode_exit(0), encode_data(STDOUT, b"tail")]
    )
    collector.closed(1000, clean=True)
    result = collector.result()
    assert result.stdout == b"headtail"
    assert result.exit_status == 0
    assert "data after exit frame" in result.notes
    assert collector.bytes_after_exit == 4


def test_collector_truncates_per_stream_and_says_so() -> None:
    collector = feed_all(
        [encode_data(STDOUT, b"abcdef"), encode_data(STDERR, b"xy"), encode_exit(1)], max_output=4
    )
    result = collector.result()
    assert result.stdout == b"abcd"
    assert result.stderr == b"xy"
    assert result.truncated
    assert result.exit_status == 1


def test_collector_json_exit_and_conflicting_exits() -> None:
    collector = feed_all([encode_exit_text(2), encode_exit(5)])
    result = collector.result()
    assert result.exit_status == 2
    assert any("conflicting exit frames" in note for note in result.notes)


def test_collector_rejects_client_frames_from_the_server() -> None:
    with pytest.raises(ProtocolError):
        feed_all([encode_data(STDIN, b"x")])
    with pytest.raises(ProtocolError):
        feed_all([encode_stdin_eof()])


def test_exec_url_round_trips_through_the_server_parser() -> None:
    argv = ["sh", "-c", "printf '%s' \"$1\" && echo a&b=c;#", "x y", "ü/..", ""]
    url = exec_url(
        "https://api.example.test/base/",
        "my sprite",
        argv,
        stdin=True,
        workdir="/home/sprite/work dir",
        env={"A": "1=2", "B": ""},
    )
    assert url.startswith("wss://api.example.test/base/v1/sprites/my%20sprite/exec?cmd=sh&")
    path = url[len("wss://api.example.test/base") :]
    req = parse_exec_path(path)
    assert req is not None
    assert req.name == "my sprite"
    assert list(req.argv) == argv
    assert req.stdin is True
    assert req.tty is False
    assert req.workdir == "/home/sprite/work dir"
    assert req.env == (("A", "1=2"), ("B", ""))
    plain = exec_url("http://127.0.0.1:1", "s", ["true"], stdin=False)
    assert plain == "ws://127.0.0.1:1/v1/sprites/s/exec?cmd=true&stdin=false&tty=false"


@pytest.mark.parametrize("base", ["ftp://x", "api.sprites.dev", "https://"])
def test_exec_url_rejects_bad_bases(base: str) -> None:
    with pytest.raises(UsageError):
        exec_url(base, "s", ["true"], stdin=False)


def test_parse_exec_path_rejects_foreign_and_malformed_paths() -> None:
    assert parse_exec_path("/v1/sprites/s/files") is None
    assert parse_exec_path("/") is None
    for bad in (
        "/v1/sprites/s/exec",  # no cmd
        "/v1/sprites/../exec?cmd=ls",
        "/v1/sprites/%2F/exec?cmd=ls",
        "/v1/sprites/s/exec?cmd=ls&env=novalue",
        "/v1/sprites/s/exec?cmd=%ff",
    ):
        with pytest.raises(ProtocolError):
            parse_exec_path(bad)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64), st.text(max_size=64)))
def test_decode_fuzz_only_protocol_errors(message: bytes | str) -> None:
    try:
        frame = decode(message)
    except ProtocolError:
        return
    assert isinstance(frame, Data | Exit | StdinEOF | Control)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=16), st.text(max_size=16)), max_size=12))
def test_collector_fuzz_only_protocol_errors(messages: list[bytes | str]) -> None:
    collector = ExecCollector(8)
    for message in messages:
        try:
            collector.feed(message)
        except ProtocolError:
            continue
    result = collector.result()
    assert len(result.stdout) <= 8
    assert len(result.stderr) <= 8


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_parse_exec_path_fuzz_only_protocol_errors(tail: str) -> None:
    try:
        req = parse_exec_path("/v1/sprites/" + tail)
    except ProtocolError:
        return
    assert req is None or (req.name and req.argv)
