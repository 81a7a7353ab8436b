"""The guest helper (many calls, one exec): its wire format fed whole, byte-at-a-time and
with trailing bytes, the real script under dash and busybox, the pool's life cycle, and
whole pulls that go through it, clean and under every channel fault."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ProcessWatch
from helpers import (
    BUSYBOX_APPLETS,
    assert_exact,
    local,
    make_tree,
    options,
    pids_with,
    run_pull,
)
from helpers import tool_dir as make_tool_dir
from wsync.chaos import FaultPlan, wrap
from wsync.emulators.docker import DockerFaults
from wsync.emulators.docker import EmulatorThread as DockerEmulator
from wsync.emulators.k8s import K8sEmulatorThread, K8sFaults
from wsync.emulators.sprites import EmulatorThread as SpritesEmulator
from wsync.emulators.sprites_faults import SpritesFaults
from wsync.engine.guest import GuestSession
from wsync.engine.guestcall import CallStats
from wsync.engine.helpers import HelperPool
from wsync.errors import ProtocolError, TransportError, TransportTimeout
from wsync.protocol import helper
from wsync.testing.sshd import SshdServer
from wsync.transports.base import Channel, Transport
from wsync.transports.docker import DockerTransport
from wsync.transports.k8s import K8sTransport
from wsync.transports.local import LocalTransport
from wsync.transports.sprites import SpritesTransport
from wsync.transports.ssh import SshTransport
from wsync.uri import parse

NONCE = "0123456789abcdef"

# -- the wire format (sans I/O) ------------------------------------------------------------


def test_a_request_is_a_header_and_a_body_that_ends_in_its_own_nonce() -> None:
    data = helper.request(["sh", "-c", "echo 'a b'\nexit 0", "x"], NONCE, gate=True)
    header, _, body = data.partition(b"\n")
    n, nonce, gate = header.split(b" ")
    assert (int(n), nonce, gate) == (len(body), NONCE.encode(), b"1")
    assert body.endswith(b"\n# end " + NONCE.encode() + b"\n")
    with pytest.raises(ValueError, match="hex"):
        helper.request(["true"], "NOT-HEX; rm -rf /", gate=False)


def split(data: bytes, step: int | None, limit: int = 1 << 20) -> helper.ResponseSplitter:
    splitter = helper.ResponseSplitter(NONCE, limit)
    step = step or len(data) or 1
    for at in range(0, len(data), step):
        splitter.receive_data(data[at : at + step])
    return splitter


@pytest.mark.parametrize("step", [None, 1, 7])
def test_the_splitter_finds_the_end_in_any_split_and_keeps_what_follows(step: int | None) -> None:
    answer = b"noise WSYNC1 BEGIN ... payload\n\x00\xff"
    other = helper.done_marker("fedcba9876543210")  # another call's end is just bytes
    splitter = split(answer + other + helper.done_marker(NONCE) + b"late", step)
    assert splitter.done
    assert splitter.response == answer + other
    assert splitter.leftover == b"late"
    # the buffer it gathered in is the response, for the envelope parser to take over
    assert isinstance(splitter.response, bytearray)


def test_the_splitter_is_not_done_without_its_end_and_bounds_what_it_holds() -> None:
    splitter = split(b"x" * 100 + helper.done_marker(NONCE)[:-1], 1)
    assert not splitter.done
    with pytest.raises(ProtocolError) as caught:
        split(b"y" * 5000, 100, limit=1000)
    assert caught.value.fault == "oversize"


def test_the_splitter_notices_the_envelope_trailer_before_a_damaged_end_line() -> None:
    trailer = b"\nWSYNC1 END " + NONCE.encode() + b" 00ff\n"
    splitter = split(b"WSYNC1 BEGIN ..." + trailer[:-1], 1)
    assert not splitter.answered
    splitter.receive_data(b"\n" + helper.done_marker(NONCE)[:-3] + b"X\n")
    assert splitter.answered and not splitter.done
    assert splitter.give_up().startswith(b"WSYNC1 BEGIN ..." + trailer)
    other = split(b"\nWSYNC1 END 0000000000000000 00\n", 1)  # another call's trailer
    assert not other.answered


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=80), st.sampled_from([1, 5]))
def test_fuzz_the_splitter_ends_at_its_marker_or_raises_protocol_error(
    junk: bytes, at: int, step: int
) -> None:
    marker = helper.done_marker(NONCE)
    data = junk[:at] + marker + junk[at:]
    try:
        splitter = split(data, step, limit=200)
    except ProtocolError:
        return
    assert splitter.done
    assert splitter.response + marker + splitter.leftover == data
    assert marker not in splitter.response


# -- the real script -------------------------------------------------------------------------


@pytest.fixture(params=["sh", "busybox"])
def guest(request: pytest.FixtureRequest, tmp_path: Path) -> LocalTransport:
    """The host's sh (dash on Debian), or a guest with busybox applets only."""
    if request.param == "sh":
        return LocalTransport()
    busybox = shutil.which("busybox")
    assert busybox, "busybox must be installed (scripts/test.sh installs it)"
    path = make_tool_dir(tmp_path / "bb", BUSYBOX_APPLETS, target=busybox)
    return LocalTransport(env={"PATH": str(path)})


