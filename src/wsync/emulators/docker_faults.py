"""The fault model of the Docker Engine API emulator: what can go wrong, how often, how hard.

Each knob is a field fault of ``shared/backends.md`` section 4.5.  Probabilities are per
exec start; :meth:`DockerFaults.plan` draws one start's faults from an RNG the server
seeds with ``"{seed}/{call number}"``, so a failing schedule replays.
"""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True, slots=True)
class DockerFaults:
    """Which faults fire and how often (probabilities per exec start)."""

    seed: int = 0
    #: inspect says ``Running: true, ExitCode: null`` for a uniform [0, exit_null_max]
    #: seconds after the stream's EOF (moby#19607, testcontainers-go#3766)
    exit_null: float = 0.0
    exit_null_max: float = 1.5
    #: the last output frame is never sent; the stream then ends cleanly (moby#27289,
    #: #20951, docker/compose#1130)
    drop_final: float = 0.0
    #: the EOF is withheld for ``hold_seconds`` after the command exited, as when a
    #: background child keeps stdout open (moby#33039, #41052)
    hold_eof: float = 0.0
    hold_seconds: float = 3.0
    #: frames are written in pieces, cut inside headers and payloads (split reads)
    split_frames: float = 0.0
    #: the start is answered ``200 OK`` with a raw-stream content type instead of
    #: ``101 UPGRADED`` (a daemon that ignores the upgrade request)
    answer_200: float = 0.0
    #: the first ``slow_starts`` starts (counted from the emulator's start; not drawn)
    #: spawn their process ``start_delay`` seconds after the upgrade was answered (a
    #: daemon busy for a moment): a kill exec sent meanwhile runs first and finds
    #: nothing yet, and the command starts after it
    start_delay: float = 0.0
    slow_starts: int = 1

    @classmethod
    def off(cls) -> DockerFaults:
        return cls()

    @classmethod
    def all_on(cls, seed: int = 0) -> DockerFaults:
        """Every fault at rates a pull must survive in reasonable time."""
        return cls(
            seed=seed,
            exit_null=0.3,
            exit_null_max=1.0,
            drop_final=0.25,
            hold_eof=0.03,
            hold_seconds=3.0,
            split_frames=0.3,
            answer_200=0.3,
        )

    @classmethod
    def naive_table(cls) -> DockerFaults:
        """For the naive-client test and doctor: the final frame often lost, exit codes
        late."""
        return cls(drop_final=0.6, exit_null=0.5, exit_null_max=0.5, split_frames=0.5)

    def plan(self, rng: random.Random) -> StartPlan:
        def hit(p: float) -> bool:
            return p > 0 and rng.random() < p

        null = hit(self.exit_null)
        return StartPlan(
            exit_null_for=rng.uniform(0, self.exit_null_max) if null else None,
            drop_final=hit(self.drop_final),
            hold_for=self.hold_seconds if hit(self.hold_eof) else None,
            split=hit(self.split_frames),
            answer_200=hit(self.answer_200),
            rng=rng,
        )


@dataclasses.dataclass(slots=True)
class StartPlan:
    """The faults drawn for one exec start."""

    exit_null_for: float | None
    drop_final: bool
    hold_for: float | None
    split: bool
    answer_200: bool
    rng: random.Random
