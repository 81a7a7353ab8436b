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
    """Adaptive read size, shared by all readers of one pull.

    Doubles on success up to a ceiling; a loss halves the size and lowers the
    ceiling to it.  The ceiling is probed upwards again only after
    ``patience`` clean reads, so a backend that always loses above some size
    costs one failed read per ``patience`` reads, not one in two.
    """

    def __init__(
        self, maximum: int, start: int = 1024 * 1024, minimum: int = BLOCK, patience: int = 32
    ) -> None:
        self.minimum = minimum
        self.maximum = max(minimum, maximum)
        self.patience = patience
        self.ceiling = self.maximum
        self.size = self._clamp(start)
        self._clean = 0

    def _clamp(self, size: int) -> int:
        size = max(self.minimum, min(self.ceiling, size))
        return size - size % BLOCK or BLOCK

    def success(self) -> None:
        self._clean += 1
        if self._clean >= self.patience and self.ceiling < self.maximum:
            self.ceiling = min(self.maximum, self.ceiling * 2)
            self._clean = 0
        self.size = self._clamp(self.size * 2)

    def loss(self) -> None:
        self._clean = 0
        self.ceiling = max(self.minimum, self.size // 2)
        self.size = self._clamp(self.size // 2)


def backoff(attempt: int, *, base: float = 0.05, cap: float = 2.0, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based): full jitter."""
    ceiling = min(cap, base * (2 ** min(attempt, 16)))
    return rng.uniform(0, ceiling)
