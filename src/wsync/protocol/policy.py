"""Decisions without I/O: how big the next read is, how long to back off.

Backends that lose bytes tend to lose them above some size (a 64 KiB
pre-attach ring, a frame limit) and more under load.  So the read size grows
while reads succeed and halves on every detected loss, within [a minimum (one
64 KiB block; 16 KiB on text channels), chunk size]; retries wait with capped
exponential backoff and full jitter so that parallel readers do not retry in
lock-step.
"""

from __future__ import annotations

import random

from wsync.protocol.scripts import BLOCK

#: granularity of read sizes (a power of two dividing BLOCK)
_GRAIN = 4096
#: smallest read on a text channel, where base64 makes a read 4/3 its size on the wire
MIN_TEXT_READ = 16 * 1024


def bucket(length: int) -> int:
    """The power-of-two size (at least 4 KiB) that a read of ``length`` bytes is judged in."""
    size = _GRAIN
    while size < length:
        size *= 2
    return size


class ReadSizer:
    """Adaptive read size, shared by all readers of one pull.

    Losses that depend on size (a 64 KiB pre-attach ring, a frame limit) hit
    every read above that size; random losses hit reads of any size now and
    then.  So the sizer keeps, per power-of-two size, the balance of reads that
    came back whole against reads that lost their head or tail.  A size is
    left once its losses outnumber its successes by two (random faults rarely
    manage that; a ring does it in two reads), and the next size tried is
    below what those failed reads actually delivered, which for a ring is the
    ring size.  The size grows one doubling per success while the bigger size
    is not known bad.  Balances decay (halve every ``decay`` reads), so a size
    that failed is probed again now and then.
    """

    def __init__(
        self, maximum: int, start: int = 1024 * 1024, minimum: int = BLOCK, decay: int = 64
    ) -> None:
        self.minimum = bucket(minimum)
        self.maximum = max(self.minimum, maximum - maximum % BLOCK)
        self.decay = decay
        self._balance: dict[int, int] = {}  # losses minus successes, per size
        self._delivered: dict[int, int] = {}  # most bytes a lost read of this size got
        self._events = 0
        self.size = max(self.minimum, min(self.maximum, bucket(start)))

    def usable(self, size: int) -> bool:
        size = bucket(size)
        return size <= self.minimum or self._balance.get(size, 0) < 2

    def success(self, length: int) -> None:
        size = bucket(length)
        self._balance[size] = self._balance.get(size, 0) - 1
        self._tick()
        bigger = min(self.maximum, self.size * 2)
        if self.usable(bigger):
            self.size = bigger

    def loss(self, length: int, delivered: int = 0) -> None:
        """A read of ``length`` bytes lost its head or tail; ``delivered`` bytes arrived.

        Corrupted reads deliver all their bytes yet say nothing of a size that works:
        report them with ``delivered=0``, and a size they make unusable drops to the
        minimum and grows back one doubling per success.
        """
        size = bucket(length)
        self._balance[size] = self._balance.get(size, 0) + 1
        self._delivered[size] = max(self._delivered.get(size, 0), delivered)
        self._tick()
        if not self.usable(self.size):
            hint = self.minimum
            while hint * 2 <= self._delivered.get(bucket(self.size), 0):
                hint *= 2
            self.size = max(self.minimum, min(self.size // 2, hint))
            while not self.usable(self.size):
                self.size = max(self.minimum, self.size // 2)

    def _tick(self) -> None:
        self._events += 1
        if self._events % self.decay == 0:
            self._balance = {k: v // 2 if v > 0 else 0 for k, v in self._balance.items()}


#: faults a smaller read may avoid (the others say nothing about size); a hash mismatch
#: is one: a channel that corrupts at a constant rate per byte fails large reads almost
#: always and small ones rarely
SIZE_FAULTS = frozenset(
    {"no-envelope", "truncated", "trailer-mismatch", "oversize", "hash-mismatch"}
)


def backoff(attempt: int, *, base: float = 0.05, cap: float = 2.0, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based): full jitter."""
    ceiling = min(cap, base * (2 ** min(attempt, 16)))
    return rng.uniform(0, ceiling)
