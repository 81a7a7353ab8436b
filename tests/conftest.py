"""Shared fixtures: a real sshd, the list of real transports, and a process watcher.

Tests are plain sync functions that call ``asyncio.run(...)`` (there is no
pytest-asyncio).  A transport binds to the event loop it first runs in, so
fixtures hand out *builders* and each test builds its transport inside its own
``asyncio.run``.

Adding a backend to the conformance suite is one entry in
:data:`REAL_TRANSPORTS`: a function that takes the pytest ``request`` (to pull
in the fixtures it needs, e.g. a server) and returns a :class:`TransportCase`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from wsync.emulators import e2b as e2b_emulator
from wsync.emulators.cloudflare import EmulatorThread as CloudflareEmulatorThread
from wsync.emulators.daytona import DaytonaEmulatorThread
from wsync.emulators.docker import EmulatorThread as DockerEmulatorThread
from wsync.emulators.k8s import K8sEmulatorThread
from wsync.emulators.sprites import EmulatorThread
from wsync.testing.sshd import SshdServer, SshdUnavailable
from wsync.transports.base import KILL_MARK, Transport
from wsync.transports.cloudflare import CloudflareTransport
from wsync.transports.daytona import DaytonaTransport
from wsync.transports.docker import DockerTransport
from wsync.transports.e2b import E2BTransport
from wsync.transports.k8s import K8sTransport
from wsync.transports.local import LocalTransport
from wsync.transports.openssh import OpensshTransport
from wsync.transports.sprites import SpritesTransport
from wsync.transports.ssh import SshTransport
from wsync.uri import parse

# -- a real OpenSSH server ---------------------------------------------------


def start_sshd(workdir: Path) -> SshdServer:
    """Start an :class:`SshdServer`, skipping only when sshd is not installed.

    In CI (``CI`` or ``WSYNC_REQUIRE_SSHD`` set) a missing sshd fails instead,
    so the ssh tests can never silently stop running there.
    """
    server = SshdServer(workdir)
    try:
        return server.start()
    except SshdUnavailable as exc:
        if os.environ.get("CI") or os.environ.get("WSYNC_REQUIRE_SSHD"):
            pytest.fail(f"sshd is required here: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdServer]:
    """One sshd for the whole session (tests that stop or restart sshd start their own)."""
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield server
    finally:
        server.stop()


# -- the real transports -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TransportCase:
    """How to build one real transport for one test."""

    name: str
    #: builds a fresh transport; call it inside the test's event loop
    make: Callable[[], Transport]
    #: the guest's processes run on this machine, so tests may look in /proc
    guest_is_local: bool = True


def _local_case(request: pytest.FixtureRequest) -> TransportCase:
    return TransportCase("local", LocalTransport)


def _ssh_case(request: pytest.FixtureRequest) -> TransportCase:
    server: SshdServer = request.getfixturevalue("sshd")
    uri = parse(server.uri("/work"))
    options = server.transport_options()
    return TransportCase("ssh", lambda: SshTransport.from_uri(uri, options))


def _openssh_case(request: pytest.FixtureRequest) -> TransportCase:
    server: SshdServer = request.getfixturevalue("sshd")
    uri = parse(server.uri("/work"))
    options = server.transport_options()
    return TransportCase("ssh", lambda: OpensshTransport.from_uri(uri, options))


@pytest.fixture(scope="session")
def sprites_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorThread]:
    """The Sprites emulator (faults off) in a background thread, for the whole session."""
    with EmulatorThread(tmp_path_factory.mktemp("sprites")) as emulator:
        emulator.create_sprite("conformance")
        yield emulator


def _sprites_case(request: pytest.FixtureRequest) -> TransportCase:
    emulator: EmulatorThread = request.getfixturevalue("sprites_emulator")
    uri = parse("sprites://conformance/work")
    options = emulator.transport_options()
    return TransportCase("sprites", lambda: SpritesTransport.from_uri(uri, options))


@pytest.fixture(scope="session")
def e2b_envd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[e2b_emulator.EmulatorThread]:
    """The E2B envd emulator (faults off) in a background thread, for the whole session."""
    with e2b_emulator.EmulatorThread(tmp_path_factory.mktemp("e2b")) as emulator:
        emulator.create_sandbox("conformance")
        yield emulator


@pytest.fixture(scope="session")
def cloudflare_emulator(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CloudflareEmulatorThread]:
    """The Cloudflare Bridge emulator (faults off) in a background thread."""
    with CloudflareEmulatorThread(tmp_path_factory.mktemp("cloudflare")) as emulator:
        emulator.create_sandbox("conformance")
        yield emulator


@pytest.fixture(scope="session")
def daytona_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaytonaEmulatorThread]:
    """The Daytona toolbox emulator (faults off), for the whole session."""
    with DaytonaEmulatorThread(tmp_path_factory.mktemp("daytona")) as emulator:
        emulator.create_sandbox("conformance")
        yield emulator


@pytest.fixture(scope="session")
def docker_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerEmulatorThread]:
    """The Docker Engine API emulator (faults off) on a unix socket, for the whole session."""
    with DockerEmulatorThread(tmp_path_factory.mktemp("docker")) as emulator:
        emulator.create_container("conformance")
        yield emulator


def _docker_case(request: pytest.FixtureRequest) -> TransportCase:
    emulator: DockerEmulatorThread = request.getfixturevalue("docker_emulator")
    uri = parse("docker://conformance/work")
    options = emulator.transport_options()
    return TransportCase("docker", lambda: DockerTransport.from_uri(uri, options))


def _e2b_case(request: pytest.FixtureRequest) -> TransportCase:
    emulator: e2b_emulator.EmulatorThread = request.getfixturevalue("e2b_envd")
    uri = parse("e2b://conformance/work")
    options = emulator.transport_options()
    return TransportCase("e2b", lambda: E2BTransport.from_uri(uri, options))


def _daytona_case(request: pytest.FixtureRequest) -> TransportCase:
    emulator: DaytonaEmulatorThread = request.getfixturevalue("daytona_emulator")
    uri = parse("daytona://conformance/work")
    options = emulator.transport_options()
    return TransportCase("daytona", lambda: DaytonaTransport.from_uri(uri, options))


def _cloudflare_case(request: pytest.FixtureRequest) -> TransportCase:
    emulator: CloudflareEmulatorThread = request.getfixturevalue("cloudflare_emulator")
    uri = parse("cloudflare://conformance/work")
    options = emulator.transport_options()
    return TransportCase("cloudflare", lambda: CloudflareTransport.from_uri(uri, options))


@pytest.fixture(scope="session")
def k8s_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[K8sEmulatorThread]:
    """The Kubernetes API server emulator (faults off, HTTPS), for the whole session."""
    with K8sEmulatorThread(tmp_path_factory.mktemp("k8s")) as emulator:
        emulator.create_pod("conformance")
        yield emulator


def _k8s_case(request: pytest.FixtureRequest) -> TransportCase:
    emulator: K8sEmulatorThread = request.getfixturevalue("k8s_emulator")
    uri = parse("k8s://default/conformance/work")
    options = emulator.transport_options()
    return TransportCase("k8s", lambda: K8sTransport.from_uri(uri, options))


@pytest.fixture(scope="session")
def k8s_v4_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[K8sEmulatorThread]:
    """An API server that speaks only ``v4.base64.channel.k8s.io``: no stdin EOF, text frames."""
    with K8sEmulatorThread(
        tmp_path_factory.mktemp("k8s-v4"), protocols=("v4.base64.channel.k8s.io",)
    ) as emulator:
        emulator.create_pod("conformance")
        yield emulator


def _k8s_v4_case(request: pytest.FixtureRequest) -> TransportCase:
    emulator: K8sEmulatorThread = request.getfixturevalue("k8s_v4_emulator")
    uri = parse("k8s://default/conformance/work")
    options = emulator.transport_options()
    return TransportCase("k8s", lambda: K8sTransport.from_uri(uri, options))


#: every real transport the conformance suite must pass; one line per backend
REAL_TRANSPORTS = [
    pytest.param(_local_case, id="local"),
    pytest.param(_ssh_case, id="ssh", marks=pytest.mark.ssh),
    pytest.param(_openssh_case, id="openssh", marks=pytest.mark.ssh),
    pytest.param(_sprites_case, id="sprites"),
    pytest.param(_e2b_case, id="e2b"),
    pytest.param(_daytona_case, id="daytona"),
    pytest.param(_cloudflare_case, id="cloudflare"),
    pytest.param(_docker_case, id="docker"),
    pytest.param(_k8s_case, id="k8s"),
    pytest.param(_k8s_v4_case, id="k8s-v4base64"),
]


@pytest.fixture(params=REAL_TRANSPORTS)
def transport_case(request: pytest.FixtureRequest) -> TransportCase:
    build: Callable[[pytest.FixtureRequest], TransportCase] = request.param
    return build(request)


# -- processes started by tests ----------------------------------------------


class ProcessWatch:
    """Finds processes by a unique ``sleep`` argument, and kills leftovers at teardown.

    ``sleep_arg()`` returns a duration like ``"30.48213"`` that no other
    process uses, so ``pids(arg)`` finds exactly the processes a test started
    (through any transport) and teardown can end them by pid.
    """

    def __init__(self) -> None:
        self._issued: list[str] = []

    def sleep_arg(self, seconds: int = 30) -> str:
        arg = f"{seconds}.{random.randrange(10**7):07d}"
        self._issued.append(arg)
        return arg

    @staticmethod
    def pids(arg: str) -> list[int]:
        """Live (non-zombie) pids whose argv contains ``arg`` as a whole argument."""
        needle = arg.encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if needle in argv and state != "Z":
                found.append(int(entry.name))
        return found

    def wait_gone(self, arg: str, timeout: float = 10.0) -> list[int]:
        """Poll until no process carries ``arg``; return what is left at the deadline."""
        deadline = time.monotonic() + timeout
        while (left := self.pids(arg)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def wait_present(self, arg: str, timeout: float = 10.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while not (found := self.pids(arg)) and time.monotonic() < deadline:
            time.sleep(0.02)
        return found

    def kill_all(self) -> None:
        for arg in self._issued:
            for pid in self.pids(arg):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def procs() -> Iterator[ProcessWatch]:
    watch = ProcessWatch()
    try:
        yield watch
    finally:
        watch.kill_all()


@pytest.fixture
def no_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No run's stream comes whole with a status: every run's staging stays in the guest
    for the pull's last cleanup (or a rerun), as a run too big to come whole does, for
    tests of that path with a small workspace (a run that comes whole removes its own
    staging: tests/test_inline_clean.py)."""
    from wsync.protocol import scripts

    monkeypatch.setattr(scripts, "STATUS_INLINE_MAX", 0)


# -- guest kill markers ------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def _kill_markers_swept() -> Iterator[None]:
    """The emulators' guests are this machine, so the kill markers that docker and
    daytona kills must sometimes leave (``KILL_MARK``) land in its /tmp: the ones this
    session made are removed at its end (a guest's own sweep waits an hour), once they
    are a minute old.  A fresh one may be another pytest process's (an xdist worker
    still running): removing it made that worker's cancelled command run after all."""
    before = set(glob.glob(KILL_MARK + "*"))
    yield
    for path in set(glob.glob(KILL_MARK + "*")) - before:
        with contextlib.suppress(OSError):
            if time.time() - os.stat(path).st_mtime > 60:
                os.rmdir(path)
