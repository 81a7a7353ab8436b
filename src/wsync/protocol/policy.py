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

    Losses that depend on size (a 64 KiB pre-attach ring, a frame limit) repeat
    at that size every time; random losses do not.  So a loss halves the read
    size only when the previous read was lost too; then the ceiling drops to
    the new size and is probed upwards again only after ``patience`` clean
    reads.  A backend that always loses above some size costs about one failed
    read per ``patience`` reads; random faults do not shrink reads at all.
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
        self._lost = 0

    def _clamp(self, size: int) -> int:
        size = max(self.minimum, min(self.ceiling, size))
        return size - size % BLOCK or BLOCK

    def success(self) -> None:
        self._lost = 0
        self._clean += 1
        if self._clean >= self.patience and self.ceiling < self.maximum:
            self.ceiling = min(self.maximum, self.ceiling * 2)
            self._clean = 0
        self.size = self._clamp(self.size * 2)

    def loss(self) -> None:
        """A read came back damaged in a way a smaller read might avoid."""
        self._lost += 1
        self._clean = 0
        if self._lost >= 2:
            self.ceiling = max(self.minimum, self.size // 2)
            self.size = self._clamp(self.size // 2)


#: faults a smaller read may avoid (the others say nothing about size)
SIZE_FAULTS = frozenset({"no-envelope", "truncated", "trailer-mismatch", "oversize"})


def backoff(attempt: int, *, base: float = 0.05, cap: float = 2.0, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based): full jitter."""
    ceiling = min(cap, base * (2 ** min(attempt, 16)))
    return rng.uniform(0, ceiling)
