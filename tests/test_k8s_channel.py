"""The pods/exec WebSocket kept open for a guest helper (``K8sChannel``), against the
emulated API server on every exec subprotocol wsync speaks: requests and answers in
lockstep, the kubelet's empty greeting, the end of the command, and a close."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import ECHO, echo_in_lockstep_then_close, echo_until_its_end, receive_line
from wsync.emulators.k8s import K8sEmulatorThread, K8sFaults
from wsync.transports import k8s_protocol as kp
from wsync.transports.k8s import K8sTransport
from wsync.uri import parse


@pytest.fixture(scope="module", params=[kp.V5, kp.V4, kp.V4_BASE64])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[K8sEmulatorThread]:
    root = tmp_path_factory.mktemp("k8s")
    with K8sEmulatorThread(root, protocols=(request.param,)) as emu:
        emu.create_pod("p")
        yield emu


def _transport(emu: K8sEmulatorThread) -> K8sTransport:
    return K8sTransport.from_uri(parse("k8s://default/p/work"), emu.transport_options())


def test_requests_and_answers_in_lockstep_then_a_close(cluster: K8sEmulatorThread) -> None:
    cluster.set_faults(K8sFaults(split_frames=1.0, seed=2))  # answers in pieces

    async def go() -> None:
        transport = _transport(cluster)
        try:
            channel = await transport.open_channel(ECHO, timeout=20)
            await echo_in_lockstep_then_close(channel, 100_000)  # several messages
        finally:
            await transport.aclose()

    asyncio.run(go())


def test_the_command_ending_ends_the_channel_with_an_error(cluster: K8sEmulatorThread) -> None:
    """Its status on channel 3 says the helper is gone: the call in flight fails (and is
    retried elsewhere), whatever the status says."""
    cluster.set_faults(K8sFaults.off())

    async def go() -> None:
        transport = _transport(cluster)
        try:
            await echo_until_its_end(await transport.open_channel(ECHO, timeout=20))
        finally:
            await transport.aclose()

    asyncio.run(go())


def test_an_answer_the_server_would_lose_as_a_tail_arrives_while_the_helper_runs(
    cluster: K8sEmulatorThread, tmp_path: Path
) -> None:
    """Every exec loses the tail its command ends with; an answer followed by a helper
    waiting for its next request is not that tail: it arrives, a moment late."""
    cluster.set_faults(K8sFaults(drop_tail=1.0, drop_tail_min=4096, drop_tail_max=4096))
    released = cluster.stats["tail_released"]

    async def go() -> None:
        transport = _transport(cluster)
        try:
            channel = await transport.open_channel(ECHO, timeout=20)
            await channel.send(b"held back\n")
            assert await receive_line(channel) == b"got held back\n"
            await channel.aclose()
        finally:
            await transport.aclose()

    asyncio.run(go())
    assert cluster.stats["tail_released"] > released


def test_an_exec_that_lingers_after_its_last_output_still_loses_its_tail(
    cluster: K8sEmulatorThread,
) -> None:
    """The fault's other side: a command given stdin that stays 0.3 s after its last
    output, its stdin done (on v4 never closed by the client: only the command's wait
    tells), loses its tail as before; only a command waiting for more stdin is spared."""
    cluster.set_faults(K8sFaults(drop_tail=1.0, drop_tail_min=1000, drop_tail_max=1000))
    dropped, released = cluster.stats["tail_dropped"], cluster.stats["tail_released"]
    script = "cat >/dev/null; head -c 300000 /dev/zero; sleep 0.3"

    async def go() -> bytes:
        transport = _transport(cluster)
        try:
            result = await transport.exec(["sh", "-c", script], stdin=b"in\n", timeout=20)
            return result.stdout
        finally:
            await transport.aclose()

    assert len(asyncio.run(go())) == 299_000
    assert cluster.stats["tail_dropped"] == dropped + 1
    assert cluster.stats["tail_released"] == released
