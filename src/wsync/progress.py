"""A one-line progress display for terminals (stderr), and byte formatting."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from wsync.engine.api import Progress


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


class ProgressLine:
    """Redraws one status line at most ~10 times a second."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self.last = 0.0
        self.width = 0

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        if now - self.last < 0.1 and p.phase not in ("done",):
            return
        self.last = now
        elapsed = max(now - self.started, 1e-6)
        rate = p.bytes_fetched / elapsed
        if p.archive_bytes:
            total = f"/ {human_bytes(p.archive_bytes)}"
            pct = f" {100 * (p.bytes_fetched + 0.0) / p.archive_bytes:3.0f}%"
            left = max(p.archive_bytes - p.bytes_fetched, 0)
            eta = f"  ETA {left / rate:.0f}s" if rate > 0 and left else ""
        else:
            total, pct, eta = f"(guest produced {human_bytes(p.archive_produced)})", "", ""
        chunks = f"{p.chunks_done}/{p.chunks_total if p.chunks_total is not None else '?'}"
        line = (
            f"{p.phase:<7} {human_bytes(p.bytes_fetched)} {total}{pct}  "
            f"{human_bytes(rate)}/s{eta}  chunks {chunks}  retries {p.retries}"
        )
        pad = max(self.width - len(line), 0)
        self.width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0
