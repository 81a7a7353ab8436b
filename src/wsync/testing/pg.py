"""A throwaway PostgreSQL database per test or bench run, on the server the machine runs.

The fleet tests need a real PostgreSQL (``SELECT … FOR UPDATE SKIP LOCKED``,
advisory locks and ``LISTEN/NOTIFY`` are the point).  ``scripts/test.sh``
starts one where none runs; tests find it at ``WSYNC_TEST_PG`` (a
``postgresql://`` URL of a database they may connect to, default
``postgresql://postgres@127.0.0.1:5432/test``), create a database with a random
name there, and drop it afterwards, so tests never see each other's jobs.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"


class PgUnavailable(RuntimeError):
    """No PostgreSQL answers at the configured address."""


def base_dsn() -> str:
    return os.environ.get("WSYNC_TEST_PG") or DEFAULT_DSN


def with_database(dsn: str, name: str) -> str:
    """``dsn`` with its database replaced by ``name``."""
    parts = urllib.parse.urlsplit(dsn)
    return urllib.parse.urlunsplit(parts._replace(path="/" + urllib.parse.quote(name)))


def with_address(dsn: str, host: str, port: int) -> str:
    """``dsn`` pointed at another host and port (a proxy in front of the server)."""
    parts = urllib.parse.urlsplit(dsn)
    auth = parts.netloc.rpartition("@")[0]
    netloc = f"{auth}@{host}:{port}" if auth else f"{host}:{port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


@contextlib.contextmanager
def scratch_database(dsn: str | None = None) -> Iterator[str]:
    """Create ``wsync_<random>`` on the server of ``dsn``; yield its URL; drop it after."""
    import psycopg

    base = dsn or base_dsn()
    try:
        admin = psycopg.connect(base, autocommit=True, connect_timeout=5)
    except psycopg.Error as err:
        raise PgUnavailable(f"no PostgreSQL at {_shown(base)}: {err}".strip()) from None
    name = f"wsync_{secrets.token_hex(6)}"
    try:
        admin.execute(f'CREATE DATABASE "{name}"')  # a fixed alphabet: hex digits
        yield with_database(base, name)
    finally:
        with contextlib.suppress(psycopg.Error):
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def _shown(dsn: str) -> str:
    """The DSN without its password, for messages."""
    parts = urllib.parse.urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


class Cluster:
    """A PostgreSQL server this process started (``initdb`` into a temporary directory), so a
    test may stop and start it: a real server restart, which a shared server never allows."""

    def __init__(self, datadir: Path, port: int, as_postgres: list[str]) -> None:
        self.datadir, self.port, self._as = datadir, port, as_postgres
        self.dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def _ctl(self, *args: str) -> None:
        options = f"-p {self.port} -k {self.datadir} -c listen_addresses=127.0.0.1"
        subprocess.run(
            [*self._as, _tool("pg_ctl"), "-D", str(self.datadir), "-o", options, "-w", *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )

    def start(self) -> None:
        self._ctl("-l", str(self.datadir / "server.log"), "start")

    def stop(self) -> None:
        """A fast shutdown: every client connection is terminated, as in a real restart."""
        self._ctl("-m", "fast", "stop")


@contextlib.contextmanager
def throwaway_cluster() -> Iterator[Cluster]:
    """``initdb`` and start a cluster on a free loopback port (trust auth); remove it after.

    As root the server runs as the ``postgres`` user (PostgreSQL refuses root).  Raises
    :class:`PgUnavailable` where the server binaries or that user are missing.
    """
    try:
        initdb = _tool("initdb")
    except FileNotFoundError as err:
        raise PgUnavailable(str(err)) from None
    as_postgres: list[str] = []
    owner: tuple[int, int] | None = None
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            raise PgUnavailable("running as root and no postgres user to run a server") from None
        as_postgres, owner = ["runuser", "-u", "postgres", "--"], (pw.pw_uid, pw.pw_gid)
    # not under pytest's tmp_path: its parents are private to root
    top = Path(tempfile.mkdtemp(prefix="wsync-pg-"))
    datadir = top / "data"
    try:
        datadir.mkdir(mode=0o700)
        if owner is not None:
            os.chown(top, *owner)
            os.chown(datadir, *owner)
        subprocess.run(
            [
                *as_postgres,
                initdb,
                "-D",
                str(datadir),
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=120,
        )
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        cluster = Cluster(datadir, port, as_postgres)
        cluster.start()
    except (OSError, subprocess.SubprocessError) as err:
        shutil.rmtree(top, ignore_errors=True)
        raise PgUnavailable(f"cannot start a throwaway cluster: {err}") from None
    try:
        yield cluster
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            cluster._ctl("-m", "immediate", "stop")
        shutil.rmtree(top, ignore_errors=True)


def _tool(name: str) -> str:
    """A PostgreSQL server tool: on PATH, or in Debian's versioned directory."""
    found = shutil.which(name)
    if found:
        return found
    for bindir in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (bindir / name).exists():
            return str(bindir / name)
    raise FileNotFoundError(f"no {name} (install the postgresql server package)")