async def ask(channel: Channel, argv: list[str], nonce: str, *, gate: bool = False) -> bytes:
    await channel.send(helper.request(argv, nonce, gate=gate))
    splitter = helper.ResponseSplitter(nonce, 1 << 20)
    while not splitter.done:
        data = await channel.receive(20)
        assert data, "the helper ended before answering"
        splitter.receive_data(data)
    assert splitter.leftover == b""
    return splitter.response


def test_one_helper_answers_many_calls_as_execs_would(guest: LocalTransport) -> None:
    # a multi-line script with quotes, arguments and a trailing newline
    script = "printf '%s|' \"$@\"\nprintf 'it'\"'\"'s\\n\\n'"
    argv = ["sh", "-c", script, "name", "a b", "", "'q'", "ü"]
    expected = subprocess.run(argv, capture_output=True, check=True).stdout

    async def go() -> None:
        channel = await guest.open_channel(helper.ARGV, timeout=20)
        try:
            assert await ask(channel, argv, "aa01") == expected
            # what a call does to its shell does not reach the loop
            assert await ask(channel, ["sh", "-c", "set -e; printf x; exit 7"], "aa02") == b"x"
            # the stdin gate: a lone newline when asked for, else nothing
            count = ["sh", "-c", "wc -c | tr -d ' '"]
            assert await ask(channel, count, "aa03", gate=True) == b"1\n"
            assert await ask(channel, count, "aa04", gate=False) == b"0\n"
            # binary output with bytes that look like the end of another call
            tricky = helper.done_marker("bb05").decode()
            assert await ask(channel, ["printf", tricky + "\\000\\377"], "aa05") == (
                tricky.encode() + b"\x00\xff"
            )
        finally:
            await channel.aclose()

    asyncio.run(go())


@pytest.mark.parametrize(
    "damage",
    ["cut-body", "cut-in-end-line", "wrong-end", "bad-header"],
)
def test_a_damaged_request_never_runs_and_ends_the_helper(
    guest: LocalTransport, tmp_path: Path, damage: str
) -> None:
    flag = tmp_path / "ran"
    good = helper.request(["sh", "-c", f"touch {flag}"], "cc01", gate=False)
    header, _, body = good.partition(b"\n")
    data = {
        # the host died mid-write: the body is short and stdin ends
        "cut-body": good[: len(header) + 1 + len(body) - 12],
        # the body ends in another call's nonce (a stale or spliced request)
        "wrong-end": good.replace(b"# end cc01", b"# end cc02"),
        "bad-header": b"12 cc01;touch 1\n" + body,
        "cut-in-end-line": good[:-2],
    }[damage]

    async def go() -> bytes:
        channel = await guest.open_channel(helper.ARGV, timeout=20)
        try:
            await channel.send(data)
            if damage.startswith("cut-"):
                await channel.aclose()  # stdin ends, as when the host dies
                return b""
            out = b""
            while chunk := await channel.receive(20):
                out += chunk
            return out
        finally:
            await channel.aclose()

    out = asyncio.run(go())
    assert b"DONE" not in out
    assert not flag.exists()


# -- the pool --------------------------------------------------------------------------------


