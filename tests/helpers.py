"""Shared test helpers: realistic workspaces, a busybox-only guest, pull wrappers."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from wsync.engine.api import PullOptions, PullResult
from wsync.engine.pull import pull
from wsync.errors import TransportError
from wsync.protocol import records, scripts
from wsync.protocol.envelope import parse_envelope
from wsync.protocol.hashing import ALGORITHMS
from wsync.protocol.records import StatusReport
from wsync.transports.base import Channel, Transport
from wsync.transports.local import LocalTransport
from wsync.treediff import diff


def make_tree(root: Path, *, seed: int = 1, big: int = 3 * 1024 * 1024, small: int = 60) -> Path:
    """A workspace with the things agents leave behind, odd ones included."""
    rng = random.Random(seed)
    (root / "src" / "deep" / "er" / "est").mkdir(parents=True)
    (root / "empty" / "nested-empty").mkdir(parents=True)
    for i in range(small):
        (root / "src" / f"f{i}.txt").write_text(f"line {i}\n" * rng.randrange(1, 200))
    (root / "src" / "deep" / "er" / "est" / "leaf").write_bytes(rng.randbytes(1000))
    (root / "blob.bin").write_bytes(rng.randbytes(big))
    (root / "zeros.bin").write_bytes(bytes(big))
    tool = root / "tool.sh"
    tool.write_text("#!/bin/sh\necho hi\n")
    tool.chmod(0o750)
    (root / "link-to-blob").symlink_to("blob.bin")
    (root / "src" / "link-up").symlink_to("../blob.bin")
    (root / "dangling").symlink_to("does-not-exist")
    os.link(root / "blob.bin", root / "hardlink.bin")
    (root / "name with spaces & 'quotes' $(x)").write_text("odd\n")
    (root / "-leading-dash").write_text("dash\n")
    os.mkdir(os.fsencode(root) + b"/latin1-\xe9t\xe9")
    (Path(os.fsdecode(os.fsencode(root) + b"/latin1-\xe9t\xe9")) / "x").write_text("bytes\n")
    (root / "unicode-ünï.txt").write_text("ü\n")
    (root / ("long-" + "n" * 200)).write_text("long name\n")
    ro = root / "readonly"
    ro.mkdir()
    (ro / "inside").write_text("ro\n")
    ro.chmod(0o555)
    os.utime(root / "src" / "f0.txt", (1_000_000_000, 1_000_000_000))
    return root


def tool_dir(directory: Path, tools: tuple[str, ...], *, target: str | None = None) -> Path:
    """A PATH directory holding only ``tools``: each links to ``target`` (a
    multi-call binary such as busybox) or to the host's own tool of that name."""
    directory.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        found = target or shutil.which(tool)
        link = directory / tool
        if found and not link.exists():
            link.symlink_to(found)
    return directory


BUSYBOX_APPLETS = (
    "sh", "tar", "gzip", "sha256sum", "md5sum", "dd", "wc", "find", "mkdir", "rm", "mv",
    "cat", "printf", "sleep", "head", "tr", "sed", "cut", "kill", "touch", "id", "df",
    "awk", "setsid", "nohup", "base64", "echo", "test", "[", "ls", "chmod", "xargs", "du",
    "rmdir",
)  # fmt: skip


def busybox_bin(directory: Path) -> Path:
    """A PATH directory holding only busybox applets: a minimal guest."""
    busybox = shutil.which("busybox")
    assert busybox, "busybox must be installed (scripts/test.sh installs it)"
    return tool_dir(directory, BUSYBOX_APPLETS, target=busybox)


#: the guest shells every script is tried under (see :func:`guest_shell_path`)
GUEST_SHELLS = ("dash", "bash", "busybox")


