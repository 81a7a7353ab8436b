"""The fault model of the E2B envd emulator: what can go wrong, how often, how hard.

Each knob is a field fault listed in ``docs/backends/e2b.md`` ("Faults handled").
Probabilities are per exec (or per file read); :meth:`E2BFaults.plan` draws one call's
faults from an RNG the server seeds with ``"{seed}/{call number}"``, so a failing
schedule replays.
"""

from __future__ import annotations

import dataclasses
import random

KiB = 1024

#: what a login shell's profile scripts print in some templates (``bash -l -c``)
LOGIN_NOISE = (
    b"bash: /home/user/.bashrc: line 12: nvm: command not found\n",
    b"Welcome to E2B sandbox\n\n",
    b"\x1b]0;user@e2b: ~\x07",
)


@dataclasses.dataclass(frozen=True, slots=True)
class E2BFaults:
    """Which faults fire and how often (probabilities per call)."""

    seed: int = 0
    #: the body ends (cleanly, or by a reset) with no end-stream message, after a uniform
    #: number of body bytes in [0, cut_max_bytes]; sometimes inside an envelope
    cut_stream: float = 0.0
    cut_max_bytes: int = 128 * KiB
    #: of the cuts, the share that resets the connection instead of ending the body
    cut_reset_share: float = 0.5
    #: ``start`` and then nothing: no data, no end (infra#3292, E2B#1587)
    silence: float = 0.0
    #: keepalives keep flowing during the silence (the wedged fan-out does not stop them)
    silence_keepalive: bool = False
    #: one data event is dropped, or sent twice (mastra#20773)
    drop_data: float = 0.0
    dup_data: float = 0.0
    #: profile-script noise on stdout before the command's own output
    login_noise: float = 0.0
    #: HTTP 502 before the first frame; of those, the share with the edge's
    #: "sandbox was not found" JSON (the rest are bare ``Bad Gateway``)
    bad_gateway: float = 0.0
    not_found_share: float = 0.5
    #: end-stream ``deadline_exceeded`` after a complete ``end`` event (the race)
    deadline_race: float = 0.0
    #: /files: a shorter (honest) range than asked; a body cut below its Content-Length;
    #: the Range header ignored (200, the whole file)
    file_short: float = 0.0
    file_cut: float = 0.0
    file_ignore_range: float = 0.0
    #: seconds between the process starting and the response's first frame (a busy
    #: edge): a client that gives up in between has no pid, only its start tag
    start_delay: float = 0.0

    @classmethod
    def off(cls) -> E2BFaults:
        return cls()

    @classmethod
    def all_on(cls, seed: int = 0) -> E2BFaults:
        """Every fault at rates a pull must survive in reasonable time."""
        return cls(
            seed=seed,
            cut_stream=0.08,
            silence=0.02,
            drop_data=0.08,
            dup_data=0.08,
            login_noise=0.2,
            bad_gateway=0.05,
            not_found_share=0.3,
            deadline_race=0.04,
            file_short=0.15,
            file_cut=0.15,
            file_ignore_range=0.2,
        )

    @classmethod
    def naive_table(cls) -> E2BFaults:
        """For the naive-client test and doctor: streams often cut, data dropped, noise."""
        return cls(cut_stream=0.5, cut_max_bytes=512 * KiB, drop_data=0.5, login_noise=0.3)

    def plan(self, rng: random.Random) -> ExecPlan:
        def hit(p: float) -> bool:
            return p > 0 and rng.random() < p

        cut = hit(self.cut_stream)
        gateway = hit(self.bad_gateway)
        return ExecPlan(
            bad_gateway=gateway,
            not_found=gateway and rng.random() < self.not_found_share,
            cut_after=rng.randint(0, self.cut_max_bytes) if cut else None,
            cut_reset=cut and rng.random() < self.cut_reset_share,
            silence=hit(self.silence),
            drop_index=rng.randrange(6) if hit(self.drop_data) else None,
            dup_index=rng.randrange(6) if hit(self.dup_data) else None,
            noise=rng.choice(LOGIN_NOISE) if hit(self.login_noise) else None,
            deadline_race=hit(self.deadline_race),
            file_short=hit(self.file_short),
            file_cut=hit(self.file_cut),
            file_ignore_range=hit(self.file_ignore_range),
            rng=rng,
        )


@dataclasses.dataclass(slots=True)
class ExecPlan:
    """The faults drawn for one call."""

    bad_gateway: bool
    not_found: bool
    cut_after: int | None
    cut_reset: bool
    silence: bool
    drop_index: int | None
    dup_index: int | None
    noise: bytes | None
    deadline_race: bool
    file_short: bool
    file_cut: bool
    file_ignore_range: bool
    rng: random.Random