def test_the_pool_keeps_helpers_between_calls_and_opens_one_per_call_in_flight() -> None:
    async def go() -> HelperPool:
        pool = HelperPool(LocalTransport(), size=3)
        try:
            for i in range(4):
                out = await pool.run(["echo", str(i)], f"d{i}", gate=False, timeout=20, limit=100)
                assert out == f"{i}\n".encode()
            assert pool.opened == 1
            argv = ["sh", "-c", "sleep 0.3; echo p"]
            outs = await asyncio.gather(
                *(pool.run(argv, f"e{i}", gate=False, timeout=20, limit=100) for i in range(3))
            )
            assert outs == [b"p\n"] * 3
            assert pool.opened == 3
            return pool
        finally:
            await pool.aclose()

    pool = asyncio.run(go())
    assert pool.usable is False  # closed


class _StuckChannel(Channel):
    """A channel whose send never finishes (a WebSocket peer that stopped reading)."""

    def __init__(self) -> None:
        self.closed: list[bool] = []

    async def send(self, data: bytes) -> None:
        await asyncio.Event().wait()

    async def receive(self, timeout: float) -> bytes:
        raise AssertionError("nothing was sent")

    async def aclose(self, *, abort: bool = False) -> None:
        self.closed.append(abort)


class _StuckTransport(LocalTransport):
    def __init__(self) -> None:
        super().__init__()
        self.channel = _StuckChannel()

    async def open_channel(self, argv, **kw):  # type: ignore[no-untyped-def,override]
        return self.channel


def test_a_request_that_cannot_be_sent_ends_at_the_calls_deadline() -> None:
    """The deadline covers the request's send too: a channel whose send waits for a peer
    that stopped reading costs the call its deadline, and the helper is aborted."""
    transport = _StuckTransport()

    async def go() -> None:
        pool = HelperPool(transport, size=1)
        try:
            with pytest.raises(TransportTimeout):
                await pool.run(["echo", "x"], "c0ffee", gate=False, timeout=0.5, limit=100)
        finally:
            await pool.aclose()

    asyncio.run(asyncio.wait_for(go(), 20))
    assert transport.channel.closed == [True]


def test_a_call_that_may_wait_takes_the_busy_helper_once_it_is_free() -> None:
    """With ``reuse_wait`` a call that finds every helper busy waits that long for one
    (opening another is an exec: a login shell, 100 ms and more with a slow profile);
    without it, or when the busy call outlasts the wait, it opens one as before."""

    async def go() -> list[int]:
        opened = []
        for first, wait in (("0.2", 5.0), ("0.2", 0.0), ("2", 0.2)):
            pool = HelperPool(LocalTransport(), size=3)
            try:
                busy = ["sh", "-c", f"sleep {first}; echo a"]
                held = asyncio.Event()  # the first call holds the only helper
                one = asyncio.create_task(
                    pool.run(busy, "a1", gate=False, timeout=20, limit=9, on_open=held.set)
                )
                await held.wait()
                two = await pool.run(
                    ["echo", "b"], "b1", gate=False, timeout=20, limit=9, reuse_wait=wait
                )
                assert two == b"b\n" and await one == b"a\n"
                opened.append(pool.opened)
            finally:
                await pool.aclose()
        return opened

    assert asyncio.run(go()) == [1, 2, 2]


def helper_pids(tag: str) -> list[int]:
    """Processes whose environment carries ``WSYNC_TEST_TAG=tag`` (this test's guest)."""
    return pids_with(f"WSYNC_TEST_TAG={tag}")


def wait_no_pids(tag: str, seconds: float = 20.0) -> list[int]:
    end = time.monotonic() + seconds
    while (left := helper_pids(tag)) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def test_a_call_that_times_out_or_is_cancelled_takes_its_helper_down(tmp_path: Path) -> None:
    tag = f"timeout-{os.getpid()}-{tmp_path.name}"
    transport = LocalTransport(env={"WSYNC_TEST_TAG": tag})

    async def go() -> None:
        pool = HelperPool(transport, size=2)
        try:
            with pytest.raises(TransportTimeout):
                await pool.run(["sleep", "30"], "f1", gate=False, timeout=0.5, limit=100)
            task = asyncio.create_task(
                pool.run(["sleep", "30"], "f2", gate=False, timeout=20, limit=100)
            )
            while pool.opened < 2:  # noqa: ASYNC110 - the second helper is up
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the pool still works: a fresh helper answers
            assert await pool.run(["echo", "ok"], "f3", gate=False, timeout=20, limit=9) == b"ok\n"
            assert pool.opened == 3
        finally:
            await pool.aclose()

    asyncio.run(go())
    assert wait_no_pids(tag) == []