def guest_shell_path(kind: str, directory: Path) -> str:
    """A guest's PATH: this machine's tools (``sh`` is dash), the same with ``sh`` being
    bash (whose ``read`` of NUL bytes and ``${#var}`` under UTF-8 differ) or yash (which
    counts characters whatever the script sets ``LC_ALL`` to), or busybox only.
    ``directory`` holds what it makes."""
    if kind == "dash":
        return os.environ["PATH"]
    if kind in ("bash", "yash"):
        shell = directory / f"{kind}-sh"
        shell.mkdir(parents=True)
        real = shutil.which(kind)
        assert real, f"{kind} must be installed (scripts/test.sh installs it)"
        (shell / "sh").symlink_to(real)
        return f"{shell}:{os.environ['PATH']}"
    assert kind == "busybox", kind
    return str(busybox_bin(directory / "bb"))


#: a tool that logs its name and arguments, then runs the real one
_LOGGING_SHIM = """#!/bin/sh
echo {tool} "$*" >> {log}
exec {real} "$@"
"""


def shim_tools(directory: Path, path: str, tools: Mapping[str, str | None]) -> tuple[str, Path]:
    """``path`` with each of ``tools`` logging its runs into the returned log (read it
    with :func:`tool_runs`): a tool mapped to None runs the real one, which ``path``
    must have; one mapped to a script text runs that (``{tool}`` and ``{log}`` in it
    filled in)."""
    shims, log = directory / "shims", directory / "runs.log"
    shims.mkdir(parents=True)
    for tool, text in tools.items():
        if text is None:
            real = shutil.which(tool, path=path)
            assert real, f"{tool} is not on the guest's PATH {path}"
            body = _LOGGING_SHIM.format(tool=tool, log=log, real=real)
        else:
            body = text.format(tool=tool, log=log)
        (shims / tool).write_text(body)
        (shims / tool).chmod(0o755)
    return f"{shims}:{path}", log


def tool_runs(log: Path, tool: str, needle: str = "") -> int:
    """How many runs of ``tool`` (with ``needle`` in its arguments) a shim logged."""
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(1 for line in lines if line.split(" ", 1)[0] == tool and needle in line)


def run_status(
    snap: Path,
    path: str,
    index_from: int,
    looks: int,
    env: Mapping[str, str] | None = None,
    inline: int = 0,
) -> StatusReport:
    """Run the status script by hand on the snapshot directory ``snap`` with ``path`` as
    the guest's PATH (and ``env`` on top); its answer, parsed."""
    nonce, sha = "0123456789abcdef", ALGORITHMS["sha256"]
    argv = scripts.status(
        gate=False,
        nonce=nonce,
        algorithm="sha256",
        b64=False,
        staging_root=str(snap.parent),
        snapshot=snap.name,
        index_from=index_from,
        looks=looks,
        inline=inline,
    )
    full = {"PATH": path, "HOME": str(snap.parent), **(env or {})}
    out = subprocess.run(argv, env=full, capture_output=True, timeout=60, check=False).stdout
    envelope = parse_envelope(out, nonce, algorithm=sha, max_length=1 << 20)
    assert envelope.ok, envelope.text
    return records.parse_status(envelope.payload, sha, index_from)


def local(env: Mapping[str, str] | None = None) -> LocalTransport:
    return LocalTransport(env=dict(env) if env else None)


def options(tmp: Path, **kw: Any) -> PullOptions:
    kw.setdefault("state_dir", tmp / "state")
    kw.setdefault("staging_root", str(tmp / "staging"))
    kw.setdefault("call_timeout", 30.0)
    return PullOptions(**kw)


def run_pull(transport: Transport, workspace: Path, dest: Path, opts: PullOptions) -> PullResult:
    async def go() -> PullResult:
        try:
            return await pull(transport, str(workspace), dest, opts)
        finally:
            await transport.aclose()

    return asyncio.run(go())


def assert_exact(workspace: Path, dest: Path) -> None:
    problems = diff(workspace, dest)
    assert problems == [], problems[:10]


