"""The Kubernetes emulator speaks the documented wire format and each fault does what it
says — seen through a raw WebSocket client and through the transport."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.typing import Subprotocol

from wsync.emulators.k8s import EMULATOR_TOKEN, K8sEmulatorThread, K8sFaults
from wsync.errors import TransportError
from wsync.transports import k8s_protocol as kp
from wsync.transports.base import ExecResult
from wsync.transports.kubeconfig import load
from wsync.transports.registry import open_transport


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[K8sEmulatorThread]:
    with K8sEmulatorThread(tmp_path_factory.mktemp("k8s")) as emu:
        emu.create_pod("p")
        yield emu


def tls(cluster: K8sEmulatorThread) -> ssl.SSLContext:
    return load(cluster.transport_options()).ssl_context


async def raw_exec(
    cluster: K8sEmulatorThread, argv: list[str], stdin: bytes | None, protocols: list[str]
) -> tuple[str | None, list[bytes | str]]:
    """A raw client: the messages exactly as the server sent them."""
    path = kp.exec_path("default", "p", argv, container=None, stdin=stdin is not None)
    url = cluster.url.replace("https", "wss") + path
    async with connect(
        url,
        ssl=tls(cluster),
        additional_headers={"Authorization": f"Bearer {EMULATOR_TOKEN}"},
        subprotocols=[Subprotocol(p) for p in protocols],
    ) as ws:
        if stdin is not None:
            await ws.send(kp.encode(kp.STDIN, stdin, ws.subprotocol))
            await ws.send(kp.encode_close(kp.STDIN))
        got = [m async for m in ws]
        return ws.subprotocol, got


def test_v5_greeting_frames_close_and_status(cluster: K8sEmulatorThread) -> None:
    cluster.set_faults(K8sFaults.off())
    protocol, got = asyncio.run(raw_exec(cluster, ["cat"], b"hello", [kp.V5]))
    assert protocol == kp.V5
    assert got[0] == b"\x01"  # the kubelet's empty greeting on stdout
    assert b"".join(m[1:] for m in got if isinstance(m, bytes) and m[:1] == b"\x01") == b"hello"
    assert got[-1] == b"\x03" + kp.encode_status(0)


def test_base64_frames_are_text(cluster: K8sEmulatorThread) -> None:
    protocol, got = asyncio.run(raw_exec(cluster, ["printf", "\\n"], None, [kp.V4_BASE64]))
    assert protocol == kp.V4_BASE64
    assert got[0] == "1"
    assert "1Cg==" in got
    assert all(isinstance(m, str) for m in got)


def test_auth_and_unknown_pods_are_refused_before_the_upgrade(cluster: K8sEmulatorThread) -> None:
    async def attempt(headers: dict[str, str], pod: str) -> int:
        path = kp.exec_path("default", pod, ["true"], container=None, stdin=False)
        try:
            async with connect(
                cluster.url.replace("https", "wss") + path,
                ssl=tls(cluster),
                additional_headers=headers,
                subprotocols=[Subprotocol(kp.V5)],
            ):
                return 101
        except InvalidStatus as err:
            return err.response.status_code

    assert asyncio.run(attempt({}, "p")) == 401
    assert asyncio.run(attempt({"Authorization": "Bearer nope"}, "p")) == 401
    assert asyncio.run(attempt({"Authorization": f"Bearer {EMULATOR_TOKEN}"}, "ghost")) == 404


def run(cluster: K8sEmulatorThread, faults: K8sFaults, argv: list[str], **kw: Any) -> ExecResult:
    cluster.set_faults(faults)

    async def main() -> ExecResult:
        _, transport = open_transport("k8s://default/p/w", cluster.transport_options())
        async with transport:
            return await transport.exec(argv, timeout=30, **kw)

    return asyncio.run(main())


def test_drop_tail_loses_the_end_behind_success(cluster: K8sEmulatorThread) -> None:
    faults = K8sFaults(drop_tail=1.0, drop_tail_min=1000, drop_tail_max=1000)
    result = run(cluster, faults, ["head", "-c", "300000", "/dev/zero"])
    assert (len(result.stdout), result.exit_status) == (299000, 0)


def test_early_success_while_the_process_runs(cluster: K8sEmulatorThread) -> None:
    result = run(
        cluster, K8sFaults(early_success=1.0), ["sh", "-c", "echo first; sleep 1; echo second"]
    )
    assert (result.stdout, result.exit_status) == (b"first\n", 0)
    # the kata shape: only execs without stdin, and stdin is the workaround (v5 always asks)
    kata = run(cluster, K8sFaults.kata(), ["sh", "-c", "echo first; sleep 0.3; echo second"])
    assert kata.stdout == b"first\nsecond\n"


@pytest.mark.parametrize(
    ("faults", "note"),
    [
        (K8sFaults(bad_exit=1.0), "BadExitCode"),
        (K8sFaults(internal_error=1.0), "InternalError"),
        (K8sFaults(no_status=1.0), "without a status"),
    ],
)
def test_status_faults_leave_the_exit_status_unknown(
    cluster: K8sEmulatorThread, faults: K8sFaults, note: str
) -> None:
    result = run(cluster, faults, ["echo", "ok"])
    assert result.stdout == b"ok\n"
    assert result.exit_status is None
    assert any(note in n for n in result.notes), result.notes


def test_internal_error_only_replaces_success(cluster: K8sEmulatorThread) -> None:
    assert run(cluster, K8sFaults(internal_error=1.0), ["sh", "-c", "exit 3"]).exit_status == 3


def test_stall_split_and_sever(cluster: K8sEmulatorThread) -> None:
    before = cluster.stats["stalls"]
    stalled = run(cluster, K8sFaults(stall=1.0, stall_seconds=0.3), ["echo", "late"])
    assert (stalled.stdout, stalled.exit_status) == (b"late\n", 0)
    assert cluster.stats["stalls"] > before
    data = bytes(range(256)) * 400
    split = run(cluster, K8sFaults(split_frames=1.0), ["cat"], stdin=data)
    assert split.stdout == data
    with pytest.raises(TransportError, match="dropped"):
        run(
            cluster,
            K8sFaults(sever=1.0, sever_max_bytes=1000),
            ["head", "-c", "50000", "/dev/zero"],
        )


def test_fault_schedules_replay_from_the_seed() -> None:
    import random

    a = K8sFaults.all_on(seed=5)
    plans = [a.plan(random.Random(f"5/{i}")) for i in range(30)]
    again = [a.plan(random.Random(f"5/{i}")) for i in range(30)]
    assert [(p.drop_tail, p.early_success, p.bad_exit) for p in plans] == [
        (p.drop_tail, p.early_success, p.bad_exit) for p in again
    ]
    assert any(p.drop_tail for p in plans)
    assert not any(K8sFaults.off().plan(random.Random(i)).drop_tail for i in range(30))


def test_kubeconfig_written_by_the_emulator_is_private(cluster: K8sEmulatorThread) -> None:
    path: Path = cluster.kubeconfig
    assert path.stat().st_mode & 0o077 == 0