def test_a_guest_without_head_turns_the_pool_off(tmp_path: Path) -> None:
    busybox = shutil.which("busybox")
    assert busybox
    tools = tuple(t for t in BUSYBOX_APPLETS if t != "head")
    path = make_tool_dir(tmp_path / "nohead", tools, target=busybox)

    async def go() -> HelperPool:
        pool = HelperPool(LocalTransport(env={"PATH": str(path)}), size=2)
        for i in range(2):
            with pytest.raises(TransportError, match=r"helper ended|channel is closed"):
                await pool.run(["echo", "x"], f"a{i}", gate=False, timeout=20, limit=100)
        await pool.aclose()
        return pool

    pool = asyncio.run(go())
    assert pool.opened == 2 and not pool.usable


# -- whole pulls -----------------------------------------------------------------------------


def test_a_small_pull_is_one_exec_and_the_same_tree_as_exec_per_call(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "one.txt").write_text("one small file\n")
    via_helper = run_pull(local(), ws, tmp_path / "a", options(tmp_path / "s1"))
    per_call = run_pull(local(), ws, tmp_path / "b", options(tmp_path / "s2", helpers=False))
    assert_exact(ws, tmp_path / "a")
    assert_exact(ws, tmp_path / "b")
    # one helper; one more for a status long poll beside the first read (the producer
    # still writing when the first status answered: a loaded machine), or a failed call
    assert via_helper.execs <= 2 + via_helper.retries
    # the probe, the producer's install, two admissions (each small stream comes whole with
    # its admission, which removes its staging too: no status, read or cleanup call)
    assert per_call.execs >= 5 + per_call.retries


def test_a_busybox_guest_without_head_pulls_exactly_one_exec_per_call(tmp_path: Path) -> None:
    busybox = shutil.which("busybox")
    assert busybox
    tools = tuple(t for t in BUSYBOX_APPLETS if t != "head")
    path = make_tool_dir(tmp_path / "nohead", tools, target=busybox)
    ws = make_tree(tmp_path / "ws", big=200_000, small=10)
    result = run_pull(local({"PATH": str(path)}), ws, tmp_path / "d", options(tmp_path))
    assert_exact(ws, tmp_path / "d")
    assert result.execs >= 2 + 7  # two helpers tried, then one exec per call


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_channel_fault_costs_a_retry_never_a_wrong_byte(tmp_path: Path, seed: int) -> None:
    ws = make_tree(tmp_path / "ws", seed=seed, big=600_000, small=20)
    # each fault once on the first calls (answers through helpers), then 10% at random
    plan = FaultPlan.parse(f"map=.HTFSABDWZN.B.H.T,seed={seed},all=0.01,hang=0.5")
    transport = wrap(LocalTransport(), plan)
    opts = options(tmp_path, chunk_size=256 * 1024, max_attempts=12)
    result = run_pull(transport, ws, tmp_path / "d", opts)
    assert_exact(ws, tmp_path / "d")
    assert result.retries >= 8
    # the helpers stayed on: every call went through one, none fell back to an exec
    assert plan.channel_calls == plan.calls
    assert result.execs <= 1 + result.retries + opts.parallel


# -- channels of the real transports ---------------------------------------------------------


@pytest.fixture(scope="module")
def dockerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerEmulator]:
    """A Docker Engine API emulator with its drop-final fault on for every exec: a
    helper's answers are not its last output, so they must arrive all the same."""
    faults = DockerFaults(seed=1, drop_final=1.0, split_frames=0.5, answer_200=0.5)
    with DockerEmulator(tmp_path_factory.mktemp("docker"), faults=faults) as emu:
        emu.create_container("helped")
        yield emu


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[K8sEmulatorThread]:
    """A Kubernetes API emulator whose every exec loses the tail its command ends with:
    a helper's answers are not that tail, so they must arrive all the same."""
    faults = K8sFaults(seed=1, drop_tail=1.0, drop_tail_max=4096, split_frames=0.5)
    with K8sEmulatorThread(tmp_path_factory.mktemp("k8s")) as emu:
        emu.create_pod("helped")
        emu.set_faults(faults)
        yield emu


@pytest.fixture(scope="module")
def sprites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpritesEmulator]:
    """A Sprites API emulator whose every exec splits its last output around the exit,
    with a late attach and a ring: a helper's answers must arrive all the same."""
    faults = SpritesFaults(seed=1, ring=True, data_after_exit=1.0, split_frames=0.5)
    with SpritesEmulator(tmp_path_factory.mktemp("sprites"), faults=faults) as emu:
        emu.create_sprite("helped")
        yield emu


