"""The envelope parser: fed whole, byte-at-a-time, with noise and trailing bytes, and fuzzed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync.errors import ProtocolError
from wsync.protocol.envelope import Envelope, EnvelopeParser, parse_envelope, render_envelope
from wsync.protocol.hashing import ALGORITHMS

XXH = ALGORITHMS["xxh128"]
NONCE = "0123456789abcdef"
PAYLOAD = bytes(range(256)) * 40 + b"\nWSYNC1 END fake 00\n"  # binary, and a decoy trailer


#: ``feed``'s step that hands the whole output over as a buffer (a helper's answer)
TAKE = -1


def feed(data: bytes, step: int | None = None, **kw: object) -> Envelope:
    parser = EnvelopeParser(NONCE, algorithm=XXH, max_length=1 << 20, **kw)  # type: ignore[arg-type]
    if step == TAKE:
        parser.receive_buffer(bytearray(data))
    elif step is None:
        parser.receive_data(data)
    else:
        for i in range(0, len(data), step):
            parser.receive_data(data[i : i + step])
    parser.receive_eof()
    return parser.result()


@pytest.mark.parametrize("b64", [False, True])
@pytest.mark.parametrize("step", [None, 1, 7, 4096, TAKE])
def test_round_trip_in_any_split(b64: bool, step: int | None) -> None:
    wire = render_envelope(NONCE, PAYLOAD, algorithm=XXH, b64=b64)
    env = feed(wire, step)
    assert env.ok and env.payload == PAYLOAD
    assert env.noise == 0 and env.trailing == 0


@pytest.mark.parametrize("step", [None, TAKE])
def test_noise_before_and_trailing_bytes_after_are_counted_not_trusted(step: int | None) -> None:
    wire = render_envelope(NONCE, PAYLOAD, algorithm=XXH)
    env = feed(b"tar: warning\n" + wire + b"late frame after exit", step)
    assert env.payload == PAYLOAD
    assert env.noise == len(b"tar: warning\n")
    assert env.trailing == len(b"late frame after exit")


def test_bytes_after_a_first_result_still_count_as_trailing() -> None:
    """The result is kept after the first call (its payload buffer is released), but
    late bytes that arrive before the end of output are still reported."""
    parser = EnvelopeParser(NONCE, algorithm=XXH, max_length=1 << 20)
    parser.receive_data(render_envelope(NONCE, PAYLOAD, algorithm=XXH))
    first = parser.result()
    assert first.payload == PAYLOAD and first.trailing == 0
    parser.receive_data(b"late frame")
    parser.receive_eof()
    again = parser.result()
    assert again.payload == PAYLOAD and again.trailing == len(b"late frame")


def test_a_buffer_taken_over_is_not_copied_until_the_result() -> None:
    """A helper's answer is handed over whole: the parser cuts it in place down to the
    payload (no copy on the way), the result is the one copy, and the buffer goes."""
    wire = render_envelope(NONCE, PAYLOAD, algorithm=XXH)
    buf = bytearray(b"noise" + wire + b"late")
    parser = EnvelopeParser(NONCE, algorithm=XXH, max_length=1 << 20)
    parser.receive_buffer(buf)
    assert buf == PAYLOAD  # the caller's buffer became the payload, cut in place
    parser.receive_data(b" more late")  # after the end: counted, not a second buffer
    parser.receive_eof()
    env = parser.result()
    assert env.payload == PAYLOAD and env.noise == 5 and env.trailing == len(b"late more late")
    assert parser.result() == env  # asked again: the same result, its buffer released
    # a buffer handed over after data came is appended like any data
    parser = EnvelopeParser(NONCE, algorithm=XXH, max_length=1 << 20)
    parser.receive_data(wire[:10])
    parser.receive_buffer(bytearray(wire[10:]))
    parser.receive_eof()
    assert parser.result().payload == PAYLOAD


def test_an_envelope_of_another_call_is_ignored() -> None:
    stale = render_envelope("ffffffffffffffff", b"old answer", algorithm=XXH)
    with pytest.raises(ProtocolError) as info:
        feed(stale)
    assert info.value.fault == "no-envelope"
    env = feed(stale + render_envelope(NONCE, b"new", algorithm=XXH))
    assert env.payload == b"new"


def test_empty_payload() -> None:
    assert feed(render_envelope(NONCE, b"", algorithm=XXH)).payload == b""


def test_error_status_carries_its_reason() -> None:
    env = feed(render_envelope(NONCE, b"short-file 12", algorithm=XXH, ok=False))
    assert not env.ok and env.text == "short-file 12"


WIRE = render_envelope(NONCE, PAYLOAD, algorithm=XXH)
HEADER_END = WIRE.index(b"\n") + 1


@pytest.mark.parametrize(
    ("damaged", "fault"),
    [
        (b"", "no-envelope"),  # zero frames, exit 0
        (
            WIRE[-65536:] if len(WIRE) > 65536 else WIRE[HEADER_END + 5 :],
            "no-envelope",
        ),  # head lost
        (WIRE[: HEADER_END - 3], "truncated"),  # cut inside the header
        (WIRE[: len(WIRE) // 2], "truncated"),  # fabricated exit mid-payload
        (WIRE[:-1], "truncated"),  # last newline missing
        (WIRE[: HEADER_END + 100] + b"STDERR" + WIRE[HEADER_END + 100 :], "trailer-mismatch"),
        (WIRE[: HEADER_END + 100] + WIRE[HEADER_END + 101 :], "trailer-mismatch"),  # one byte lost
        (
            WIRE[: HEADER_END + 10] + bytes([WIRE[HEADER_END + 10] ^ 4]) + WIRE[HEADER_END + 11 :],
            "hash-mismatch",
        ),
    ],
)
def test_each_kind_of_damage_is_detected(damaged: bytes, fault: str) -> None:
    for step in (None, 1, TAKE):
        with pytest.raises(ProtocolError) as info:
            feed(damaged, step)
        assert info.value.fault == fault


def test_declared_length_is_bounded() -> None:
    wire = render_envelope(NONCE, b"x" * 100, algorithm=XXH)
    parser = EnvelopeParser(NONCE, algorithm=XXH, max_length=99)
    with pytest.raises(ProtocolError) as info:
        parser.receive_data(wire)
    assert info.value.fault == "oversize"


def test_seek_state_keeps_bounded_memory() -> None:
    parser = EnvelopeParser(NONCE, algorithm=XXH, max_length=10)
    for _ in range(100):
        parser.receive_data(b"x" * 10_000)
    assert parser.noise > 990_000
    assert len(parser._buf) < 64


def test_unhashed_envelope_for_the_probe() -> None:
    wire = render_envelope(NONCE, b"proto 1\n", algorithm=None)
    env = parse_envelope(wire, NONCE, algorithm=None, max_length=100)
    assert env.payload == b"proto 1\n" and env.digest == "-"


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=300),
    st.integers(min_value=0, max_value=400),
    st.binary(max_size=20),
    st.sampled_from([1, 3, 1000, TAKE]),
)
def test_fuzz_parses_or_raises_protocol_error(
    junk: bytes, at: int, insert: bytes, step: int
) -> None:
    """The one invariant: a verified payload, or our ProtocolError — nothing else."""
    good = render_envelope(NONCE, b"payload-bytes" * 3, algorithm=XXH)
    candidates = [junk, good[:at] + insert + good[at:], good[:at] + junk, junk + good]
    for data in candidates:
        try:
            env = feed(data, step)
        except ProtocolError:
            continue
        assert env.payload == b"payload-bytes" * 3


# -- b64 on text channels (Cloudflare SSE, Daytona JSON: lossy text, added newlines) ----------


@pytest.mark.parametrize("step", [None, 1, 13])
def test_b64_survives_what_text_channels_do_to_line_breaks(step: int | None) -> None:
    wire = render_envelope(NONCE, PAYLOAD, algorithm=XXH, b64=True)
    assert max(len(line) for line in wire.split(b"\n")[1:-2]) <= 76  # short lines
    for mangled in (
        wire.replace(b"\n", b"\r\n"),  # CRLF line ends
        wire.replace(b"\n", b"\n\n"),  # every line gained a newline
    ):
        assert feed(mangled, step).payload == PAYLOAD


@pytest.mark.parametrize(
    ("damage", "fault"),
    [
        (lambda w: w.replace(w[200:300], w[200:250]), "trailer-mismatch"),  # a fragment dropped
        (lambda w: w[:150] + b"tar: spliced stderr\n" + w[150:], "trailer-mismatch"),
        (lambda w: w[:150] + b"QUJD" + w[154:], "hash-mismatch"),  # valid base64, wrong bytes
    ],
)
def test_b64_damage_is_detected(damage: object, fault: str) -> None:
    wire = render_envelope(NONCE, PAYLOAD, algorithm=XXH, b64=True)
    with pytest.raises(ProtocolError) as info:
        feed(damage(wire))  # type: ignore[operator]
    assert info.value.fault == fault


def test_b64_payload_longer_than_its_bound_is_refused() -> None:
    wire = render_envelope(NONCE, b"x" * 3000, algorithm=XXH, b64=True)
    head, _, rest = wire.partition(b"\n")
    padded = head + b"\n" + b"\n" * 5000 + rest
    with pytest.raises(ProtocolError, match="longer than"):
        feed(padded)
