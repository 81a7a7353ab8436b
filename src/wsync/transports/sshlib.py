"""asyncssh, imported without running the C compiler or loading X.509, and its connections'
ACKs sent at once.

On import asyncssh looks for two optional C libraries with ``ctypes.util.find_library``:
liboqs (``"oqs"``, ``"liboqs"``), for post-quantum key exchanges, and nettle
(``"nettle"``, ``"libnettle"``, ``"libnettle-6"``), for UMAC.  Where the dynamic
loader's cache (``ldconfig -p``) has no such library, CPython's lookup goes on to run
``gcc`` (with its ``collect2`` and ``ld``) and then ``ld`` for each name: six programs
and about 30 ms of every ``ssh://`` command on a host without liboqs, most hosts
(measured 2026-12-03: a one-file pull took 0.66 s in all; issue 13), and as many again
without nettle.

While asyncssh imports, those names are looked up in the loader's cache and, where
``LD_LIBRARY_PATH`` is set, by ``ld`` in its directories.  Left out are the compiler's
and ``ld``'s default directories: a library copied there without running ``ldconfig``
is not found, and asyncssh goes without it as on a host that lacks it (ML-KEM from
``cryptography`` stays; sntrup761 or UMAC are not offered).  Every other name, and
every lookup after the import, is CPython's own.

asyncssh also tries its X.509 support, which needs pyOpenSSL: without it (wsync does not
depend on it) the attempt still loads ``cryptography.x509`` and its name parsing before it
fails, 20-30 ms of every ``ssh://`` command for nothing (measured 2026-12-04: 135 ms for
this module's import with it, 115 ms without; a one-file pull takes about 0.37 s).  Where
pyOpenSSL cannot be found, asyncssh's module is marked missing while asyncssh imports, so
it takes its own "not available" branch at once, as it would after the failed attempt.

:func:`ack_at_once` takes 40 ms off the first exec of every connection: see there.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import importlib.util
import os
import socket
import sys
import warnings
from collections.abc import Callable
from typing import Any

_COMPILER_FREE = frozenset({"oqs", "liboqs", "nettle", "libnettle", "libnettle-6"})


def _cached_lookup(
    find: Callable[[str], str | None],
) -> Callable[[str], str | None] | None:
    """``find`` with :data:`_COMPILER_FREE` looked up without gcc; None where this
    Python's ``ctypes.util`` has not the pieces (another platform or version)."""
    ldconfig = getattr(ctypes.util, "_findSoname_ldconfig", None)
    ld = getattr(ctypes.util, "_findLib_ld", None)
    soname = getattr(ctypes.util, "_get_soname", None)
    if ldconfig is None or ld is None or soname is None:
        return None

    def lookup(name: str) -> str | None:
        if name not in _COMPILER_FREE:
            return find(name)
        found: str | None = ldconfig(name)
        if found is None and os.environ.get("LD_LIBRARY_PATH"):
            found = soname(ld(name))
        return found

    return lookup


def _without_openssl() -> bool:
    """pyOpenSSL cannot be imported here (a module already in ``sys.modules`` counts as
    found; one without a spec, a test's stand-in say, as found too)."""
    try:
        return importlib.util.find_spec("OpenSSL") is None
    except (ImportError, ValueError):
        return False


_X509 = "asyncssh.crypto.x509"
_blocked = "asyncssh" not in sys.modules and _X509 not in sys.modules and _without_openssl()
_find = ctypes.util.find_library
_lookup = _cached_lookup(_find)
if _lookup is not None:
    ctypes.util.find_library = _lookup  # type: ignore[assignment]  # same signature
if _blocked:
    sys.modules[_X509] = None  # type: ignore[assignment]  # import raises ImportError
try:
    # after the lookup is in place: the point of this module.  cryptography 51 warns on
    # every use of its DSA classes, and asyncssh's import names them (asyncssh still
    # offers DSA keys): a warning on every pull's stderr that no user can act on, and an
    # error under the tests' -W error
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DSA is deprecated", category=UserWarning)
        import asyncssh
finally:
    ctypes.util.find_library = _find
    if _blocked and sys.modules.get(_X509, 0) is None:
        del sys.modules[_X509]  # only asyncssh's import went without it


def ack_at_once(conn: asyncssh.SSHClientConnection, blocks: int = 32) -> bool:
    """Acknowledge the first ``blocks`` blocks of ``conn`` at once; False where it is not
    TCP on Linux.

    Why: right after authentication OpenSSH's sshd writes two small messages (the
    auth success, then its host keys announcement) and, a moment later, the answer to
    our first channel open, on a socket without ``TCP_NODELAY`` (sshd sets it only once
    a session starts).  Nagle holds that answer until the announcement is acknowledged,
    and the client, having nothing to send, delays its ACK by Linux's 40 ms minimum.
    So the first exec of every connection took 45-50 ms where the next took 2-3 ms
    (loopback, measured 2026-12-04), on every pull.  Setting ``TCP_QUICKACK`` when data
    arrives sends a pending ACK immediately and leaves the delayed-ACK mode; it is not
    sticky, hence once per block received.  Only for the connection's first blocks
    (the handshake's last messages and the first session's start take a dozen): by then
    sshd has ``TCP_NODELAY`` on, and bulk reads keep the kernel's usual ACK pacing.
    """
    quickack = getattr(socket, "TCP_QUICKACK", None)
    sock: Any = conn.get_extra_info("socket")
    if quickack is None or sock is None:
        return False
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return False  # a ProxyCommand's pipe, say
    received = conn.data_received
    left = [blocks]

    def data_received(data: bytes, datatype: int | None = None) -> None:
        with contextlib.suppress(OSError):  # a socket closing under us: the read tells
            sock.setsockopt(socket.IPPROTO_TCP, quickack, 1)
        left[0] -= 1
        if left[0] <= 0:
            # the class's own method again from the next block on
            with contextlib.suppress(AttributeError):
                del conn.data_received
        received(data, datatype)

    # the transport looks the method up on the protocol for every block it reads
    conn.data_received = data_received  # type: ignore[method-assign]
    return True


__all__ = ["ack_at_once", "asyncssh"]
