"""``ssh://`` failure modes against a real OpenSSH sshd on loopback.

The conformance suite covers what a healthy connection does; these tests
cover how it fails: every failure must come out as the right wsync error
(fatal vs retryable) with a message that tells the user what to do, and a
lost connection must heal on the next exec.  Each runs with both clients:
asyncssh in the process, and OpenSSH's ``ssh`` (``--ssh-client openssh``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import ProcessWatch, start_sshd
from helpers import exec_error
from wsync.errors import AuthFailed, SandboxUnreachable, TransportError, TransportTimeout
from wsync.testing.sshd import SshdServer, write_keypair
from wsync.transports.base import Transport
from wsync.transports.openssh import OpensshTransport
from wsync.transports.registry import factory_for, open_transport
from wsync.transports.ssh import SshTransport
from wsync.uri import parse

pytestmark = pytest.mark.ssh


@pytest.fixture(params=["asyncssh", "openssh"])
def client(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def ssh_transport(server: SshdServer, client: str, **overrides: Any) -> Transport:
    options = {**server.transport_options(), "ssh_client": client, **overrides}
    _, transport = open_transport(server.uri("/work"), options)
    assert isinstance(transport, SshTransport if client == "asyncssh" else OpensshTransport)
    return transport


async def exec_once(transport: Transport, *argv: str) -> bytes:
    try:
        return (await transport.exec(list(argv), timeout=30.0)).stdout
    finally:
        await transport.aclose()


def test_registry_builds_it_and_description_has_no_secrets(sshd: SshdServer, client: str) -> None:
    transport = ssh_transport(sshd, client)
    assert transport.description == f"ssh://{sshd.user}@127.0.0.1:{sshd.port}"
    assert str(sshd.client_key) not in transport.description
    assert asyncio.run(exec_once(transport, "echo", "hi")) == b"hi\n"


def test_unknown_host_key_is_refused_with_a_fix(
    sshd: SshdServer, client: str, tmp_path: Path
) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    transport = ssh_transport(sshd, client, known_hosts=str(empty))
    with pytest.raises(SandboxUnreachable) as info:
        asyncio.run(exec_once(transport, "true"))
    assert not isinstance(info.value, AuthFailed)
    message = str(info.value)
    assert "host key" in message
    assert f"ssh-keyscan -p {sshd.port} 127.0.0.1" in message
    assert "--known-hosts" in message
    assert "\n" not in message


def test_host_keys_are_verified_by_default(
    sshd: SshdServer, client: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No known_hosts option and an empty ~/.ssh: refuse, never trust on first use."""
    monkeypatch.setenv("HOME", str(tmp_path))
    options = {k: v for k, v in sshd.transport_options().items() if k != "known_hosts"}
    transport = factory_for("ssh", client).from_uri(parse(sshd.uri("/work")), options)
    with pytest.raises(SandboxUnreachable, match="host key"):
        asyncio.run(exec_once(transport, "true"))


def test_changed_host_key_is_refused(sshd: SshdServer, client: str, tmp_path: Path) -> None:
    other = write_keypair(tmp_path / "other_host_key")
    pinned = tmp_path / "known_hosts"
    pinned.write_text(f"[127.0.0.1]:{sshd.port} {other}\n")
    transport = ssh_transport(sshd, client, known_hosts=str(pinned))
    with pytest.raises(SandboxUnreachable, match="host key"):
        asyncio.run(exec_once(transport, "true"))


