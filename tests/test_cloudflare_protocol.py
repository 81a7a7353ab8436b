"""The Bridge's SSE codec, sans-I/O: whole, byte at a time, with trailing bytes, fuzzed."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync.errors import ProtocolError, UsageError
from wsync.transports.cloudflare_protocol import (
    Event,
    ExecCollector,
    ExecFailed,
    SSEParser,
    encode_error,
    encode_event,
    encode_exit,
    encode_output,
    exec_body,
    exec_path,
    file_path,
    parse_exec_body,
    split_route,
)

STREAM = (
    encode_output("stdout", "hello\n")
    + encode_output("stderr", "warn ✓\n")
    + encode_output("stdout", "a\x00b\ufffd")
    + encode_exit(3)
)
EXPECTED = [
    Event("stdout", base64.b64encode(b"hello\n").decode()),
    Event("stderr", base64.b64encode("warn ✓\n".encode()).decode()),
    Event("stdout", base64.b64encode("a\x00b\ufffd".encode()).decode()),
    Event("exit", '{"exit_code":3}'),
]


def feed_all(parser: SSEParser, data: bytes, step: int | None = None) -> list[Event]:
    if step is None:
        return parser.feed(data)
    events: list[Event] = []
    for i in range(0, len(data), step):
        events += parser.feed(data[i : i + step])
    return events


@pytest.mark.parametrize("step", [None, 1, 2, 7, 64])
def test_events_whole_and_in_pieces(step: int | None) -> None:
    parser = SSEParser()
    assert feed_all(parser, STREAM, step) == EXPECTED
    assert not parser.pending


def test_trailing_bytes_stay_pending_until_the_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(STREAM + b"event: stdout\ndata: eA==") == EXPECTED
    assert parser.pending
    assert parser.feed(b"\n\n") == [Event("stdout", "eA==")]
    assert not parser.pending


def test_spec_details_crlf_cr_comments_multiline_and_no_space() -> None:
    raw = (
        b": heartbeat\r\n"
        b'event:exit\r\ndata:{"exit_code":\r\ndata: 0}\r\nid: 7\r\nretry: 10\r\n\r\n'
        b"data: plain\r\r"
        b"event: ignored-without-data\n\n"
    )
    for step in (None, 1):
        parser = SSEParser()
        events = feed_all(parser, raw, step)
        assert events == [Event("exit", '{"exit_code":\n0}'), Event("message", "plain")]


def test_oversized_line_and_bad_utf8_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError):
        SSEParser(max_event=100).feed(b"data: " + b"A" * 200)
    parser = SSEParser(max_event=100)
    parser.feed(b"data: " + b"A" * 60 + b"\n")
    with pytest.raises(ProtocolError):
        parser.feed(b"data: " + b"A" * 60 + b"\n")
    with pytest.raises(ProtocolError):
        SSEParser().feed(b"data: \xff\n\n")


def test_collector_is_honest() -> None:
    c = ExecCollector(max_output=4)
    for event in SSEParser().feed(STREAM):
        c.feed(event)
    result = c.result()
    assert result.stdout == b"hell"
    assert result.stderr == "warn ✓\n".encode()[:4]
    assert result.truncated
    assert result.exit_status == 3

    none = ExecCollector(100)
    for event in SSEParser().feed(encode_output("stdout", "x")):
        none.feed(event)
    none.ended(mid_event=False)
    assert none.result().exit_status is None  # never a guessed 0
    assert "stream ended without exit event" in none.result().notes


def test_collector_rejects_lies_it_can_see() -> None:
    for bad in (
        encode_event("stdout", "not base64!"),
        encode_event("exit", "{}"),
        encode_event("exit", '{"exit_code": "0"}'),
        encode_event("exit", '{"exit_code": true}'),
        encode_event("exit", "[0]"),
    ):
        c = ExecCollector(100)
        with pytest.raises(ProtocolError):
            for event in SSEParser().feed(bad):
                c.feed(event)
    c = ExecCollector(100)
    with pytest.raises(ExecFailed, match="exec_transport_error"):
        for event in SSEParser().feed(encode_error("boom", "exec_transport_error")):
            c.feed(event)
    late = ExecCollector(100)
    for event in SSEParser().feed(encode_exit(0) + encode_output("stdout", "late")):
        late.feed(event)
    assert late.result().stdout == b"late"
    assert "data after exit event" in late.result().notes


def test_bodies_and_paths() -> None:
    body = exec_body(["sh", "-c", "echo 'x'"], timeout_ms=5000)
    req = parse_exec_body(body)
    assert (req.argv, req.timeout_ms, req.cwd) == (["sh", "-c", "echo 'x'"], 5000, None)
    for bad in (b"{", b"[]", b'{"argv": []}', b'{"argv": [1]}', b'{"argv":["a"],"timeout_ms":-1}'):
        with pytest.raises(ProtocolError):
            parse_exec_body(bad)
    path = file_path("my box", "/workspace/a b/%x")
    assert path == "/v1/sandbox/my%20box/file/workspace/a%20b/%25x"
    assert split_route(path) == ("my box", "file", "/workspace/a b/%x")
    assert split_route("/v1/sandbox/b/exec") == ("b", "exec", "")
    assert split_route("/v1/sandbox/b/other") is None
    assert split_route("/v2/x") is None
    with pytest.raises(UsageError):
        file_path("b", "relative")
    with pytest.raises(UsageError):
        file_path("a/b", "/x")


@pytest.mark.parametrize(
    "path", ["/workspace/../v1/sandbox/victim/file/x", "/workspace/./x", "/workspace//x", "/x/"]
)
def test_a_file_path_with_dot_or_empty_parts_is_refused(path: str) -> None:
    """Found by a red-team review: the URL's path is resolved, so a staging root with
    ``..`` parts (the guest reports it) sent the token to another sandbox's route."""
    with pytest.raises(UsageError, match="no empty"):
        file_path("sb1", path)


