"""What a pull shows while it runs: a live status line on a terminal, one line per
phase elsewhere, and byte formatting.

The engine calls back with :class:`~wsync.engine.api.Progress` when something
happens, which can be seconds apart (a hanging exec, a resume whose chunks are all
on disk).  So the terminal line is not drawn from the callback: rich's
:class:`~rich.live.Live` redraws it on its own timer from the latest snapshot, and
the rate is taken over a moving window, so both keep moving while no event comes.
The line is cut to the terminal's width at every redraw (a line that wraps turns
every redraw into a new line); fields are dropped by priority rather than cut in
the middle.  When stderr is not a terminal there are no redraws at all: a log gets
one plain line per phase change.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import time
from collections.abc import Iterable
from typing import Protocol, TextIO

from wsync.engine.api import Progress, human_bytes

#: redraws per second of the live line (the issue asks for at least one)
REFRESH_PER_SECOND = 4
#: the rate is the bytes fetched over (at most) this many recent seconds
RATE_WINDOW_S = 5.0
#: a rate over less than this is noise: none is shown
_RATE_MIN_SPAN_S = 0.5
_SEP = "  "


def human_pair(done: float, total: float) -> str:
    """``1.5/4.0 MiB``: the unit once when both figures share it."""
    a, b = human_bytes(done), human_bytes(total)
    unit = b.rpartition(" ")[2]
    return f"{a.rpartition(' ')[0]}/{b}" if a.endswith(" " + unit) else f"{a}/{b}"


def plural(n: int, word: str, many: str = "") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def describe_faults(faults: dict[str, int], limit: int = 3) -> str:
    """``hang 5, head-loss 2, +1 more`` — the most frequent fault kinds first."""
    ranked = sorted(((n, kind) for kind, n in faults.items() if n), reverse=True)
    text = ", ".join(f"{kind} {n}" for n, kind in ranked[:limit])
    return text + (f", +{len(ranked) - limit} more" if len(ranked) > limit else "")


class RateWindow:
    """Bytes per second over the last ``window`` seconds (not the average since start).

    Fed a (time, total) sample at every event and read at every redraw, so a stall
    shows as a rate that falls to zero instead of a frozen figure.
    """

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, total: int) -> None:
        if self.samples and total < self.samples[-1][1]:
            self.samples.clear()  # a restarted snapshot: the count began again
        self.samples.append((now, total))
        # keep one sample at or before the window's start, to measure from
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window:
            self.samples.popleft()

    def rate(self, now: float) -> float | None:
        """Bytes per second over ``[now - window, now]`` (linear between samples), or
        None while there is too little history to say."""
        if not self.samples or now - self.samples[0][0] < _RATE_MIN_SPAN_S:
            return None
        start = max(now - self.window, self.samples[0][0])
        prev_t, prev_total = self.samples[0]
        base = float(prev_total)
        for t, total in self.samples:
            if t > start:  # start lies between the previous sample and this one
                base = prev_total + (total - prev_total) * (start - prev_t) / (t - prev_t)
                break
            prev_t, prev_total = t, total
            base = float(total)
        return max(self.samples[-1][1] - base, 0) / max(now - start, 1e-6)


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    """One piece of the status line; lower ``priority`` survives a narrow terminal."""

    text: str
    priority: int
    style: str = ""


def status_fields(p: Progress, rate: float | None, elapsed: float) -> list[Field]:
    """The status line's pieces, in display order."""
    fields = [Field(f"{p.phase:<7}", 0, "bold")]
    # what DEST will have of the archive; the rate counts only what this run fetched
    have = p.bytes_fetched + p.bytes_resumed
    if p.archive_bytes:
        pct = min(100 * have / p.archive_bytes, 100.0)
        fields.append(Field(human_pair(have, p.archive_bytes), 0))
        fields.append(Field(f"{int(pct):3d}%", 2))
    else:
        fields.append(Field(human_bytes(have), 0))
        if p.archive_produced:
            fields.append(Field(f"(guest made {human_bytes(p.archive_produced)})", 5))
    if rate is not None:
        fields.append(Field(f"{human_bytes(rate)}/s", 2))
    fields.append(Field(plural(p.files, "file"), 1))
    # retries matter once there are some; "0 retries" goes first when space is short
    fields.append(Field(plural(p.retries, "retry", "retries"), 1 if p.retries else 4))
    if p.faults:
        fields.append(Field(f"({describe_faults(p.faults)})", 5))
    total = p.chunks_total if p.chunks_total is not None else "?"
    fields.append(Field(f"chunks {p.chunks_done}/{total}", 4))
    if p.resumed_chunks:  # a resume: chunks on disk from the run before, not fetched
        fields.append(Field(f"{p.resumed_chunks} resumed", 1))
    if p.archive_bytes and rate and have < p.archive_bytes:
        fields.append(Field(f"ETA {_clock((p.archive_bytes - have) / rate)}", 3))
    fields.append(Field(_clock(elapsed), 3))
    return fields


def fit(fields: Iterable[Field], width: int) -> list[Field]:
    """The fields that fit in ``width`` columns, most important first, in display order."""
    items = list(fields)
    keep: set[int] = set()
    used = 0
    for i in sorted(range(len(items)), key=lambda i: (items[i].priority, i)):
        need = len(items[i].text) + (len(_SEP) if keep else 0)
        if used + need <= width:
            keep.add(i)
            used += need
    return [items[i] for i in sorted(keep)]


def terminal_width(stream: TextIO, default: int = 80) -> int:
    """Columns of the terminal behind ``stream``, asked again at each redraw (resizes)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or default
    except (OSError, ValueError, AttributeError):
        return default


class Display(Protocol):
    """What shows progress: called with each snapshot, closed at the end."""

    def __call__(self, p: Progress) -> None: ...

    def close(self) -> None: ...


class PhaseLines:
    """Progress for a log (stderr not a terminal): one plain line per phase change,
    no carriage returns, no colours.  The first phase is not a change: a pull that
    fails while probing prints its error alone."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self.phase: str | None = None

    def __call__(self, p: Progress) -> None:
        if p.phase == self.phase:
            return
        old, self.phase = self.phase, p.phase
        if old is None:
            return
        elapsed = time.monotonic() - self.started
        size = human_bytes(p.bytes_fetched) + (
            f"/{human_bytes(p.archive_bytes)}" if p.archive_bytes else ""
        )
        retries = plural(p.retries, "retry", "retries")
        faults = f" ({describe_faults(p.faults)})" if p.faults else ""
        self.stream.write(
            f"wsync: {old} -> {p.phase}  {elapsed:.1f}s  {size}  "
            f"{plural(p.files, 'file')}  {retries}{faults}\n"
        )
        self.stream.flush()

    def close(self) -> None:
        """Nothing to erase: every line written is final."""


def progress_display(stream: TextIO, *, enabled: bool = True) -> Display | None:
    """The display for ``stream``: a live line on a capable terminal, phase lines on
    anything else, none when disabled (``--no-progress``, ``--json``).  rich is loaded
    only for the live line (it is 10-20 ms of every run that imports it)."""
    if not enabled:
        return None
    isatty = getattr(stream, "isatty", None)
    dumb = os.environ.get("TERM", "").lower() in ("dumb", "unknown")
    if isatty is not None and isatty() and not dumb:
        from wsync.liveline import LiveLine

        return LiveLine(stream)
    return PhaseLines(stream)