@pytest.fixture(
    params=["local", pytest.param("ssh", marks=pytest.mark.ssh), "docker", "k8s", "sprites"],
)
def channel_transport(request: pytest.FixtureRequest) -> Transport:
    if request.param == "local":
        return LocalTransport()
    if request.param == "docker":
        emu: DockerEmulator = request.getfixturevalue("dockerd")
        return DockerTransport.from_uri(parse("docker://helped/work"), emu.transport_options())
    if request.param == "sprites":
        sb: SpritesEmulator = request.getfixturevalue("sprites")
        return SpritesTransport.from_uri(parse("sprites://helped/work"), sb.transport_options())
    if request.param == "k8s":
        k8s: K8sEmulatorThread = request.getfixturevalue("cluster")
        return K8sTransport.from_uri(parse("k8s://default/helped/work"), k8s.transport_options())
    server: SshdServer = request.getfixturevalue("sshd")
    return SshTransport.from_uri(parse(server.uri("/work")), server.transport_options())


def test_a_helper_over_each_channel_answers_and_an_abort_stops_its_call(
    channel_transport: Transport, procs: ProcessWatch
) -> None:
    arg = procs.sleep_arg()

    async def go() -> None:
        try:
            pool = HelperPool(channel_transport, size=2)
            out = await pool.run(["echo", "hi"], "ab01", gate=True, timeout=20, limit=100)
            assert out == b"hi\n"
            # a call that outlives its deadline: the helper is aborted with it
            with pytest.raises(TransportTimeout):
                await pool.run(["sleep", arg], "ab02", gate=False, timeout=1.0, limit=100)
            # (polled in a thread: docker's kill is an exec of its own that the abort
            # starts in the background, as a timed-out exec's is; pods/exec has no kill,
            # the emulator stops what a closed socket ran, as some runtimes do)
            assert await asyncio.to_thread(procs.wait_gone, arg) == []
            out = await pool.run(["echo", "again"], "ab03", gate=False, timeout=20, limit=100)
            assert out == b"again\n" and pool.opened == 2
            await pool.aclose()
        finally:
            await channel_transport.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("tools", ["host", "busybox"])
def test_an_incremental_pull_is_one_exec_its_list_in_argv_parts(tmp_path: Path, tools: str) -> None:
    """The list of changed entries goes through the helper as argv parts (a helper has no
    stdin for a call), a list longer than one part too."""
    env = None
    if tools == "busybox":
        busybox = shutil.which("busybox")
        assert busybox
        # with stat and readlink: the manifest's way on busybox (find has no -printf)
        tools = (*BUSYBOX_APPLETS, "stat", "readlink")
        env = {"PATH": str(make_tool_dir(tmp_path / "bb", tools, target=busybox))}
    ws = make_tree(tmp_path / "ws", big=100_000, small=10)
    dest = tmp_path / "d"
    opts = options(tmp_path)
    first = run_pull(local(env), ws, dest, opts)
    assert first.execs <= 2 + first.retries  # a status beside a read: see above
    # enough new names that their list is several 64 KiB parts of base64
    many = ws / "many"
    many.mkdir()
    for i in range(1500):
        (many / (f"{i:05d}-" + "n" * 90)).write_text(f"{i}\n")
    (ws / "src" / "f1.txt").write_text("changed\n")
    result = run_pull(local(env), ws, dest, opts)
    assert result.mode == "incremental" and result.changed_files >= 1501
    assert result.execs <= 2 + result.retries
    assert_exact(ws, dest)


class _Counting(LocalTransport):
    """``local:`` that counts what it started: channels and execs."""

    def __init__(self) -> None:
        super().__init__()
        self.started = 0

    async def open_channel(self, argv, **kw):  # type: ignore[no-untyped-def,override]
        self.started += 1
        return await super().open_channel(argv, **kw)

    async def exec(self, argv, **kw):  # type: ignore[no-untyped-def,override]
        self.started += 1
        return await super().exec(argv, **kw)


def test_execs_count_each_helper_once_however_many_calls_run_at_once(tmp_path: Path) -> None:
    ws = make_tree(tmp_path / "ws", big=3_000_000, small=30)
    transport = _Counting()
    opts = options(tmp_path, chunk_size=128 * 1024, parallel=4)
    result = run_pull(transport, ws, tmp_path / "d", opts)
    assert_exact(ws, tmp_path / "d")
    assert result.chunks >= 8
    assert result.execs == transport.started
    assert 1 <= result.execs <= opts.parallel + 1


