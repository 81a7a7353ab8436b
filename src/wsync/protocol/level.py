"""The compression level: chosen from how fast the link carried this guest's reads.

Theory of operation
-------------------
The guest compresses the archive as it writes it, and the host reads it back over the
link; the pull takes as long as the slower of the two.  On a fast link (loopback, a
LAN) the guest's compressor is the bottleneck and ``zstd -1`` finishes sooner than
``-3``; on a slow one every byte saved is time saved, and ``-9`` sends an eighth less
than ``-3``.  Measured on the Python standard library (250 MB; 48.4 MB at
``-3 --long=25``, 42.4 MB at ``-9``), DEST on tmpfs: loopback 2.42-2.63 s at ``-1``
against 2.64-3.03 s at ``-3``; through a 20 Mbit/s proxy, single runs, 22.0 s at
``-3``, 21.2 s at ``-9``, 19.4 s at ``-12``.  Auto stops at ``-9``: zstd's memory grows
with the level, per worker (``-T0``: one per guest core), from 18 MiB at ``-3`` to
33 MiB at ``-9`` and 69 MiB at ``-12``, and a sandbox's memory is often capped.

The level must be fixed when the producer starts (one zstd process keeps its window
across the whole stream; cutting the stream into frames at other levels cost 5-16%
more bytes), so it is chosen from what was measured *before* the archive's admission:

1. this run's reads so far, when they carried at least :data:`TRUSTED` bytes (a huge
   manifest: several reads in flight, like a pull's chunk reads);
2. else the rate remembered for this link from an earlier pull that read that much
   (any DEST);
3. else this run's reads when they carried at least :data:`SAMPLE` bytes (a small
   manifest: one or two reads).  Their time is mostly round trips, so the rate comes as
   two bounds: counted whole it under-rates the link, with the round trip taken off (see
   below) it over-rates it.  The level leaves :data:`DEFAULT` only where both bounds
   agree: a link slow even by the fast bound gets the fast bound's level, one fast even
   by the slow bound the slow bound's;
4. else :data:`DEFAULT`.

The manifest run itself is always compressed at :data:`DEFAULT`: the no-op shortcut of
an unchanged re-pull compares its compressed stream's digest with the last one's.

The rate is the link's: read bytes over the time at least one read was in flight (a
union of intervals), so four reads sharing a link do not each count a quarter of it,
and time spent waiting for the guest to produce a chunk is not counted at all.  That
rate, counted whole, is what is remembered and reported.  But each busy span starts
with one round trip in which no byte flows (the request, the guest's shell, the first
byte back), which for one or two reads is most of the time: counted whole, one manifest
read on an HTTP exec backend (100 ms a call) rates a 50 MB/s link at 1.6 MB/s, which
would compress at ``-9`` what ``-1`` sends sooner.  The session's fastest call with a
small answer costs at least one round trip, and more where its guest work is heavier
than a read's, so taking it off every read (where no other read was flowing)
over-rates the link instead: the same read through a 100 Mbit/s loopback proxy (13 ms
of transfer beside a 10-15 ms round trip) came out at 30 MB/s, and ``-1`` was 20%
slower there than ``-3``.  Hence the two bounds of rule 3.

The key of a link is the transport's description: the host (and user and port) for
``ssh://``, the sandbox itself for the cloud backends.

Nothing here does I/O: :class:`LinkMeter` is fed timestamps, and the remembered rates
are parsed from and rendered to bytes (:mod:`wsync.engine.linkmemo` stores them).
"""

from __future__ import annotations

import json
import math

#: the level of a pull that knows nothing about its link (zstd's own default)
DEFAULT = 3
#: bytes a run's reads must carry before their rate says anything
SAMPLE = 64 * 1024
#: bytes after which a run's own rate is preferred to a remembered one, and after which a
#: pull's rate is remembered (fewer measure round trips more than the link)
TRUSTED = 16 * 1024 * 1024
#: zstd's levels without ``--ultra``
LEVELS = range(1, 20)
#: (at least this many bytes per second, level), fastest link first: about the highest
#: level whose output the guest still makes at twice the link's rate, so that a guest
#: with fewer or busier cores keeps up too, rounded toward the faster levels (zstd
#: ``-T0 --long=25`` on two cores, output of a source tree: ``-1`` ~67 MB/s, ``-3`` ~48,
#: ``-6`` ~21, ``-9`` ~17); never above ``-9`` (memory, see the module docstring)
LADDER = ((24e6, 1), (10e6, 3), (4e6, 6), (0.0, 9))
#: gzip's levels stop at 9
GZIP_MAX = 9
#: the least share of a busy span counted as flowing whatever the latency (a rate can
#: come out at most 50 times the raw one: "very fast" is all that is meant then)
MIN_FLOWING = 0.02
#: links remembered at most (the oldest go first)
REMEMBERED = 256
#: reads whose times the meter keeps for :meth:`LinkMeter.rate` with a latency (a
#: level is chosen from a few reads; past this many, one round trip a span is taken off)
MAX_READS = 4096


def level_for(rate: float | None) -> int:
    """The level for a link that carries ``rate`` bytes per second (None: unknown)."""
    if rate is None or not math.isfinite(rate) or rate <= 0:
        return DEFAULT
    return next(level for floor, level in LADDER if rate >= floor)