def pids_with(env: str, arg: str | None = None) -> list[int]:
    """Processes whose environment holds the entry ``env`` (``NAME=value``) and, if
    given, whose argv holds ``arg``: a test's own guest processes, whichever transport
    started them."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            argv = (entry / "cmdline").read_bytes().split(b"\0") if arg else []
        except OSError:
            continue
        if os.fsencode(env) in environ and (arg is None or os.fsencode(arg) in argv):
            found.append(int(entry.name))
    return found


def writer_around_tar(tmp_path: Path, script: str, *, tar: str | None = None) -> LocalTransport:
    """A guest whose real tar is wrapped by ``script`` (sh), which sees ``$WS`` (the
    workspace), ``$FOLLOW`` (1 for a re-read round: tar was given ``-N``, a mark) and ``$N``
    (how many times tar has run), and runs ``real_tar "$@"`` where it wants the read."""
    bindir = tmp_path / "wrapped-tar"
    bindir.mkdir(exist_ok=True)
    real = tar or shutil.which("tar")
    count = tmp_path / "tar-count"
    wrapper = bindir / "tar"
    wrapper.write_text(
        "#!/bin/sh\n"
        # (the producer's own calls that read nothing: a version, a name's quoting)
        'case " $* " in *" --version "*|*" /dev/null "*) exec ' + f'{real} "$@" ;; esac\n'
        f'real_tar() {{ {real} "$@"; }}\n'
        f"N=$(( $(cat {count} 2>/dev/null || echo 0) + 1 )); echo $N > {count}\n"
        'FOLLOW=0; case " $* " in *" -N "*) FOLLOW=1 ;; esac\n'
        f"WS={tmp_path / 'ws'}\n" + script + "\n"
    )
    wrapper.chmod(0o755)
    path = f"{bindir}:{os.environ['PATH']}" if tar is None else f"{bindir}:{Path(real).parent}"
    return LocalTransport(env={**os.environ, "PATH": path})


#: a channel's command for the channel tests: answers each line read with "got LINE"; a
#: line "bye" ends it (exit 3)
ECHO = ["sh", "-c", 'while read -r x; do [ "$x" = bye ] && exit 3; echo "got $x"; done']


async def receive_line(channel: Channel) -> bytes:
    """Receive until a whole line came (answers may come in pieces)."""
    got = b""
    while not got.endswith(b"\n"):
        data = await channel.receive(10.0)
        assert data, f"the channel ended after {got!r}"
        got += data
    return got


async def echo_in_lockstep_then_close(channel: Channel, big: int) -> None:
    """Requests and answers through :data:`ECHO`'s channel in lockstep, the last ``big``
    bytes long (several messages each way), then a close: the channel has ended, a send
    is refused, and a second close does nothing."""
    for word in (b"one", b"two", b"x" * big):
        await channel.send(word + b"\n")
        assert await receive_line(channel) == b"got " + word + b"\n"
    assert not channel.ended
    await channel.aclose()
    assert channel.ended
    with pytest.raises(TransportError, match="closed"):
        await channel.send(b"more\n")
    await channel.aclose()  # idempotent


async def echo_until_its_end(channel: Channel) -> None:
    """:data:`ECHO`'s command ends ("bye") right after an answer: the answer arrives, then
    a receive fails naming the end, and the channel has ended."""
    await channel.send(b"first\nbye\n")
    assert await receive_line(channel) == b"got first\n"
    with pytest.raises(TransportError, match="ended"):
        while await channel.receive(10.0):
            pass
    assert channel.ended
    await channel.aclose()


def counting_cleanups(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """The snapshots each guest cleanup call of the test names, in order (the calls go on
    as usual)."""
    from wsync.engine.guest import GuestSession

    calls: list[tuple[str, ...]] = []
    cleanup = GuestSession.cleanup

    async def counting(session: GuestSession, *snapshots: str) -> None:
        calls.append(snapshots or (session.snapshot,))
        await cleanup(session, *snapshots)

    monkeypatch.setattr(GuestSession, "cleanup", counting)
    return calls


async def exec_error(transport: Transport, server: asyncio.AbstractServer) -> BaseException | None:
    """What ``exec(["true"])`` through ``transport`` raised (None: nothing); the transport
    and the ``server`` it talks to are closed after."""
    try:
        await transport.exec(["true"], timeout=20)
    except Exception as err:  # the caller looks at what came out
        return err
    finally:
        await transport.aclose()
        server.close()
    return None
