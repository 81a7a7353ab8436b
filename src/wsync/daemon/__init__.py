"""The wsync daemon: a host service and sidecar that keeps workspaces pulled.

Layers, thinnest first: :mod:`~wsync.daemon.server` (process, signals,
sd_notify), :mod:`~wsync.daemon.api` (HTTP), :mod:`~wsync.daemon.jobs`
(scheduler and runner over the engine), :mod:`~wsync.daemon.store` (SQLite),
:mod:`~wsync.daemon.config`, :mod:`~wsync.daemon.metrics`,
:mod:`~wsync.daemon.logs`; :mod:`~wsync.daemon.client` is the CLI side of the
API (``wsync status``, ``wsync jobs``).  See docs/daemon.md.
"""

from __future__ import annotations

import signal
import threading

#: a SIGHUP that came before the daemon's loop took the signal over
_HELD = threading.Event()


def hold_sighup() -> None:
    """Until the daemon's event loop takes SIGHUP over, remember one instead of dying of
    it: its default action ends the process, and importing the server, loading the
    config, taking the state lock and binding the socket take a second, in which a
    supervisor's reload right after a (re)start killed the daemon without a word.
    Called by the entry points before they import the server."""
    signal.signal(signal.SIGHUP, lambda _signum, _frame: _HELD.set())


def sighup_held() -> bool:
    """A SIGHUP came while it was held (the daemon reloads once it can)."""
    return _HELD.is_set()