@pytest.mark.parametrize("sandbox", [".", ".."])
def test_a_dot_sandbox_id_is_refused(sandbox: str) -> None:
    """``..`` as the id made the exec URL ``/v1/exec`` (above the sandbox routes)."""
    with pytest.raises(UsageError, match="bad Cloudflare sandbox id"):
        exec_path(sandbox)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["stdout", "stderr"]), st.text(max_size=300)), max_size=12),
    st.integers(0, 2**31 - 1),
    st.lists(st.integers(1, 50), min_size=1, max_size=20),
)
def test_any_split_gives_the_same_result(
    outputs: list[tuple[str, str]], code: int, steps: list[int]
) -> None:
    """The invariant: however the bytes are cut, the decoded result is the same."""
    raw = b"".join(encode_output(n, t) for n, t in outputs) + encode_exit(code)
    parser, collector = SSEParser(), ExecCollector(1 << 20)
    pos, i = 0, 0
    while pos < len(raw):
        step = steps[i % len(steps)]
        for event in parser.feed(raw[pos : pos + step]):
            collector.feed(event)
        pos, i = pos + step, i + 1
    result = collector.result()
    enc = lambda name: "".join(t for n, t in outputs if n == name).encode("utf-8", "surrogatepass")  # noqa: E731
    assert result.stdout == enc("stdout")
    assert result.stderr == enc("stderr")
    assert result.exit_status == code


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_garbage_raises_only_protocol_error(data: bytes) -> None:
    parser, collector = SSEParser(max_event=256), ExecCollector(1000)
    try:
        for event in parser.feed(data) + parser.feed(b"\n\n"):
            collector.feed(event)
    except ProtocolError:
        pass


def test_a_deeply_nested_exit_event_is_a_protocol_error() -> None:
    """json's RecursionError escaped exec before (review)."""
    from wsync.transports.cloudflare_protocol import Event, _json_object

    with pytest.raises(ProtocolError):
        _json_object(Event(name="exit", data="[" * 100_000))


def _collect(raw: bytes, steps: list[int], runs: bool, max_output: int) -> object:
    """The result (or the error) of one stream fed in pieces of ``steps`` bytes."""
    parser, collector = SSEParser(max_event=4096), ExecCollector(max_output)
    feed = parser.feed_runs if runs else parser.feed
    pos, i = 0, 0
    try:
        while pos < len(raw):
            step = steps[i % len(steps)]
            for event in feed(raw[pos : pos + step]):
                collector.feed(event)
            pos, i = pos + step, i + 1
        collector.ended(mid_event=parser.pending)
    except ProtocolError as err:
        return type(err)
    return collector.result()


_PIECES = st.one_of(
    st.tuples(st.sampled_from(["stdout", "stderr"]), st.text(max_size=80)).map(
        lambda p: encode_output(*p)
    ),
    st.integers(-5, 300).map(encode_exit),
    st.sampled_from(
        [
            b"event: stdout\ndata: QQ=\n\n",  # bad padding
            b"event: stdout\ndata: QQ==\ndata: Qg==\n\n",  # two data lines
            b"event: stdout\r\ndata: QQ==\r\n\r\n",
            b": comment\n",
            b"event: stderr\ndata: " + b"A" * 5000 + b"\n\n",  # over max_event
            b"event: weird\ndata: QQ==\n\n",
            b"event: stdout\n\n",
            b"data: QQ==\n\n",
        ]
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_PIECES, max_size=30),
    st.lists(st.integers(1, 400), min_size=1, max_size=10),
    st.sampled_from([1 << 20, 50]),
)
def test_runs_decode_exactly_as_single_events(
    pieces: list[bytes], steps: list[int], max_output: int
) -> None:
    """``feed_runs`` (session-mode output as one object per run) changes speed, not
    results: same bytes, same exit, same notes, same errors, however the stream is cut."""
    raw = b"".join(pieces)
    assert _collect(raw, steps, True, max_output) == _collect(raw, steps, False, max_output)


def test_line_events_come_as_one_run_per_name() -> None:
    raw = b"".join(encode_output("stdout", f"line {i}\n") for i in range(1000))
    raw += encode_output("stderr", "warn\n") + encode_exit(0)
    items = SSEParser().feed_runs(raw)
    assert [type(item).__name__ for item in items] == ["OutputRun", "OutputRun", "Event"]
    collector = ExecCollector(1 << 20)
    for item in items:
        collector.feed(item)
    assert collector.result().stdout == "".join(f"line {i}\n" for i in range(1000)).encode()


@given(st.sampled_from(["stdout", "stderr"]), st.lists(st.text(max_size=100), max_size=20))
def test_batch_encoding_is_byte_for_byte_the_single_one(name: str, texts: list[str]) -> None:
    from wsync.transports.cloudflare_protocol import encode_outputs

    assert encode_outputs(name, texts) == b"".join(encode_output(name, t) for t in texts)
