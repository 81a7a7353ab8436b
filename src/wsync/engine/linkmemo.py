"""How fast each link carried reads, remembered in the state directory.

The rate only advises the compression level of the next pull over the same link
(:mod:`wsync.protocol.level`), so this file is best effort and never fails a pull:
unreadable means unknown, a write that fails is logged.  Within one process (a daemon
runs many pulls) one lock orders the read-modify-write cycles, so that two pulls ending
together both land; between processes the later write wins.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import structlog

from wsync.engine.fsutil import write_atomic
from wsync.protocol import level

log = structlog.get_logger(__name__)

#: a file bigger than this is not ours to parse
_MAX_FILE = 1 << 20
_lock = threading.Lock()


def _path(state_dir: Path) -> Path:
    return state_dir / "links.json"


def _load(state_dir: Path) -> dict[str, tuple[float, float]]:
    try:
        # O_NONBLOCK: a FIFO planted under the name must not hang the pull
        fd = os.open(_path(state_dir), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        with os.fdopen(fd, "rb", closefd=False) as f:
            return level.parse_links(f.read(_MAX_FILE))
    except OSError:
        return {}
    finally:
        os.close(fd)


def remembered(state_dir: Path, key: str) -> float | None:
    """The rate last measured on link ``key`` (bytes per second), if any."""
    entry = _load(state_dir).get(key)
    return entry[0] if entry else None


def remember(state_dir: Path, key: str, rate: float) -> None:
    """Record ``rate`` for ``key``; a failure to write is logged, never raised."""
    try:
        with _lock:
            state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            links = _load(state_dir)
            links[key] = (rate, time.time())
            write_atomic(_path(state_dir), level.render_links(links))
    except Exception as exc:  # advisory data: nothing here may fail a pull
        log.info("link rate not recorded", error=str(exc))
