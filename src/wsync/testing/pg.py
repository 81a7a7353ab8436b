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
import secrets
import urllib.parse
from collections.abc import Iterator

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
