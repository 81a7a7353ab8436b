"""The fault model of the Kubernetes emulator (``backends.md`` section 5.4).

Kept apart from the server so the CLI, demo, bench and tests can build fault
configurations without it.  Probabilities are per exec; :meth:`K8sFaults.plan` draws one
exec's faults from an RNG the server seeds with ``"{seed}/{exec number}"`` (replayable).

* ``drop_tail`` — the stream ends before the last stdout bytes are delivered, and the
  Status still says Success (kubectl#1361, kubernetes#60140: the last 10-40 MB of a
  ``kubectl cp``);
* ``early_success`` — ``Success`` is sent after the first stdout flush while the process
  still runs, and the socket closes (kata-containers#13640); ``stdinless_early_success``
  does it to every exec that requested no stdin, as the kata shim does;
* ``bad_exit`` — the exit code cause does not parse (``256``, ``-1``, ``abc``, none);
* ``stall`` — the output stops for ``stall_seconds`` part-way;
* ``internal_error`` — ``InternalError`` for a command that succeeded;
* ``no_status`` — the socket closes normally with no Status at all;
* ``sever`` — the TCP connection is aborted part-way;
* ``split_frames`` — output is cut into small messages at random points;
* ``start_delay`` — the first ``slow_starts`` execs (counted from the emulator's start;
  not drawn) start their process that many seconds after the upgrade was answered.
"""

from __future__ import annotations

import dataclasses
import random

KiB = 1024
#: ExitCode cause messages client-go cannot parse (None: no cause at all)
BAD_CODES: tuple[str | None, ...] = ("256", "-1", "abc", "", "1.0", " 0", None)


@dataclasses.dataclass(frozen=True, slots=True)
class K8sFaults:
    """Which faults fire, how often (probabilities per exec) and how hard."""

    seed: int = 0
    drop_tail: float = 0.0
    #: a dropped tail is drop_tail_min .. drop_tail_max bytes (never more than the output)
    drop_tail_min: int = 1
    drop_tail_max: int = 256 * KiB
    #: only outputs longer than this lose their tail (large copies, kubectl#1361)
    drop_tail_over: int = 0
    early_success: float = 0.0
    #: kata-containers#13640 exactly: *every* exec that did not request stdin gets Success
    #: after its first stdout flush (requesting stdin is the documented workaround)
    stdinless_early_success: bool = False
    bad_exit: float = 0.0
    stall: float = 0.0
    stall_seconds: float = 1.0
    internal_error: float = 0.0
    no_status: float = 0.0
    sever: float = 0.0
    sever_max_bytes: int = 256 * KiB
    split_frames: float = 0.0
    start_delay: float = 0.0
    slow_starts: int = 1

    @classmethod
    def off(cls) -> K8sFaults:
        return cls()

    @classmethod
    def field_report(cls, seed: int = 0) -> K8sFaults:
        """The field's faults at rates that make every pull meet several of them."""
        return cls(
            seed=seed,
            drop_tail=0.2,
            early_success=0.1,
            bad_exit=0.1,
            internal_error=0.1,
            no_status=0.05,
            split_frames=0.3,
        )

    @classmethod
    def all_on(cls, seed: int = 0) -> K8sFaults:
        """Every fault, stalls and severed connections included."""
        return dataclasses.replace(
            cls.field_report(seed), stall=0.05, stall_seconds=0.5, sever=0.05
        )

    @classmethod
    def kata(cls) -> K8sFaults:
        """Deterministic kata-containers#13640: stdin-less execs end after one flush."""
        return cls(stdinless_early_success=True)

    @classmethod
    def tail_loss(cls) -> K8sFaults:
        """Deterministic: every stdout over 1 MiB loses its last 64 KiB, and the Status
        says Success (the shape of kubectl#1361, scaled down)."""
        return cls(
            drop_tail=1.0, drop_tail_min=64 * KiB, drop_tail_max=64 * KiB, drop_tail_over=1024 * KiB
        )

    def plan(self, rng: random.Random) -> ExecPlan:
        def hit(p: float) -> bool:
            return p > 0 and rng.random() < p

        return ExecPlan(
            drop_tail=rng.randint(
                max(self.drop_tail_min, 1), max(self.drop_tail_max, self.drop_tail_min, 1)
            )
            if hit(self.drop_tail)
            else 0,
            early_success=hit(self.early_success),
            bad_exit=rng.choice(BAD_CODES) if hit(self.bad_exit) else False,
            stall=self.stall_seconds if hit(self.stall) else 0.0,
            internal_error=hit(self.internal_error),
            no_status=hit(self.no_status),
            sever_after=rng.randint(0, self.sever_max_bytes) if hit(self.sever) else None,
            split=hit(self.split_frames),
            rng=rng,
        )


@dataclasses.dataclass(slots=True)
class ExecPlan:
    """The faults drawn for one exec."""

    drop_tail: int
    early_success: bool
    #: False: off; else the bad ExitCode cause message to send (None: no cause at all)
    bad_exit: str | bool | None
    stall: float
    internal_error: bool
    no_status: bool
    sever_after: int | None
    split: bool
    rng: random.Random
