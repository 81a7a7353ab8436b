"""The command line both ssh transports send, and the reaper that stops it.

Shared by :mod:`wsync.transports.ssh` (asyncssh) and :mod:`wsync.transports.openssh`
(OpenSSH's own client), and importing neither library: the OpenSSH transport exists so
that a pull need not import asyncssh at all.

Why a wrapper: OpenSSH ignores channel ``signal`` requests for root logins ("session
signalling requires privilege separation"), and closing a channel does not stop its
command.  So every command runs as ``exec sh -c '"$@"; exit $?' wsync-exec-NONCE
ARGV...``: the wrapper shell is the session leader sshd created, and its command line
carries a per-exec nonce.  On a deadline another exec runs :data:`REAPER`, which finds
the session leader with that nonce in ``/proc`` and SIGKILLs its process group, exactly
what ``local:`` does.  Detached children (``setsid ... &``) are in other groups and
survive, as the guest producer must.  The price: a command killed by a signal reports
``128+N`` (the wrapper's status), as any shell would.
"""

from __future__ import annotations

import asyncio
import secrets
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from wsync.errors import UsageError
from wsync.transports.base import Capabilities, Transport
from wsync.uri import SandboxURI

#: runs ARGV under a wrapper shell whose command line names the exec (see module doc);
#: "; exit $?" stops shells from exec'ing "$@" in place of the wrapper
WRAPPER = '"$@"; exit $?'

#: kills the process group led by the session leader whose argv holds "$1" exactly.
#: Parses /proc/PID/stat with builtins only (comm may hold spaces); skips itself.
REAPER = r"""m=$1
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = "$$" ] && continue
  read -r st 2>/dev/null < "$d/stat" || continue
  set -- ${st##*")"}
  [ "$4" = "$p" ] || continue
  tr '\0' '\n' 2>/dev/null < "$d/cmdline" | grep -qxF "$m" || continue
  kill -s KILL -- "-$p" 2>/dev/null
done
exit 0
"""

#: bound on the reaper exec that runs after a deadline
REAP_TIMEOUT = 10.0
DEFAULT_CONNECT_TIMEOUT = 20.0
DEFAULT_MAX_SESSIONS = 8

#: the ciphers OpenSSH offers by default, AES-GCM first: with AES-NI it runs
#: about twice as fast as chacha20-poly1305 in asyncssh
#: (OpenSSH's own client puts chacha20 first) (measured 395 vs 178
#: MiB/s on loopback), and bulk reads are most of what wsync does
CIPHERS = (
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes128-ctr",
    "aes192-ctr",
    "aes256-ctr",
)


def wrapped(argv: Sequence[str]) -> tuple[str, str]:
    """A fresh marker and the command line that runs ``argv`` under the wrapper shell
    whose argv carries it (what the reaper looks for: see the module docstring)."""
    marker = f"wsync-exec-{secrets.token_hex(12)}"
    command = "exec " + shlex.join(["sh", "-c", WRAPPER, marker, *argv])
    try:
        command.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("exec argv is not valid UTF-8") from None
    return marker, command


def reaper(marker: str) -> str:
    """The command line that kills the process group of the exec named ``marker``."""
    return shlex.join(["sh", "-c", REAPER, "wsync-reap", marker])


def describe(host: str, port: int | None, user: str | None) -> str:
    """``ssh://[user@]host:port``: both clients' description, and so one key for the
    journal, the incremental state and the remembered link whichever client pulls."""
    at = f"{user}@" if user else ""
    return f"ssh://{at}{f'[{host}]' if ':' in host else host}:{port or 22}"


def parse_options(uri: SandboxURI, options: Mapping[str, Any]) -> dict[str, Any]:
    """Both ssh transports' options from an ``ssh://`` URI's: ``ssh_key``, ``known_hosts``,
    ``ssh_config`` (a path, or ``"none"`` to ignore ``~/.ssh/config``),
    ``connect_timeout`` (s), ``max_sessions``; keyword arguments for the constructor."""
    if uri.scheme != "ssh" or not uri.host:
        raise UsageError(f"{uri.raw!r} is not an ssh://[user@]host[:port]/path URI")

    def opt_path(key: str) -> str | None:
        value = options.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str | Path):
            raise UsageError(f"ssh option {key!r} must be a path")
        return str(Path(value).expanduser()) if str(value) != "none" else "none"

    try:
        connect_timeout = float(options.get("connect_timeout") or DEFAULT_CONNECT_TIMEOUT)
        max_sessions = int(options.get("max_sessions") or DEFAULT_MAX_SESSIONS)
    except (TypeError, ValueError):
        raise UsageError("ssh options connect_timeout/max_sessions must be numbers") from None
    return {
        "host": uri.host,
        "port": uri.port,
        "user": uri.user,
        "ssh_key": opt_path("ssh_key"),
        "known_hosts": opt_path("known_hosts"),
        "ssh_config": opt_path("ssh_config"),
        "connect_timeout": connect_timeout,
        "max_sessions": max_sessions,
    }


class SshTransportBase(Transport):
    """What both ssh clients' transports share: the options, the description (one key
    for the journal and the state whichever client pulls) and the session slots (every
    exec and open channel holds one of ``max_sessions``)."""

    scheme = "ssh"
    capabilities = Capabilities(
        stdin=True, binary_safe=True, separate_stderr=True, channel=True, long_argv=True
    )

    def __init__(
        self,
        host: str,
        *,
        port: int | None = None,
        user: str | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        if max_sessions < 1:
            raise UsageError("ssh option max_sessions must be >= 1")
        self.host = host
        self.port = port
        self.user = user
        self._connect_timeout = connect_timeout
        self._max_sessions = max_sessions
        self._slots = asyncio.Semaphore(max_sessions)
        self._lock = asyncio.Lock()
        self._ever_connected = False

    @classmethod
    def from_uri(cls, uri: SandboxURI, options: Mapping[str, Any]) -> Self:
        """Options: see :func:`parse_options`."""
        return cls(**parse_options(uri, options))

    @property
    def description(self) -> str:
        return describe(self.host, self.port, self.user)

    @property
    def channel_limit(self) -> int:
        """Channels hold a ``max_sessions`` slot while open: two are left for execs."""
        return max(0, self._max_sessions - 2)