def test_a_damaged_end_line_costs_a_moment_not_the_deadline() -> None:
    """The call printed its envelope's last line but its end-of-answer line never comes
    whole (here: the call lingers): what came is judged after a short grace, and the
    helper with its lingering call is taken down."""
    nonce = "9a9a"
    script = f"printf 'x\\nWSYNC1 END {nonce} 00\\n'; sleep 120"

    async def go() -> tuple[bytes, float, HelperPool]:
        pool = HelperPool(LocalTransport(), size=1)
        started = time.monotonic()
        try:
            out = await pool.run(["sh", "-c", script], nonce, gate=False, timeout=90, limit=99)
            return out, time.monotonic() - started, pool
        finally:
            await pool.aclose()

    out, took, pool = asyncio.run(go())
    assert out == f"x\nWSYNC1 END {nonce} 00\n".encode()
    assert took < 60  # the grace is a second; the deadline 90 s
    assert pool.opened == 1


def test_a_helper_that_died_while_idle_is_passed_over(tmp_path: Path) -> None:
    """A lost connection or a killed helper: the next call takes a fresh one instead of
    failing an attempt on the dead one."""
    tag = f"idle-{os.getpid()}-{tmp_path.name}"

    async def go() -> HelperPool:
        pool = HelperPool(LocalTransport(env={"WSYNC_TEST_TAG": tag}), size=2)
        try:
            assert await pool.run(["echo", "1"], "c1", gate=False, timeout=20, limit=9) == b"1\n"
            for pid in helper_pids(tag):
                os.kill(pid, 9)
            end = time.monotonic() + 20
            while not pool._idle[0].channel.ended and time.monotonic() < end:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            assert await pool.run(["echo", "2"], "c2", gate=False, timeout=20, limit=9) == b"2\n"
            return pool
        finally:
            await pool.aclose()

    pool = asyncio.run(go())
    assert pool.opened == 2


def test_without_setsid_in_the_guest_helpers_step_aside_after_the_probe(tmp_path: Path) -> None:
    """The producer must not share a helper's process group (an aborted call would take
    it down): a guest without setsid gets one exec per call after the probe."""
    busybox = shutil.which("busybox")
    assert busybox
    ws = make_tree(tmp_path / "ws", big=1000, small=2)

    async def probe(tools: tuple[str, ...]) -> bool:
        path = make_tool_dir(tmp_path / str(len(tools)), tools, target=busybox)
        transport = LocalTransport(env={"PATH": str(path)})
        pool = HelperPool(transport, size=2)
        session = GuestSession(transport, options(tmp_path), CallStats(), pool)
        try:
            await session.probe(str(ws))
            return pool.usable
        finally:
            await pool.aclose()

    assert asyncio.run(probe(BUSYBOX_APPLETS)) is True
    assert asyncio.run(probe(tuple(t for t in BUSYBOX_APPLETS if t != "setsid"))) is False


def test_helpers_go_when_the_pool_turns_off_idle_or_when_their_call_ends() -> None:
    """One exec per call from then on: the idle helpers are closed at once (each holds a
    guest process and, on some backends, a connection), and one busy then is closed when
    its call ends rather than kept idle until the pull's end."""

    async def go() -> None:
        pool = HelperPool(LocalTransport(), size=3)
        try:
            argv = ["sh", "-c", "sleep 0.3; echo p"]
            await asyncio.gather(
                *(pool.run(argv, f"a{i}", gate=False, timeout=20, limit=100) for i in range(2))
            )
            idle = [worker.channel for worker in pool._idle]
            assert len(idle) == 2 and not any(channel.ended for channel in idle)
            busy = asyncio.ensure_future(pool.run(argv, "b1", gate=False, timeout=20, limit=100))
            await asyncio.sleep(0.1)  # it took one of them
            pool.turn_off("a test")
            assert await busy == b"p\n"
            assert pool._letting_go is not None
            async with asyncio.timeout(10):
                await pool._letting_go
            assert all(channel.ended for channel in idle)
            assert pool._idle == []  # and the busy one was not kept
            assert pool.usable is False
        finally:
            await pool.aclose()

    asyncio.run(go())
