"""asyncssh's import runs no compiler, and its connections ACK at once (``wsync.transports.sshlib``, issue 13).

Its search for liboqs used to run ``gcc``, ``collect2`` and ``ld`` on every ``ssh://``
command of a host without liboqs: about 30 ms and six programs.  These tests import
the ssh transport in a fresh interpreter with ``gcc`` and ``ld`` shimmed to log, and
check what the lookup still finds.

The ACK tests read the kernel's own delayed-ACK state (``getsockopt(TCP_QUICKACK)`` is 1
outside Linux's "pingpong" mode, where ACKs wait up to 40 ms) on real loopback sockets,
and run large outputs through a real sshd with the hook in place.
"""

from __future__ import annotations

import asyncio
import ctypes.util
import inspect
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from wsync.testing.sshd import SshdServer
from wsync.transports import sshlib
from wsync.transports.registry import open_transport
from wsync.transports.ssh import SshTransport

_LOG = """#!/bin/sh
echo "$0 $*" >> {log}
exit 1
"""


def test_importing_the_ssh_transport_runs_no_compiler(tmp_path: Path) -> None:
    """With logging ``gcc`` and ``ld`` first on PATH and a loader cache that has neither
    liboqs nor nettle, importing the transport runs neither tool; asyncssh still has its
    ML-KEM key exchange, and ``find_library`` is CPython's own again afterwards."""
    shims, log = tmp_path / "shims", tmp_path / "runs.log"
    shims.mkdir()
    for tool in ("gcc", "cc", "ld", "collect2"):
        (shims / tool).write_text(_LOG.format(log=log))
        (shims / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}")
    env.pop("LD_LIBRARY_PATH", None)
    probe = (
        "import ctypes.util; find = ctypes.util.find_library\n"
        # a host whose loader cache has neither liboqs nor nettle (this one has nettle)
        "ctypes.util._findSoname_ldconfig = lambda name: None\n"
        "import wsync.transports.ssh\n"
        "import asyncssh.crypto.pq as pq\n"
        "assert ctypes.util.find_library is find\n"
        "print(pq.mlkem_available)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]
    assert not log.exists(), log.read_text()
    # the shims do log when called: the same lookup without this module runs them
    plain = "import ctypes.util; ctypes.util.find_library('oqs')"
    subprocess.run([sys.executable, "-c", plain], env=env, timeout=120, check=True)
    assert log.exists() and "gcc" in log.read_text()


def test_importing_the_ssh_transport_loads_no_x509_it_cannot_use(tmp_path: Path) -> None:
    """asyncssh's X.509 support needs pyOpenSSL; without it, importing the transport does
    not load ``cryptography.x509`` (20-30 ms) on the way to finding that out, and asyncssh
    ends up as it would have: without X.509.  With a pyOpenSSL on the path (a stand-in
    that is enough for asyncssh's import), asyncssh gets to try it as before."""
    import importlib.util

    if importlib.util.find_spec("OpenSSL") is not None:
        pytest.skip("pyOpenSSL is installed here: asyncssh's X.509 is not left out")
    probe = (
        "import sys\n"
        "import wsync.transports.ssh\n"
        "import asyncssh.known_hosts as kh, asyncssh.public_key as pk\n"
        "print('cryptography.x509' in sys.modules, kh._x509_available, pk._x509_available)\n"
        "assert 'asyncssh.crypto.x509' not in sys.modules  # the mark went with the import\n"
    )
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "False"]
    # the same without this module: asyncssh loads cryptography.x509, then fails on OpenSSL
    plain = probe.replace("import wsync.transports.ssh\n", "import asyncssh\n")
    done = subprocess.run(
        [sys.executable, "-c", plain], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.stdout.split() == ["True", "False", "False"], done.stderr
    # a stand-in OpenSSL module without a spec: taken as found, the import still works
    stub = "import sys, types; sys.modules['OpenSSL'] = types.ModuleType('OpenSSL')\n"
    done = subprocess.run(
        [sys.executable, "-c", stub + probe], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "False"]
    # a pyOpenSSL to be found: asyncssh's own attempt runs (and here fails in its module)
    fake = tmp_path / "OpenSSL"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "crypto.py").write_text("raise ImportError('a stand-in')\n")
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "False"]


def test_other_names_go_to_cpythons_lookup() -> None:
    seen: list[str] = []

    def find(name: str) -> str | None:
        seen.append(name)
        return f"lib{name}.so.9"

    lookup = sshlib._cached_lookup(find)
    assert lookup is not None
    assert lookup("z") == "libz.so.9" and seen == ["z"]
    # asyncssh's names: the loader's cache, never ``find``
    cache = ctypes.util._findSoname_ldconfig  # type: ignore[attr-defined]
    assert lookup("nettle") == cache("nettle") and lookup("oqs") == cache("oqs")
    assert seen == ["z"]