def choose(
    run_bytes: int,
    run_rate: float | None,
    remembered: float | None,
    *,
    run_ceiling: float | None = None,
) -> int:
    """The level for the next producer run (see the module docstring for the order).

    ``run_rate`` is this run's rate counted whole (for a few reads, an under-estimate);
    ``run_ceiling`` the same with each read's round trip taken off (an over-estimate;
    None: take ``run_rate``).
    """
    if run_rate is not None and run_bytes >= TRUSTED:
        return level_for(run_rate)
    if remembered is not None:
        return level_for(remembered)
    if run_rate is not None and run_bytes >= SAMPLE:
        fast = level_for(run_ceiling if run_ceiling is not None else run_rate)
        return min(max(DEFAULT, fast), level_for(run_rate))
    return DEFAULT


def parse_level(text: str) -> int | None:
    """``auto`` (None) or a zstd level 1-19; anything else is a ValueError."""
    if text.strip().lower() == "auto":
        return None
    level = int(text)
    if level not in LEVELS:
        raise ValueError(f"compression level {level} is not auto or 1-19")
    return level


class LinkMeter:
    """Bytes read over the time at least one read was in flight.

    Only whole busy spans count: the bytes of reads that ended while others are still
    in flight wait with their span, so :attr:`bytes` and the busy time always match.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self._busy = 0.0
        self._in_flight = 0
        self._since = 0.0
        self._pending = 0
        self._spans = 0
        #: seconds of the link as one read alone would have had them: each second
        #: counts 1/n while n reads are in flight (a read's share of the link)
        self._virtual = 0.0
        self._virtual_at = 0.0
        #: (began, ended) of the reads of finished spans, and of the span in flight
        self._reads: list[tuple[float, float]] = []
        self._span_reads: list[tuple[float | None, float]] = []
        self._kept = True

    def _advance(self, now: float) -> None:
        if self._in_flight > 0:
            self._virtual += max(0.0, now - self._virtual_at) / self._in_flight
        self._virtual_at = now

    def virtual(self, now: float) -> float:
        """The link's share clock: a read's time alone is its difference over its life."""
        self._advance(now)
        return self._virtual

    @property
    def in_flight(self) -> int:
        """Reads begun and not yet ended: they share the link."""
        return self._in_flight

    def begin(self, now: float) -> None:
        self._advance(now)
        if self._in_flight == 0:
            self._since = now
        self._in_flight += 1

    def end(self, now: float, nbytes: int, began: float | None = None) -> None:
        """A read that began (at ``began``; None: with its span) ends, having carried
        ``nbytes`` (0 if it failed)."""
        if self._in_flight <= 0:
            raise ValueError("a read ended that never began")
        self._advance(now)
        self._in_flight -= 1
        self._pending += nbytes
        self._span_reads.append((began, now))
        if self._in_flight == 0:
            reads = self._span_reads
            self._busy += max(0.0, now - self._since)
            self.bytes += self._pending
            self._pending = 0
            self._spans += 1
            if self._kept and len(self._reads) + len(self._span_reads) <= MAX_READS:
                since = self._since
                self._reads += [(since if b is None else max(b, since), e) for b, e in reads]
            else:  # too many to keep: one round trip a span from now on
                self._kept, self._reads = False, []
            self._span_reads = []

    def rate(self, latency: float = 0.0) -> float | None:
        """Bytes per second over the busy time so far, with the first ``latency`` seconds
        of every read left out where no other read was flowing then (but at least
        :data:`MIN_FLOWING` of the busy time is counted); None before :data:`SAMPLE` bytes.

        Why per read, not per span: reads issued one after another as the guest indexes
        chunks overlap by a moment, and make one span of several round trips (a 0.5 s
        round trip, two reads: a span of 1 s, half of it taken off, rated a fast link
        slow by both bounds on a loaded CI machine)."""
        if self.bytes < SAMPLE or self._busy <= 0:
            return None
        latency = max(0.0, latency)
        if latency and self._kept:
            flowing = _union(sorted((b + latency, e) for b, e in self._reads if b + latency < e))
        else:
            flowing = self._busy - self._spans * latency
        return self.bytes / max(flowing, self._busy * MIN_FLOWING)


def _union(intervals: list[tuple[float, float]]) -> float:
    """The time covered by sorted ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def parse_links(data: bytes) -> dict[str, tuple[float, float]]:
    """Remembered links, ``{key: (rate, when)}``; anything unreadable is forgotten."""
    try:
        doc = json.loads(data)
        links = doc["links"] if doc.get("version") == 1 else {}
        out: dict[str, tuple[float, float]] = {}
        for key, entry in links.items():
            rate, when = float(entry["rate"]), float(entry["at"])
            if isinstance(key, str) and math.isfinite(rate) and rate > 0 and math.isfinite(when):
                out[key] = (rate, when)
        return out
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
        return {}


def render_links(links: dict[str, tuple[float, float]]) -> bytes:
    """The newest :data:`REMEMBERED` links as the file's JSON."""
    newest = sorted(links.items(), key=lambda kv: kv[1][1], reverse=True)[:REMEMBERED]
    doc = {
        "version": 1,
        "links": {key: {"rate": round(rate), "at": round(when)} for key, (rate, when) in newest},
    }
    return json.dumps(doc, sort_keys=True).encode() + b"\n"
