"""``--ssh-client openssh``: what its master connection must never do.

The contract it shares with the asyncssh client (quoting, exactness, deadlines, host
keys, failures, reconnects) runs in ``test_transport_conformance.py`` and
``test_ssh_transport.py`` with both clients.  Here: the master is ours alone and
outlives nothing (an ``aclose``, a ``kill -9`` of the pull, a pull that never adopted
the master started for it), and no value given to ``ssh(1)`` becomes an option.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from wsync.errors import UsageError
from wsync.testing.sshd import SshdServer
from wsync.transports import openssh
from wsync.transports.openssh import OpensshTransport
from wsync.uri import parse

pytestmark = pytest.mark.ssh


def masters_of(directory_prefix: str) -> list[int]:
    """Pids of ssh masters whose control socket lies under ``directory_prefix``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-M" in argv and any(a.startswith(directory_prefix.encode()) for a in argv):
            found.append(int(pid))
    return found


def wait_for(check: object, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def transport(server: SshdServer, **overrides: object) -> OpensshTransport:
    return OpensshTransport.from_uri(
        parse(server.uri("/work")), {**server.transport_options(), **overrides}
    )


def test_aclose_stops_the_master_and_removes_its_directory(sshd: SshdServer) -> None:
    async def main() -> str:
        t = transport(sshd)
        assert (await t.exec(["echo", "hi"], timeout=30)).stdout == b"hi\n"
        master = t._master
        assert master is not None and master.alive()
        await t.aclose()
        assert not master.alive()
        return master.directory

    directory = asyncio.run(main())
    assert not os.path.exists(directory)
    assert masters_of(directory) == []


def test_a_killed_pull_leaves_no_master_behind(sshd: SshdServer, tmp_path: Path) -> None:
    """The master's primary session reads a pipe only the pull holds: SIGKILL the pull,
    and the master ends on its own (it is in a session of its own, so nothing else
    would stop it)."""
    ready = tmp_path / "ready"
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from wsync.transports.openssh import OpensshTransport
        from wsync.uri import parse

        async def main():
            t = OpensshTransport.from_uri(parse({sshd.uri("/work")!r}), {sshd.transport_options()!r})
            await t.exec(["true"], timeout=30)
            open({str(ready)!r}, "w").write(t._master.directory)
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        assert wait_for(lambda: ready.exists() and ready.read_text()), "no master came up"
        directory = ready.read_text()
        assert len(masters_of(directory)) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_for(lambda: masters_of(directory) == []), masters_of(directory)
    finally:
        proc.kill()
        proc.wait()


def test_a_master_started_early_is_adopted_or_stopped_at_exit(
    sshd: SshdServer, tmp_path: Path
) -> None:
    uri = parse(sshd.uri("/work"))
    options = sshd.transport_options()

    async def adopt() -> None:
        openssh.preconnect(uri, options)
        assert len(openssh._EARLY) == 1
        (early,) = openssh._EARLY.values()
        t = OpensshTransport.from_uri(uri, options)
        try:
            assert (await t.exec(["echo", "x"], timeout=30)).stdout == b"x\n"
            assert t._master is early and openssh._EARLY == {}
        finally:
            await t.aclose()

    asyncio.run(adopt())
    # a pull that stops before its transport opens: the process's exit stops the master
    marker = tmp_path / "dir"
    script = textwrap.dedent(
        f"""
        from wsync.transports import openssh
        from wsync.uri import parse
        openssh.preconnect(parse({str(uri.raw)!r}), {options!r})
        (early,) = openssh._EARLY.values()
        open({str(marker)!r}, "w").write(early.directory)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    directory = marker.read_text()
    assert wait_for(lambda: masters_of(directory) == [])
    assert not os.path.exists(directory)


def test_paths_with_spaces_and_percent_signs_reach_ssh_whole(
    sshd: SshdServer, tmp_path: Path
) -> None:
    """OpenSSH splits an ``-o`` value on spaces and expands ``%`` tokens in it."""
    odd = tmp_path / "a b%h %%d"
    odd.mkdir()
    opts = sshd.transport_options()
    key, known = odd / "id key", odd / "known hosts"
    shutil.copy(opts["ssh_key"], key)
    os.chmod(key, 0o600)
    shutil.copy(opts["known_hosts"], known)

    async def main() -> bytes:
        t = transport(sshd, ssh_key=str(key), known_hosts=str(known), ssh_config="none")
        try:
            return (await t.exec(["echo", "odd"], timeout=30)).stdout
        finally:
            await t.aclose()

    assert asyncio.run(main()) == b"odd\n"


def test_a_host_that_looks_like_an_option_is_refused() -> None:
    with pytest.raises(UsageError, match="not a host name"):
        OpensshTransport("-oProxyCommand=touch /tmp/wsync-pwned")
    assert not os.path.exists("/tmp/wsync-pwned")


def test_no_ssh_client_is_a_usage_error_that_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UsageError, match="--ssh-client asyncssh"):
        OpensshTransport("127.0.0.1")


def test_the_client_option_is_checked_and_only_ssh_reads_it(tmp_path: Path) -> None:
    from wsync.transports.local import LocalTransport
    from wsync.transports.registry import factory_for, open_transport

    with pytest.raises(UsageError, match="no client 'putty'"):
        factory_for("ssh", "putty")
    _, local = open_transport(f"local:{tmp_path}", {"ssh_client": "openssh"})
    assert isinstance(local, LocalTransport)


def test_a_killed_pulls_directory_is_removed_by_the_next(sshd: SshdServer, tmp_path: Path) -> None:
    """The master ends with a killed pull; its directory (named for the pull's pid) is
    swept by the next pull's master, and only directories of processes that are gone."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = Path(f"/tmp/wsync-ssh-{gone.pid}-test{os.getpid()}")
    stale.mkdir()
    (stale / "log").write_text("")
    alive = Path(f"/tmp/wsync-ssh-{os.getppid()}-test{os.getpid()}")
    alive.mkdir()
    try:

        async def main() -> None:
            t = transport(sshd)
            try:
                await t.exec(["true"], timeout=30)
            finally:
                await t.aclose()

        asyncio.run(main())
        assert not stale.exists()
        assert alive.exists()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(alive, ignore_errors=True)


def test_a_command_that_exits_255_is_not_a_lost_connection(sshd: SshdServer) -> None:
    async def main() -> tuple[int | None, bool]:
        t = transport(sshd)
        try:
            result = await t.exec(["sh", "-c", "exit 255"], timeout=30)
            return result.exit_status, t._master is not None and t._master.alive()
        finally:
            await t.aclose()

    assert asyncio.run(main()) == (255, True)