@pytest.mark.skipif(
    not (shutil.which("ld") and shutil.which("objdump")), reason="needs binutils (ld, objdump)"
)
def test_a_liboqs_on_ld_library_path_is_still_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library found only through ``LD_LIBRARY_PATH`` (not in the loader's cache) is
    found as before: here a copy of libz named ``liboqs.so``, by its soname."""
    libz = ctypes.util.find_library("z")
    assert libz is not None
    dirs = [Path(p) for p in ("/lib", "/usr/lib", "/lib64", "/usr/lib64")]
    found = [d / libz for d in dirs + [s for d in dirs for s in d.glob("*-linux-gnu*")]]
    source = next((f for f in found if f.exists()), None)
    if source is None:
        pytest.skip(f"{libz} is in none of {[str(d) for d in dirs]}")
    shutil.copy(source, tmp_path / "liboqs.so")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    lookup = sshlib._cached_lookup(ctypes.util.find_library)
    assert lookup is not None
    assert lookup("oqs") == libz


class _Receiver(asyncio.Protocol):
    """Enough of an asyncssh connection for :func:`sshlib.ack_at_once`: its transport's
    socket, and ``data_received``, which notes the ACK mode at the moment it runs."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.blocks: list[tuple[bytes, int | None, int]] = []
        self.got = asyncio.Event()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_extra_info(self, name: str) -> Any:
        return self.transport.get_extra_info(name)

    def data_received(self, data: bytes, datatype: int | None = None) -> None:
        sock = self.transport.get_extra_info("socket")
        quick = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK)
        self.blocks.append((data, datatype, quick))
        self.got.set()


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="Linux only")
def test_each_block_received_leaves_the_delayed_ack_mode() -> None:
    """Put in delayed-ACK mode (as a connection that answers what it reads soon
    enters), a socket with the hook is out of it by the time the block is handed on:
    the kernel ACKs at once.  The block itself reaches the protocol unchanged."""

    async def main() -> list[tuple[bytes, int | None, int]]:
        loop = asyncio.get_running_loop()
        sent = asyncio.Event()
        peers: list[asyncio.Transport] = []

        def serve() -> asyncio.Protocol:
            class Peer(asyncio.Protocol):
                def connection_made(self, transport: Any) -> None:
                    peers.append(transport)
                    sent.set()

            return Peer()

        server = await loop.create_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            _, client = await loop.create_connection(_Receiver, "127.0.0.1", port)
            assert sshlib.ack_at_once(client)  # type: ignore[arg-type]  # duck-typed
            await sent.wait()
            for block in (b"first", b"second"):
                client.got.clear()
                sock = client.transport.get_extra_info("socket")
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 0)  # pingpong
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 0
                peers[0].write(block)
                await asyncio.wait_for(client.got.wait(), 30)
            client.transport.close()
            return client.blocks
        finally:
            server.close()
            await server.wait_closed()

    blocks = asyncio.run(main())
    assert [b for b, _, _ in blocks] == [b"first", b"second"]
    assert [d for _, d, _ in blocks] == [None, None]
    assert [q for _, _, q in blocks] == [1, 1]


def test_the_hook_goes_after_its_blocks() -> None:
    """After ``blocks`` blocks the protocol's own method takes them again, unchanged."""

    class Stub:
        def __init__(self) -> None:
            self.got: list[bytes] = []
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)

        def get_extra_info(self, name: str) -> Any:
            return self.sock

        def data_received(self, data: bytes, datatype: int | None = None) -> None:
            self.got.append(data)

    stub = Stub()
    try:
        assert sshlib.ack_at_once(stub, blocks=2)  # type: ignore[arg-type]  # duck-typed
        for block in (b"a", b"b"):
            assert not inspect.ismethod(stub.data_received)
            stub.data_received(block)
        assert inspect.ismethod(stub.data_received)
        stub.data_received(b"c")
        assert stub.got == [b"a", b"b", b"c"]
    finally:
        stub.sock.close()


def test_the_hook_passes_over_what_is_not_tcp() -> None:
    """A ProxyCommand's pipe or a Unix socket: nothing to ACK, the method stays."""

    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        try:
            _, client = await loop.create_connection(_Receiver, sock=ours)
            applied = sshlib.ack_at_once(client)  # type: ignore[arg-type]  # duck-typed
            still_method = inspect.ismethod(client.data_received)
            client.transport.close()
            return applied, still_method
        finally:
            theirs.close()

    assert asyncio.run(main()) == (False, True)


@pytest.mark.ssh
def test_ssh_connections_ack_at_once_and_carry_every_byte(sshd: SshdServer) -> None:
    """The transport's connection has the hook for its first blocks (its first exec
    among them), then the class's own method again; outputs of every size arrive whole
    through both, over a real sshd."""
    _, transport = open_transport(sshd.uri("/work"), sshd.transport_options())
    assert isinstance(transport, SshTransport)

    async def main() -> tuple[list[bytes], bool, bool]:
        try:
            first = (await transport.exec(["echo", "hi"], timeout=60)).stdout
            conn = transport._conn
            assert conn is not None
            hooked = not inspect.ismethod(conn.data_received)
            outs = [first] + [
                (await transport.exec(["head", "-c", str(n), "/dev/urandom"], timeout=60)).stdout
                for n in (0, 1, 65536, 16 << 20)  # 16 MiB: 64 blocks or more
            ]
            return outs, hooked, inspect.ismethod(conn.data_received)
        finally:
            await transport.aclose()

    outs, hooked, restored = asyncio.run(main())
    assert [len(o) for o in outs] == [3, 0, 1, 65536, 16 << 20]
    assert hooked and restored
