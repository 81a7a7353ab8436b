"""Decisions without I/O: how big the next read is, how long to back off.

Backends that lose bytes tend to lose them above some size (a 64 KiB
pre-attach ring, a frame limit) and more under load.  So the read size grows
while reads succeed and halves on every detected loss, within
[``BLOCK``, chunk size]; retries wait with capped exponential backoff and full
jitter so that parallel readers do not retry in lock-step.
"""

from __future__ import annotations

import random

from wsync.protocol.scripts import BLOCK


class ReadSizer:
    """Adaptive read size, shared by all readers of one pull."""

    def __init__(self, maximum: int, start: int = 1024 * 1024, minimum: int = BLOCK) -> None:
        self.minimum = minimum
        self.maximum = max(minimum, maximum)
        self.size = self._clamp(start)

    def _clamp(self, size: int) -> int:
        size = max(self.minimum, min(self.maximum, size))
        return size - size % BLOCK or BLOCK

    def success(self) -> None:
        self.size = self._clamp(self.size * 2)

    def loss(self) -> None:
        self.size = self._clamp(self.size // 2)


def backoff(attempt: int, *, base: float = 0.05, cap: float = 2.0, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based): full jitter."""
    ceiling = min(cap, base * (2 ** min(attempt, 16)))
    return rng.uniform(0, ceiling)
