"""The fault model of the Daytona emulator: what goes wrong, how often, how hard.

Apart from the server (:mod:`wsync.emulators.daytona`) so the CLI, the demo and tests
can build fault configurations without it.  Probabilities are per request; the server
draws one request's faults from an RNG seeded with ``"{seed}/{request number}"``, so a
schedule replays.  The faults are those of ``docs/backends/daytona.md`` ("Faults handled"):

* ``truncate_result`` — ``result`` cut to a random prefix, exit code untouched (the
  merged, unbounded buffer is cut somewhere on the way; the client cannot tell);
  ``result_cap`` cuts every ``result`` past that many bytes, for a deterministic table;
* ``early_timeout`` — the process group is killed part-way and the answer is HTTP 408
  with the output discarded (daytonaio/daytona#5144);
* ``bad_gateway`` — the proxy answers 502, before the command runs or after it ran
  (daytonaio/daytona#3425);
* ``minus_one`` — ``exitCode: -1`` whatever happened, sometimes with an empty
  ``result`` too (daytonaio/daytona#2283);
* ``late_partial`` — the answer comes ``late_delay`` seconds late with part of the
  output, as when a reaped child's pipes are abandoned after the daemon's hang timeout;
* ``short_download`` — a file-download body cut short: the connection closes before
  the declared ``Content-Length`` (``cut``), or the headers declare the short length
  (``short``), so only a ``Content-Range`` check can tell;
* ``range_support`` — False: the file API ignores ``Range`` and sends the whole file
  (the other reading of an inferred fact);
* ``start_delay`` — the first ``slow_starts`` executes (counted from the emulator's
  start; not drawn) start their shell that many seconds after the request arrived (a
  busy daemon): a kill sent meanwhile runs first and finds nothing, and the command
  starts after it.

Lossy UTF-8 and merged stderr are not faults: the daemon always does that.
"""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True, slots=True)
class DaytonaFaults:
    """Which faults fire, how often (probabilities per request) and how hard."""

    seed: int = 0
    truncate_result: float = 0.0
    #: every ``result`` longer than this is cut to it (None: no cap)
    result_cap: int | None = None
    early_timeout: float = 0.0
    #: an early timeout kills the command after a uniform delay in [0, this] seconds
    early_timeout_max: float = 0.3
    bad_gateway: float = 0.0
    minus_one: float = 0.0
    late_partial: float = 0.0
    late_delay: float = 0.5
    short_download: float = 0.0
    range_support: bool = True
    start_delay: float = 0.0
    slow_starts: int = 1

    @classmethod
    def off(cls) -> DaytonaFaults:
        return cls()

    @classmethod
    def all_on(cls, seed: int = 0) -> DaytonaFaults:
        """Every fault at a rate a pull meets many times, yet can still outrun."""
        return cls(
            seed=seed,
            truncate_result=0.08,
            early_timeout=0.04,
            bad_gateway=0.06,
            minus_one=0.1,
            late_partial=0.03,
            late_delay=0.3,
            short_download=0.2,
        )

    @classmethod
    def report_table(cls) -> DaytonaFaults:
        """Deterministic: every ``result`` is cut after 6 MiB, exit code kept.

        ``wsync doctor``'s table then shows both losses: random bytes come back as lossy
        text (about twice as long, never intact), and the 4 MiB row is cut short; wsync's
        base64 read of 4 MiB still fits under the cap.
        """
        return cls(result_cap=6 * 1024 * 1024)

    def plan(self, rng: random.Random) -> RequestPlan:
        def hit(p: float) -> bool:
            return p > 0 and rng.random() < p

        gateway = None
        if hit(self.bad_gateway):
            gateway = "before" if rng.random() < 0.5 else "after"
        download = None
        if hit(self.short_download):
            download = "cut" if rng.random() < 0.5 else "short"
        return RequestPlan(
            truncate=hit(self.truncate_result),
            early_timeout=rng.uniform(0, self.early_timeout_max)
            if hit(self.early_timeout)
            else None,
            bad_gateway=gateway,
            minus_one=hit(self.minus_one),
            minus_one_empty=rng.random() < 0.3,
            late_partial=hit(self.late_partial),
            short_download=download,
            rng=rng,
        )


@dataclasses.dataclass(slots=True)
class RequestPlan:
    """The faults drawn for one request."""

    truncate: bool
    early_timeout: float | None
    bad_gateway: str | None
    minus_one: bool
    minus_one_empty: bool
    late_partial: bool
    short_download: str | None
    rng: random.Random
