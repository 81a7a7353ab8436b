"""Decisions without I/O: how big the next read is, how long to back off, how long to wait.

Backends that lose bytes tend to lose them above some size (a 64 KiB
pre-attach ring, a frame limit) and more under load.  So the read size grows
while reads succeed and halves on every detected loss, within [a minimum (one
64 KiB block; 16 KiB on text channels), chunk size]; retries wait with capped
exponential backoff and full jitter so that parallel readers do not retry in
lock-step.  A call that stops answering is abandoned after a deadline learnt from
the backend's own recent answers (:class:`CallDeadlines`), not the full call deadline.
"""

from __future__ import annotations

import collections
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

    def ask(self, length: int) -> int:
        """How much of ``length`` bytes one read asks for: the size, or less when the
        read is shorter than the size (a small chunk) and its own size is known bad.

        Only that read goes smaller: a 96 KiB ring eats every read of a 128 KiB chunk
        while the size is 1 MiB, yet a backend that fails fast reads at random (empty
        output from commands done within a moment) must not drag every later read of a
        4 MiB chunk down to many small, fast and failing ones.
        """
        size = min(self.size, length)
        while size > self.minimum and not self.usable(size):
            size = max(self.minimum, bucket(size) // 2)
        return size

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


#: an adaptive deadline is never shorter than this, seconds: a busy host's scheduling,
#: a GC pause or a reconnect must not pass for a hang (and a hang costs this much)
STALL_FLOOR = 2.0
#: an answer smaller than this counts as if this big when its time is scaled up to a
#: bigger call's size: a tiny answer's time is latency, it says little about throughput
#: (a 200-byte status poll taking 0.9 s on a busy host does not mean 4 MiB takes 5 min)
_SCALE_GRAIN = 1024 * 1024


class CallDeadlines:
    """How long one guest call may run before it is abandoned as stalled.

    A backend stream can stop without ending: Cloudflare's SSE has no heartbeat
    (cloudflare/sandbox-sdk#101, #320), so silence looks like a quiet command, and
    waiting out the whole call deadline (60 s) for each such hang made a faulty pull
    several times slower than a clean one.  But wsync's calls of one kind (reads of
    staged bytes, status polls) take a predictable time on one backend.  So once
    ``warmup`` calls of a kind have succeeded, the next gets ``factor`` times the
    slowest of its kind's last ``window`` successes, scaled up (never down) to the
    bytes it expects, and at least ``floor``; before that, and for kinds run once
    (probe, admit, cleanup, which may legitimately take long), it gets ``ceiling``,
    the full call deadline.

    Never failing a pull that a patient client would finish: every success is
    observed, so a slow backend raises the deadlines at once (the maximum, not a
    mean, of recent calls), and a call that stalled is retried with its deadline
    doubled per stall (``stalls``) until it reaches ``ceiling``: a stall below the
    ceiling is not one of the call's attempts (the engine's part), so the attempts
    that end a pull are the same full-deadline ones as without this.

    Reads in flight together share the link, each at its share of the rate: a read's
    sample is the time it would have taken alone (the engine measures it on the link
    meter's share clock, :meth:`wsync.protocol.level.LinkMeter.virtual`), and its
    deadline scales the part of the prediction above one round trip (``latency``: a
    round trip is not shared) by the reads that may share the link with it (the engine
    gives its ``--parallel``: a burst of chunks indexed at once starts its reads one
    after the other).  Without that, the deadline learnt from the first chunks, read
    alone, cut off the 4 MiB reads that four share on a 20 Mbit/s link: two stalls of
    10 s each, retried from the start, in a 20 s pull.
    """

    def __init__(
        self,
        ceiling: float,
        *,
        floor: float = STALL_FLOOR,
        factor: float = 4.0,
        warmup: int = 3,
        window: int = 32,
    ) -> None:
        if ceiling <= 0 or floor <= 0 or factor < 1 or warmup < 1 or window < 1:
            raise ValueError("bad deadline policy")
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self.factor = factor
        self.warmup = warmup
        self.window = window
        self._recent: dict[str, collections.deque[tuple[int, float]]] = {}

    def deadline(
        self,
        kind: str,
        size: int = 0,
        stalls: int = 0,
        cold: float | None = None,
        shared: int = 1,
        latency: float = 0.0,
    ) -> float:
        """Seconds the next call of ``kind`` may take; it expects ``size`` bytes back,
        its earlier attempts stalled ``stalls`` times and ``shared`` calls (itself
        included) share the link with it.  ``cold``: what a call whose time is known to
        be small (a status poll: a few files read, a small answer) gets before its kind
        is warm, doubled per stall, instead of ``ceiling``."""
        recent = self._recent.get(kind)
        if recent is None or len(recent) < self.warmup:
            if cold is not None:
                return min(self.ceiling, cold * 2.0 ** min(stalls, 32))
            return self.ceiling
        alone = max(seconds * max(1.0, size / max(done, _SCALE_GRAIN)) for done, seconds in recent)
        trip = min(max(0.0, latency), alone)
        predicted = trip + max(1, shared) * (alone - trip)
        patience: float = max(self.floor, self.factor * predicted) * 2.0 ** min(stalls, 32)
        return min(self.ceiling, patience)

    def stalled(self, deadline: float) -> bool:
        """A call that ran out of ``deadline`` stalled (retry with more patience) rather
        than timed out (a real attempt used up)."""
        return deadline < self.ceiling

    def observe(self, kind: str, size: int, seconds: float) -> None:
        """A call of ``kind`` succeeded with ``size`` bytes in ``seconds`` (a read's: its
        time alone on the link)."""
        recent = self._recent.get(kind)
        if recent is None:
            recent = self._recent[kind] = collections.deque(maxlen=self.window)
        recent.append((max(size, 0), max(seconds, 0.0)))