def test_wrong_client_key_is_auth_failed(
    sshd: SshdServer, client: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    stranger = tmp_path / "id_stranger"
    write_keypair(stranger)
    transport = ssh_transport(sshd, client, ssh_key=str(stranger))
    with pytest.raises(AuthFailed) as info:
        asyncio.run(exec_once(transport, "true"))
    assert "authentication failed" in str(info.value)
    assert "PRIVATE KEY" not in str(info.value)
    assert info.value.exit_code == 3


def test_closed_port_is_unreachable(client: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens once the socket is closed
    transport = factory_for("ssh", client).from_uri(
        parse(f"ssh://nobody@127.0.0.1:{port}/work"), {"ssh_config": "none"}
    )
    with pytest.raises(SandboxUnreachable) as info:
        asyncio.run(exec_once(transport, "true"))
    assert not isinstance(info.value, TransportError)
    assert f"127.0.0.1:{port}" in str(info.value)


def test_deadline_closes_the_channel_and_the_connection_stays_usable(
    sshd: SshdServer, client: str, procs: ProcessWatch
) -> None:
    arg = procs.sleep_arg()

    async def main() -> bytes:
        transport = ssh_transport(sshd, client, max_sessions=2)
        try:
            for _ in range(3):  # more timeouts than slots: slots must come back
                with pytest.raises(TransportTimeout):
                    await transport.exec(["sleep", arg], timeout=0.5)
            return (await transport.exec(["echo", "still here"], timeout=30.0)).stdout
        finally:
            await transport.aclose()

    assert asyncio.run(main()) == b"still here\n"
    assert procs.wait_gone(arg) == []


def test_lost_connection_is_retryable_and_heals(
    tmp_path: Path, procs: ProcessWatch, client: str
) -> None:
    """Kill the server side mid-exec, then restart sshd entirely: exec recovers each time."""
    server = start_sshd(tmp_path / "sshd")
    arg = procs.sleep_arg()
    try:

        async def main() -> None:
            transport = ssh_transport(server, client)
            try:
                assert (await transport.exec(["echo", "one"], timeout=30.0)).stdout == b"one\n"
                running = asyncio.create_task(transport.exec(["sleep", arg], timeout=30.0))
                assert await asyncio.to_thread(procs.wait_present, arg)
                assert server.kill_connections() >= 1
                with pytest.raises(TransportError) as info:
                    await running
                assert not isinstance(info.value, TransportTimeout)
                # the next exec reconnects on its own
                assert (await transport.exec(["echo", "two"], timeout=30.0)).stdout == b"two\n"

                server.stop()
                # The first exec may still meet the dying connection; by the second at
                # the latest it must try to reconnect, and that failure is retryable too.
                seen = []
                for _ in range(2):
                    with pytest.raises(TransportError) as down:
                        await transport.exec(["true"], timeout=30.0)
                    seen.append(str(down.value))
                assert "reconnect failed" in seen[-1], seen
                server.start()  # same port, same host key
                assert (await transport.exec(["echo", "three"], timeout=30.0)).stdout == b"three\n"
            finally:
                await transport.aclose()

        asyncio.run(main())
    finally:
        server.stop()


def test_a_config_that_forwards_the_agent_does_not_hand_it_to_the_guest(
    sshd: SshdServer, client: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guest is hostile: ``ForwardAgent yes`` in the user's config would let it sign
    with the user's keys for as long as the pull runs."""
    agent = subprocess.run(
        ["ssh-agent", "-a", str(tmp_path / "agent.sock"), "-s"], capture_output=True, text=True
    )
    pid = int(agent.stdout.split("SSH_AGENT_PID=")[1].split(";")[0])
    try:
        monkeypatch.setenv("SSH_AUTH_SOCK", str(tmp_path / "agent.sock"))
        config = tmp_path / "config"
        config.write_text("Host *\n  ForwardAgent yes\n")
        transport = ssh_transport(sshd, client, ssh_config=str(config))
        seen = asyncio.run(exec_once(transport, "sh", "-c", "echo ${SSH_AUTH_SOCK:-none}"))
        assert seen == b"none\n"
    finally:
        os.kill(pid, signal.SIGTERM)


def test_known_hosts_file_is_the_only_trust(sshd: SshdServer, client: str, tmp_path: Path) -> None:
    """With --known-hosts FILE, a key found elsewhere (a global known_hosts that the
    config names) is not trusted: FILE alone decides, for both clients."""
    empty, global_file = tmp_path / "known_hosts", tmp_path / "global_known_hosts"
    empty.write_text("")
    global_file.write_text(Path(str(sshd.transport_options()["known_hosts"])).read_text())
    config = tmp_path / "config"
    config.write_text(f"Host *\n  GlobalKnownHostsFile {global_file}\n")
    transport = ssh_transport(sshd, client, known_hosts=str(empty), ssh_config=str(config))
    with pytest.raises(SandboxUnreachable, match="host key"):
        asyncio.run(exec_once(transport, "true"))


EVIL = "\x1b]0;owned\x07\x1b[2Jwsync: pull\x00 complete\r\n"


def against_sshd(
    tmp_path: Path, server: Callable[[], Any], transport: type[SshTransport | OpensshTransport]
) -> BaseException | None:
    """What ``exec(["true"])`` raised through ``transport`` against an asyncssh server
    (``server`` makes its ``SSHServer``) whose host key the client knows."""
    import asyncssh

    host_key = asyncssh.generate_private_key("ssh-ed25519")
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(tmp_path / "id")
    (tmp_path / "id").chmod(0o600)

    async def main() -> BaseException | None:
        sshd = await asyncssh.create_server(server, "127.0.0.1", 0, server_host_keys=[host_key])
        port = sshd.sockets[0].getsockname()[1]
        key = host_key.export_public_key().decode()
        (tmp_path / "kh").write_text(f"[127.0.0.1]:{port} {key}")
        client = transport(
            "127.0.0.1",
            port=port,
            user="u",
            ssh_key=str(tmp_path / "id"),
            known_hosts=str(tmp_path / "kh"),
            ssh_config="none",
        )
        return await exec_error(client, sshd)

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["disconnect", "noauth", "channel"])
def test_a_hostile_sshds_words_reach_the_error_printable(tmp_path: Path, mode: str) -> None:
    """The sshd may be the guest's: its DISCONNECT reason and a refused channel's reached
    the error (and the terminal) with their escapes and NULs (found by review)."""
    import asyncssh

    class Server(asyncssh.SSHServer):
        def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
            self.conn = conn

        def begin_auth(self, username: str) -> bool:
            if mode == "disconnect":
                self.conn.disconnect(asyncssh.DISC_BY_APPLICATION, EVIL)
            elif mode == "noauth":
                self.conn.disconnect(asyncssh.DISC_NO_MORE_AUTH_METHODS_AVAILABLE, EVIL)
            return False

        def session_requested(self) -> bool:
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, EVIL)

    err = against_sshd(tmp_path, Server, SshTransport)
    assert err is not None and "owned" in str(err), err
    assert not any(c in str(err) for c in "\x1b\x07\x00\r\n"), repr(str(err))


@pytest.mark.parametrize(
    "reason", ["Host key verification failed.", "x\nHost key verification failed."]
)
def test_a_disconnect_reason_does_not_choose_the_openssh_error(tmp_path: Path, reason: str) -> None:
    """ssh(1) logs the server's DISCONNECT reason as it came, newlines too: one saying
    "Host key verification failed" made a lost connection a host-key refusal (never
    retried, with wrong advice; found by review, and the first fix's line filter by the
    next one)."""
    import asyncssh

    class Server(asyncssh.SSHServer):
        def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
            self.conn = conn

        def begin_auth(self, username: str) -> bool:
            self.conn.disconnect(asyncssh.DISC_BY_APPLICATION, reason)
            return False

    err = against_sshd(tmp_path, Server, OpensshTransport)
    assert isinstance(err, SandboxUnreachable) and "host key not verified" not in str(err), err


def test_too_many_authentication_failures_is_a_refused_key_through_openssh(
    tmp_path: Path,
) -> None:
    """sshd says it only in its DISCONNECT (an agent of many keys meets it first): the
    first fix, which left the server's lines out, made it "cannot connect"."""
    wrong = tmp_path / "wrong_id"
    write_keypair(wrong)
    with SshdServer(tmp_path / "sshd", extra_config=["MaxAuthTries 1"]) as sshd:
        options = {**sshd.transport_options(), "ssh_key": str(wrong)}
        transport = OpensshTransport.from_uri(parse(sshd.uri(str(tmp_path))), options)

        async def main() -> None:
            try:
                await transport.exec(["true"], timeout=30)
            finally:
                await transport.aclose()

        with pytest.raises(AuthFailed, match="authentication failed"):
            asyncio.run(main())


@pytest.mark.parametrize("line", ["UserKnownHostsFile none", "UserKnownHostsFile NONE"])
def test_a_config_without_known_hosts_files_does_not_turn_verification_off(
    sshd: SshdServer, client: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str
) -> None:
    """OpenSSH reads ``UserKnownHostsFile none`` as "no user file" (and then refuses an
    unknown key under StrictHostKeyChecking=yes); asyncssh read it as "verify nothing" and
    took any host key: a man in the middle got the pull, as ``--known-hosts none``
    (refused) would."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "config"
    config.write_text(f"Host *\n  {line}\n")
    options = {k: v for k, v in sshd.transport_options().items() if k != "known_hosts"}
    options["ssh_config"] = str(config)
    transport = factory_for("ssh", client).from_uri(parse(sshd.uri("/work")), options)
    with pytest.raises(SandboxUnreachable, match="host key"):
        asyncio.run(exec_once(transport, "true"))
    # the global files still count, as with OpenSSH
    known = Path(str(sshd.transport_options()["known_hosts"]))
    config.write_text(f"Host *\n  {line}\n  GlobalKnownHostsFile /nonexistent {known}\n")
    transport = factory_for("ssh", client).from_uri(parse(sshd.uri("/work")), options)
    assert asyncio.run(exec_once(transport, "echo", "hi")) == b"hi\n"
