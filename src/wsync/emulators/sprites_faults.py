"""The fault model of the Sprites emulator: what can go wrong, how often, how hard.

Kept apart from the server (:mod:`wsync.emulators.sprites`) so the CLI, the
demo and tests can build and print fault configurations without the server,
and so every fault's knob is documented in one place.  Probabilities are per
exec; :meth:`SpritesFaults.plan` draws one exec's faults from an RNG that the
server seeds with ``"{seed}/{exec number}"``, so a schedule can be replayed.
"""

from __future__ import annotations

import dataclasses
import random

KiB = 1024
MiB = 1024 * KiB


@dataclasses.dataclass(frozen=True, slots=True)
class SpritesFaults:
    """Which faults fire, how often (probabilities per exec) and how hard."""

    seed: int = 0
    ring: bool = False
    ring_bytes: int = 64 * KiB
    #: (min, max) seconds before the client attaches; None: deterministic attach
    attach_delay: tuple[float, float] | None = (0.05, 0.2)
    #: attach once this much output was produced before attach (None: never by size)
    attach_after_bytes: int | None = None
    merge_stderr: float = 0.0
    data_after_exit: float = 0.0
    no_exit_frame: float = 0.0
    zero_frames: float = 0.0
    #: a command is "fast" (eligible for zero frames) if it finishes within this
    fast_threshold: float = 0.25
    sever: float = 0.0
    #: severed execs are cut after a uniform number of bytes in [0, sever_max_bytes]
    sever_max_bytes: int = 256 * KiB
    split_frames: float = 0.0
    json_exit: float = 0.0
    linger: float = 0.0

    @classmethod
    def off(cls) -> SpritesFaults:
        return cls()

    @classmethod
    def field_report(cls, seed: int = 0) -> SpritesFaults:
        """The report's fault mix at realistic rates (timing-dependent attach)."""
        return cls(
            seed=seed,
            ring=True,
            merge_stderr=0.3,
            data_after_exit=0.3,
            no_exit_frame=0.15,
            zero_frames=0.3,
            split_frames=0.3,
            json_exit=0.1,
        )

    @classmethod
    def all_on(cls, seed: int = 0) -> SpritesFaults:
        """Every fault, severed connections included."""
        return dataclasses.replace(cls.field_report(seed), sever=0.1)

    @classmethod
    def report_table(cls) -> SpritesFaults:
        """Deterministic ring only: a fast ``cat`` is attached at exit or after 2 MiB."""
        return cls(ring=True, attach_delay=None, attach_after_bytes=2 * MiB)

    def plan(self, rng: random.Random) -> ExecPlan:
        def hit(p: float) -> bool:
            return p > 0 and rng.random() < p

        delay = None
        if self.ring and self.attach_delay is not None:
            delay = rng.uniform(*self.attach_delay)
        return ExecPlan(
            ring=self.ring,
            attach_delay=delay,
            merged=hit(self.merge_stderr),
            after_exit=hit(self.data_after_exit),
            no_exit=hit(self.no_exit_frame),
            zero_frames=hit(self.zero_frames),
            sever_after=rng.randint(0, self.sever_max_bytes) if hit(self.sever) else None,
            split=hit(self.split_frames),
            json_exit=hit(self.json_exit),
            rng=rng,
        )


@dataclasses.dataclass(slots=True)
class ExecPlan:
    """The faults drawn for one exec."""

    ring: bool
    attach_delay: float | None
    merged: bool
    after_exit: bool
    no_exit: bool
    zero_frames: bool
    sever_after: int | None
    split: bool
    json_exit: bool
    rng: random.Random
