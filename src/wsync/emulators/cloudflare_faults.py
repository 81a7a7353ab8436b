"""The fault model of the Cloudflare Bridge emulator: what goes wrong, how often, how hard.

Every fault is one seen in the field or derived from the SDK's source
(``docs/backends/cloudflare.md``; issue numbers of cloudflare/sandbox-sdk):

* ``early_exit`` (#873, the seed report): the stream ends with a made-up
  ``exit {"exit_code":0}`` after some output while the process keeps running;
  everything it prints later is lost;
* ``zero_exit`` (#287 + the Bridge's ``exitCode ?? 0``): the real exit code is
  replaced by 0 (a ``complete`` without ``exitCode``, or ``null``);
* ``line_mode``: session-mode framing for an exec that asked for none: one event
  per line with ``"\\n"`` appended (even to a final line that had none), NULs dropped;
* ``drop_long_lines``: a line longer than ``long_line_bytes`` is cut after its
  first write and the rest silently dropped (the session poller's race);
* ``lose_tail``: output still unlabelled when the 5 s labeler wait ends is lost,
  the exit code is real;
* ``hang`` (#101, #320): the stream stops sending (before the headers, or after
  some output) and never ends;
* ``unavailable``: 503 before the stream (container starting; also for
  ``starting_for`` seconds after the emulator starts);
* ``sever``: the TCP connection is cut mid-event, without an exit event;
* ``no_exit``: the stream ends cleanly with no exit event;
* ``error_event``: an ``error`` event (``exec_transport_error``) mid-stream;
* ``split``: events are written in small random pieces (parser robustness);
* ``file_truncate``/``file_short``: file-API bodies cut short (with the full
  ``Content-Length``, or with none and a clean close); ``file_unavailable``: 503.
* ``idle_close`` (#101, #911): a stream quiet this many seconds is closed without
  an exit event.

Probabilities are per request, drawn by :meth:`CloudflareFaults.plan` from an RNG the
server seeds with ``"{seed}/{request number}"``, so a schedule replays.
"""

from __future__ import annotations

import dataclasses
import random

KiB = 1024


@dataclasses.dataclass(frozen=True, slots=True)
class CloudflareFaults:
    """Which faults fire, how often (per request) and how hard."""

    seed: int = 0
    early_exit: float = 0.0
    zero_exit: float = 0.0
    line_mode: float = 0.0
    drop_long_lines: float = 0.0
    long_line_bytes: int = 4 * KiB
    lose_tail: float = 0.0
    hang: float = 0.0
    unavailable: float = 0.0
    #: every request gets 503 for this long after the emulator starts
    starting_for: float = 0.0
    sever: float = 0.0
    no_exit: float = 0.0
    error_event: float = 0.0
    split: float = 0.0
    #: stream faults fire after a uniform number of output bytes in [0, this]
    max_fault_bytes: int = 256 * KiB
    #: the made-up exit comes after at least this many bytes
    early_exit_min_bytes: int = 0
    #: or, when set, once a stream has been open this many seconds (a "long" command)
    early_exit_after: float | None = None
    file_truncate: float = 0.0
    file_short: float = 0.0
    file_unavailable: float = 0.0
    #: close a stream with no event for this many seconds (the real ones: 255 s, 300 s)
    idle_close: float | None = None

    @classmethod
    def off(cls) -> CloudflareFaults:
        return cls()

    @classmethod
    def all_on(cls, seed: int = 0) -> CloudflareFaults:
        """Every fault, each firing several times in a pull of a few MB.

        The destructive ones (a made-up exit, a severed or failed stream, a lost tail)
        together hit about one exec in five; hangs are rarer because the real stream
        has no heartbeat: silence cannot be told from a quiet command, so a client
        abandons a hang only at a deadline (wsync's learnt one: seconds).
        """
        return cls(
            seed=seed,
            early_exit=0.08,
            zero_exit=0.2,
            line_mode=0.3,
            drop_long_lines=0.3,
            lose_tail=0.05,
            hang=0.01,
            unavailable=0.1,
            sever=0.05,
            no_exit=0.1,
            error_event=0.03,
            split=0.3,
            file_truncate=0.2,
            file_short=0.2,
            file_unavailable=0.1,
        )

    @classmethod
    def seed_report(cls, after: float = 0.5) -> CloudflareFaults:
        """Deterministic #873: a stream open ``after`` seconds ends with a made-up exit 0.

        The report: long-lived commands (minutes, JSONL output) hit it, short ones
        almost never; so the trigger is time, and wsync's short reads mostly pass.
        """
        return cls(early_exit=1.0, early_exit_after=after)

    @classmethod
    def cut_at(cls, nbytes: int) -> CloudflareFaults:
        """Every stream ends with a made-up exit 0 after ``nbytes`` of output."""
        return cls(early_exit=1.0, early_exit_min_bytes=nbytes, max_fault_bytes=nbytes)

    def plan(self, rng: random.Random) -> ExecPlan:
        def hit(p: float) -> bool:
            return p > 0 and rng.random() < p

        def at(low: int = 0) -> int:
            return rng.randint(min(low, self.max_fault_bytes), self.max_fault_bytes)

        hang = hit(self.hang)
        early = hit(self.early_exit)
        timed = early and self.early_exit_after is not None
        return ExecPlan(
            early_exit_at=at(self.early_exit_min_bytes) if early and not timed else None,
            early_exit_after=self.early_exit_after if timed else None,
            zero_exit=hit(self.zero_exit),
            line_mode=hit(self.line_mode),
            drop_long_lines=hit(self.drop_long_lines),
            lose_tail=hit(self.lose_tail),
            hang_before_headers=hang and rng.random() < 0.3,
            hang_at=at() if hang else None,
            unavailable=hit(self.unavailable),
            sever_at=at() if hit(self.sever) else None,
            no_exit=hit(self.no_exit),
            error_at=at() if hit(self.error_event) else None,
            split=hit(self.split),
            file_truncate=hit(self.file_truncate),
            file_short=hit(self.file_short),
            file_unavailable=hit(self.file_unavailable),
            rng=rng,
        )


@dataclasses.dataclass(slots=True)
class ExecPlan:
    """The faults drawn for one request."""

    early_exit_at: int | None
    early_exit_after: float | None
    zero_exit: bool
    line_mode: bool
    drop_long_lines: bool
    lose_tail: bool
    hang_before_headers: bool
    hang_at: int | None
    unavailable: bool
    sever_at: int | None
    no_exit: bool
    error_at: int | None
    split: bool
    file_truncate: bool
    file_short: bool
    file_unavailable: bool
    rng: random.Random
