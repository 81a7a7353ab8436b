"""The pods/exec codec and collector: pure functions, fed whole, byte at a time and fuzzed."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync.errors import ProtocolError, UsageError
from wsync.transports import k8s_protocol as kp

BINARY = (kp.V5, kp.V4)


def test_wire_bytes_match_the_documented_format() -> None:
    assert kp.encode(kp.STDOUT, b"\n", kp.V5) == b"\x01\n"
    assert kp.encode(kp.STDOUT, b"\n", kp.V4_BASE64) == "1Cg=="
    assert kp.encode(kp.STDOUT, b"", kp.V5) == b"\x01"  # the kubelet's greeting
    assert kp.encode_close(kp.STDIN) == b"\xff\x00"
    with pytest.raises(ValueError):
        kp.encode(kp.CLOSE, b"", kp.V5)
    assert json.loads(kp.encode_status(0)) == {"metadata": {}, "status": "Success"}
    failure = json.loads(kp.encode_status(2))
    assert failure["reason"] == "NonZeroExitCode"
    assert failure["details"]["causes"] == [{"reason": "ExitCode", "message": "2"}]
    assert json.loads(kp.encode_status(None, reason="InternalError"))["code"] == 500


@pytest.mark.parametrize("protocol", [kp.V5, kp.V4, kp.V4_BASE64])
@pytest.mark.parametrize("channel", [kp.STDIN, kp.STDOUT, kp.STDERR, kp.ERROR])
def test_every_channel_round_trips(protocol: str, channel: int) -> None:
    payload = bytes(range(256)) * 3
    assert kp.decode(kp.encode(channel, payload, protocol), protocol) == kp.Data(channel, payload)
    assert kp.decode(kp.encode(channel, b"", protocol), protocol) == kp.Data(channel, b"")


def test_close_and_empty_frames() -> None:
    assert kp.decode(kp.encode_close(kp.STDIN), kp.V5) == kp.Close(kp.STDIN)
    assert kp.decode(b"", kp.V5) == kp.Empty()
    assert kp.decode("", kp.V4_BASE64) == kp.Empty()
    with pytest.raises(ProtocolError, match="CLOSE"):
        kp.decode(kp.encode_close(kp.STDIN), kp.V4)  # v4 has no CLOSE


@pytest.mark.parametrize(
    ("message", "protocol"),
    [
        (b"\x05x", kp.V5),  # unknown channel
        (b"\xfe", kp.V5),
        (b"\xff", kp.V5),  # CLOSE without a channel
        (b"\xff\x00\x00", kp.V5),  # CLOSE with trailing bytes
        (b"\xff\x09", kp.V5),
        ("1Cg==", kp.V5),  # text on a binary protocol
        (b"\x01x", kp.V4_BASE64),  # binary on a base64 protocol
        ("9Cg==", kp.V4_BASE64),
        ("1 not base64!", kp.V4_BASE64),
        ("1Cg=", kp.V4_BASE64),
        ("1é", kp.V4_BASE64),
    ],
)
def test_malformed_messages_are_protocol_errors(message: bytes | str, protocol: str) -> None:
    with pytest.raises(ProtocolError):
        kp.decode(message, protocol)


@settings(max_examples=400)
@given(message=st.one_of(st.binary(max_size=64), st.text(max_size=64)), proto=st.sampled_from(
    [kp.V5, kp.V4, kp.V4_BASE64, None]))  # fmt: skip
def test_fuzzed_messages_decode_or_raise_protocol_error_only(
    message: bytes | str, proto: str | None
) -> None:
    try:
        frame = kp.decode(message, proto)
    except ProtocolError:
        return
    assert isinstance(frame, kp.Data | kp.Close | kp.Empty)


# --------------------------------------------------------------------- status


def test_status_success_nonzero_and_internal_error() -> None:
    assert kp.parse_status(kp.encode_status(0)).exit_code == 0
    assert kp.parse_status(kp.encode_status(42)).exit_code == 42
    assert kp.parse_status(kp.encode_status(255)).exit_code == 255
    internal = kp.parse_status(kp.encode_status(None, reason="InternalError"))
    assert internal.exit_code is None
    assert internal.reason == "InternalError"
    real = (
        b'{"metadata":{},"status":"Failure","message":"command terminated with non-zero exit '
        b'code: Error executing in Docker Container: 1","reason":"NonZeroExitCode",'
        b'"details":{"causes":[{"reason":"ExitCode","message":"1"}]}}'
    )
    assert kp.parse_status(real).exit_code == 1


@pytest.mark.parametrize("cause", ["256", "-1", "abc", "", "1.0", " 0", "0x1", "\uff11", None])
def test_exit_codes_client_go_cannot_parse_are_unknown_not_guessed(cause: str | None) -> None:
    causes = [] if cause is None else [{"reason": "ExitCode", "message": cause}]
    doc = {"status": "Failure", "reason": "NonZeroExitCode", "details": {"causes": causes}}
    status = kp.parse_status(json.dumps(doc).encode())
    assert status.exit_code is None
    assert status.reason == "BadExitCode"


@pytest.mark.parametrize(
    "payload",
    [b"", b"not json", b"[]", b'"Success"', b'{"status":"Maybe"}', b"\xff\xfe", b'{"status":1}'],
)
def test_unparsable_status_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        kp.parse_status(payload)


# --------------------------------------------------------------------- collector


def messages(protocol: str, status: bytes, out: bytes, err: bytes = b"") -> list[bytes | str]:
    return [
        kp.encode(kp.STDOUT, b"", protocol),
        kp.encode(kp.STDOUT, out, protocol),
        kp.encode(kp.STDERR, err, protocol),
        kp.encode(kp.ERROR, status, protocol),
    ]


@pytest.mark.parametrize("protocol", [kp.V5, kp.V4, kp.V4_BASE64])
def test_collector_whole_messages(protocol: str) -> None:
    c = kp.ExecCollector(1 << 20, protocol)
    for m in messages(protocol, kp.encode_status(3), b"out", b"err"):
        c.feed(m)
    c.closed(1000, clean=True)
    r = c.result()
    assert (r.stdout, r.stderr, r.exit_status, r.truncated, r.notes) == (
        b"out",
        b"err",
        3,
        False,
        (),
    )


@pytest.mark.parametrize("protocol", [kp.V5, kp.V4_BASE64])
def test_collector_byte_at_a_time(protocol: str) -> None:
    """Output and even the Status split into one-byte messages arrive whole."""
    out, status = bytes(range(256)), kp.encode_status(7)
    c = kp.ExecCollector(1 << 20, protocol)
    for i in range(len(out)):
        c.feed(kp.encode(kp.STDOUT, out[i : i + 1], protocol))
    for i in range(len(status)):
        assert not c.exited
        c.feed(kp.encode(kp.ERROR, status[i : i + 1], protocol))
    assert c.exited
    c.closed(1000, clean=True)
    assert c.result().stdout == out
    assert c.result().exit_status == 7


def test_collector_trailing_data_after_the_status_is_kept_and_noted() -> None:
    c = kp.ExecCollector(100, kp.V5)
    for m in messages(kp.V5, kp.encode_status(0), b"a"):
        c.feed(m)
    c.feed(kp.encode(kp.STDOUT, b"late", kp.V5))
    c.feed(kp.encode(kp.ERROR, kp.encode_status(1), kp.V5))
    c.closed(1000, clean=True)
    r = c.result()
    assert r.stdout == b"alate"
    assert r.exit_status == 0
    assert "data after status" in r.notes
    assert "second status ignored" in r.notes


def test_collector_without_status_or_with_bad_status_is_unknown() -> None:
    c = kp.ExecCollector(100, kp.V5)
    c.feed(kp.encode(kp.STDOUT, b"partial", kp.V5))
    c.closed(1000, clean=True)
    assert c.result().exit_status is None
    assert any("without a status" in n for n in c.result().notes)
    bad = kp.ExecCollector(100, kp.V5)
    bad.feed(kp.encode(kp.ERROR, b'{"status":"Success"} trailing', kp.V5))
    bad.closed(1000, clean=True)
    assert bad.result().exit_status is None
    assert any("unparsable status" in n for n in bad.result().notes)


def test_collector_truncates_and_says_so() -> None:
    c = kp.ExecCollector(10, kp.V4)
    c.feed(kp.encode(kp.STDOUT, b"x" * 7, kp.V4))
    c.feed(kp.encode(kp.STDOUT, b"y" * 7, kp.V4))
    assert c.result().stdout == b"x" * 7 + b"y" * 3
    assert c.result().truncated


def test_collector_refuses_server_data_on_stdin() -> None:
    c = kp.ExecCollector(10, kp.V5)
    with pytest.raises(ProtocolError):
        c.feed(kp.encode(kp.STDIN, b"x", kp.V5))


@settings(max_examples=200)
@given(
    out=st.binary(max_size=2000),
    cuts=st.lists(st.integers(0, 2000), max_size=20),
    code=st.integers(0, 255),
    proto=st.sampled_from([kp.V5, kp.V4, kp.V4_BASE64]),
)
def test_any_chunking_gives_the_same_result(
    out: bytes, cuts: list[int], code: int, proto: str
) -> None:
    bounds = sorted({0, len(out), *(c for c in cuts if c <= len(out))})
    c = kp.ExecCollector(1 << 20, proto)
    c.feed(kp.encode(kp.STDOUT, b"", proto))
    for a, b in itertools.pairwise(bounds):
        c.feed(kp.encode(kp.STDOUT, out[a:b], proto))
    c.feed(kp.encode(kp.ERROR, kp.encode_status(code), proto))
    c.closed(1000, clean=True)
    assert c.result().stdout == out
    assert c.result().exit_status == code


# --------------------------------------------------------------------- paths


def test_exec_path_round_trips_awkward_argv() -> None:
    argv = ["sh", "-c", 'echo "$1" & rm -rf /', "sh", "a b&c=d?e#f", "ünï", ""]
    path = kp.exec_path("ns-1", "pod.a-1", argv, container="main", stdin=True)
    assert path.startswith("/api/v1/namespaces/ns-1/pods/pod.a-1/exec?container=main&command=sh")
    req = kp.parse_exec_path(path)
    assert req is not None
    assert req.argv == tuple(argv)
    assert (req.namespace, req.pod, req.container, req.stdin, req.stdout, req.tty) == (
        "ns-1",
        "pod.a-1",
        "main",
        True,
        True,
        False,
    )
    assert kp.parse_exec_path("/api/v1/namespaces/a/pods/b") is None
    assert kp.parse_pod_path("/api/v1/namespaces/a/pods/b") == ("a", "b", "")


@pytest.mark.parametrize("name", ["", "UPPER", "-lead", "trail-", "a_b", "a/b", "a" * 64, ".."])
def test_bad_namespaces_are_usage_errors(name: str) -> None:
    with pytest.raises(UsageError):
        kp.check_namespace(name)


@pytest.mark.parametrize("name", ["", "Pod", "a..b", "a/b", "a b", "%2e", "-x"])
def test_bad_pod_names_are_usage_errors(name: str) -> None:
    with pytest.raises(UsageError):
        kp.check_pod(name)
