"""What one session has learnt about its link to the guest, and the clock it learns by.

Three things, all fed by the answers of :class:`wsync.engine.guest.GuestSession`'s calls:

- the **read meter** (:class:`wsync.protocol.level.LinkMeter`): bytes over the time at least
  one read was in flight; it picks the next run's compression level and says how many reads
  share the link right now;
- the **round trip**: the fastest call whose answer was small and that did not wait on
  purpose (a long poll), so one round trip at least;
- the **deadlines** (:class:`wsync.protocol.policy.CallDeadlines`) per kind of call, learnt
  from how long answers took: a hang costs seconds, not the whole call deadline.

A read's sample is its time *alone* on the link (the meter's share clock), and its deadline
scales the part of the prediction above one round trip by the reads that may share the
link.  The arithmetic is pure and lives in :mod:`wsync.protocol.level` and
:mod:`wsync.protocol.policy`; this module only holds the state and reads the clock.
"""

from __future__ import annotations

import time

from wsync.protocol.level import LinkMeter
from wsync.protocol.policy import CallDeadlines

#: answers up to this size carry no transfer time worth the name: their call's duration
#: is a round trip (plus the script's own work), what the link's latency is taken from
SMALL_ANSWER = 4096


class Link:
    """The link state of one guest session (see the module docstring)."""

    def __init__(self, call_timeout: float, parallel: int) -> None:
        #: per-kind deadlines learnt from this backend's answers
        self.deadlines = CallDeadlines(call_timeout)
        #: how fast reads came over the link (it picks the next run's compression level)
        self.meter = LinkMeter()
        #: the fastest call of this session with a small answer that did not wait on
        #: purpose, seconds: one round trip at least (see wsync.protocol.level)
        self.latency: float | None = None
        self._parallel = parallel

    def rate(self) -> float | None:
        """The link's rate as this session's reads measured it, counted whole (bytes per
        second; for a few reads, an under-estimate)."""
        return self.meter.rate()

    def ceiling(self) -> float | None:
        """The same with each read's round trip taken off where no other read flowed: an
        over-estimate."""
        return self.meter.rate(self.latency or 0.0)

    def read_deadline(self, kind: str, size: int, stalls: int = 0) -> float:
        """A read's learnt deadline: it may share the link with every read in flight (it
        has begun on the meter) and with all that ``--parallel`` lets join it (a burst of
        newly indexed chunks starts its reads right after the first)."""
        shares = max(self.meter.in_flight, self._parallel)
        return self.deadlines.deadline(
            kind, size, stalls, shared=shares, latency=self.latency or 0.0
        )

    def deadline(
        self, kind: str, size: int, stalls: int, cold: float | None, *, read: bool
    ) -> float:
        """The learnt deadline of one attempt of a call of ``kind`` expecting ``size``
        bytes on the wire (``cold``: the kind's deadline before it has taught one)."""
        if read:
            return self.read_deadline(kind, size, stalls)
        return self.deadlines.deadline(kind, size, stalls, cold)

    def clock(self, at: float, *, read: bool) -> float:
        """Where an attempt starting at ``at`` (monotonic) stands on the clock its sample
        is taken by: the meter's share clock for a read, none for any other call (its own
        duration is its sample)."""
        return self.meter.virtual(at) if read else 0.0

    def answered(
        self,
        kind: str,
        received: int,
        started: float,
        share0: float,
        *,
        read: bool,
        patience: float,
    ) -> None:
        """Learn from an attempt that began at ``started`` (monotonic; ``share0`` on the
        share clock) and brought a verified answer of ``received`` wire bytes; the time it
        waited on purpose (``patience``) is left out of what is learnt."""
        ended = time.monotonic()
        took = ended - started
        alone = self.meter.virtual(ended) - share0 if read else took - patience
        self.deadlines.observe(kind, received, max(0.0, alone))
        small = received <= SMALL_ANSWER
        if small and not patience and (self.latency is None or took < self.latency):
            self.latency = took

    def stalled(self, learnt: float) -> bool:
        """An attempt that ran out of ``learnt`` stalled (rather than timed out) when that
        deadline was shorter than the whole call deadline."""
        return self.deadlines.stalled(learnt)
