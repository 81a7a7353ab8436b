"""Learnt per-call deadlines: a hang costs seconds, a slow but honest backend never fails.

The policy is tested as pure decisions; the engine's use of it through a real guest
(the local transport) under :class:`~wsync.chaos.ChaosTransport`, asserting on the
deadlines each exec was given and on the fault counts, never on wall-clock speed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from helpers import local, make_tree, options
from wsync.chaos import ChaosTransport, FaultPlan
from wsync.engine.api import PullOptions
from wsync.engine.guest import GuestSession
from wsync.engine.guestcall import _COLD, _COLD_STATUS, CallStats
from wsync.protocol.policy import STALL_FLOOR, CallDeadlines
from wsync.transports.base import DEFAULT_MAX_OUTPUT, ExecResult

MiB = 1 << 20
Arm = Callable[[FaultPlan, int], None]


def test_a_kind_gets_the_full_deadline_until_it_has_answered_a_few_times() -> None:
    policy = CallDeadlines(60.0, warmup=3)
    assert policy.deadline("read", 10 * MiB) == 60.0
    for _ in range(2):
        policy.observe("read", MiB, 0.1)
    assert policy.deadline("read", MiB) == 60.0
    assert policy.deadline("admit") == 60.0  # other kinds learn on their own
    policy.observe("read", MiB, 0.1)
    assert policy.deadline("read", MiB) == STALL_FLOOR  # 4 x 0.1 s is under the floor
    assert policy.stalled(policy.deadline("read", MiB))
    assert not policy.stalled(policy.deadline("admit"))


def test_the_deadline_follows_the_slowest_recent_answer_scaled_up_to_the_size() -> None:
    policy = CallDeadlines(60.0, factor=4.0, warmup=1, window=4)
    policy.observe("read", MiB, 1.0)
    assert policy.deadline("read", MiB) == 4.0
    assert policy.deadline("read", 2 * MiB) == 8.0  # twice the bytes, twice the time
    assert policy.deadline("read", 1024) == 4.0  # never scaled down: latency dominates
    policy.observe("read", MiB, 3.0)  # the backend got slower: patience follows at once
    assert policy.deadline("read", MiB) == 12.0
    for _ in range(4):  # and relaxes once the slow answer has left the window
        policy.observe("read", MiB, 1.0)
    assert policy.deadline("read", MiB) == 4.0
    policy.observe("read", 100 * MiB, 100.0)
    assert policy.deadline("read", 100 * MiB) == 60.0  # never above the call deadline


def test_each_stall_doubles_the_patience_up_to_the_call_deadline() -> None:
    policy = CallDeadlines(60.0, warmup=1)
    policy.observe("status", 200, 0.01)
    deadlines = [policy.deadline("status", 0, stalls) for stalls in range(8)]
    assert deadlines[:5] == [2.0, 4.0, 8.0, 16.0, 32.0]
    assert deadlines[5:] == [60.0] * 3
    # the stalls that do not count as attempts are bounded: log2(ceiling / floor) of them
    assert sum(policy.stalled(d) for d in deadlines) == 5


def test_reads_sharing_the_link_each_get_their_share_of_it() -> None:
    policy = CallDeadlines(60.0, factor=4.0, warmup=1)
    policy.observe("read", MiB, 1.0)  # alone on the link
    assert policy.deadline("read", MiB) == 4.0
    assert policy.deadline("read", MiB, shared=4) == 16.0  # four at once: a quarter each
    assert policy.deadline("read", MiB, shared=0) == 4.0  # never below one share
    # a round trip is not shared: 0.5 s of the 1 s once, the rest four times
    assert policy.deadline("read", MiB, shared=4, latency=0.5) == 4.0 * (0.5 + 4 * 0.5)


def test_a_read_gets_the_patience_of_every_read_that_may_share_its_link(
    tmp_path: Path,
) -> None:
    """On a 2 MB/s link three 1 MiB reads alone teach ~0.5 s; the next read's deadline
    counts the four reads (``--parallel 4``) that may share the link with it, even
    when it starts first (a burst of chunks indexed together starts its reads one after
    the other): several times what the same session predicts for a read alone."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "noise.bin").write_bytes(random.Random(4).randbytes(3 * MiB // 2))
    transport = Recording(FaultPlan.parse("bw=2000000"))
    opts = options(tmp_path, parallel=4, helpers=False)

    async def go() -> tuple[float, float]:
        session = GuestSession(transport, opts, CallStats())
        try:
            plan = await session.probe(str(workspace))
            await session.admit("s-share", str(workspace), plan.compressor)
            while (await session.status(wait=1.0)).done is None:
                pass
            for _ in range(4):
                await session.read("data", 0, MiB)
            given = transport.deadlines[-1]
            latency = session.link.latency or 0.0
            alone = session.link.deadlines.deadline("staged", MiB, latency=latency)
            await session.cleanup()
        finally:
            await transport.aclose()
        return given, alone

    given, alone = asyncio.run(go())
    assert alone >= STALL_FLOOR
    assert given >= 2.5 * alone


def test_nonsense_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        CallDeadlines(0)
    with pytest.raises(ValueError):
        CallDeadlines(60, factor=0.5)
    assert CallDeadlines(1.0).floor == 1.0  # a call deadline under the floor wins


class Recording(ChaosTransport):
    """Chaos that also remembers the deadline each exec was given."""

    def __init__(self, plan: FaultPlan) -> None:
        super().__init__(local(), plan)
        self.deadlines: list[float] = []

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        self.deadlines.append(timeout)
        return await super().exec(argv, stdin=stdin, timeout=timeout, max_output=max_output)


async def _status_calls(
    transport: Recording, workspace: Path, opts: PullOptions, n: int, arm: Arm
) -> tuple[CallStats, int]:
    """probe, admit (with the producer's install), then ``n`` status calls: the calls of a
    pull's polling loop.  ``arm(plan, setup)`` sets the faults once the ``setup`` execs
    before the first status call are done.  Returns the stats and ``setup``."""
    stats = CallStats()
    session = GuestSession(transport, opts, stats)
    try:
        plan = await session.probe(str(workspace))
        await session.admit("s-deadlines", str(workspace), plan.compressor)
        setup = transport.plan.calls
        arm(transport.plan, setup)
        for _ in range(n):
            await session.status()
        await session.cleanup()
    finally:
        await transport.aclose()
    return stats, setup


def test_a_hang_is_abandoned_long_before_the_call_deadline(tmp_path: Path) -> None:
    """The fourth status poll hangs for 30 s; the call deadline is 600 s.

    The old engine gave every exec the call deadline, so the hang ran its 30 s and
    counted as a ``timeout``.  Now the status polls have taught the session how long a
    status takes: the hang is abandoned at a deadline of seconds, counted as a
    ``stall`` (not one of the call's attempts), and the retry is twice as patient.
    """
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=3)
    transport = Recording(FaultPlan(hang=30.0))
    opts = options(tmp_path, call_timeout=600.0, max_attempts=1)

    def arm(plan: FaultPlan, setup: int) -> None:
        plan.failure_map = "." * setup + "...W"

    stats, setup = asyncio.run(_status_calls(transport, ws, opts, 6, arm))
    assert transport.plan.applied["W"] == 1
    assert dict(stats.faults) == {"stall": 1}, stats.faults
    # the probe and the first three status polls, while nothing is learnt: their cold
    # deadlines (small, bounded work: a status answers at once on any backend)
    assert transport.deadlines[0] == _COLD["probe"]
    assert transport.deadlines[setup : setup + 3] == [_COLD_STATUS] * 3
    hang, retry = transport.deadlines[setup + 3 : setup + 5]
    assert STALL_FLOOR <= hang <= 60.0  # a tenth of the call deadline at most
    assert retry == min(600.0, 2 * hang)
    assert max(transport.deadlines[setup + 5 : -1]) < 600.0  # later polls: learnt
    assert transport.deadlines[-1] == _COLD["cleanup"]  # run once, never learnt


def test_a_backend_that_turns_slow_is_followed_not_failed(tmp_path: Path) -> None:
    """From the fourth status poll on every exec answers 3 s late, longer than anything
    seen before.

    With one attempt per call, a client that counted its early abandonments as
    attempts would fail the pull; this one stalls, doubles its patience until the
    slow answer fits, learns it, and the next polls wait long enough at once.
    """
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=3)
    transport = Recording(FaultPlan())
    opts = options(tmp_path, call_timeout=600.0, max_attempts=1)

    def arm(plan: FaultPlan, setup: int) -> None:
        plan.slow, plan.slow_from = 3.0, setup + 3

    stats, setup = asyncio.run(_status_calls(transport, ws, opts, 6, arm))
    assert set(stats.faults) <= {"stall"}
    stalls = stats.faults["stall"]
    assert 1 <= stalls <= 2  # 2 s (and 4 s on a slow host) stall; then it fits
    learnt = transport.deadlines[setup + 3 + stalls + 1 : -1]
    assert len(learnt) == 2 and all(12.0 <= d < 600.0 for d in learnt)  # 4 x 3 s


def test_a_silent_first_status_is_a_stall_of_seconds_not_the_call_deadline(
    tmp_path: Path,
) -> None:
    """Issue 13 made status polls few (a long poll) and E2B reads chunks through its file
    API, so the pool of staged calls may never warm up: the very first status poll hangs,
    and it is abandoned at the cold status deadline as a ``stall`` and retried twice as
    patiently, instead of waiting out the 600 s call deadline."""
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=3)
    transport = Recording(FaultPlan(hang=30.0))
    opts = options(tmp_path, call_timeout=600.0, max_attempts=1)

    def arm(plan: FaultPlan, setup: int) -> None:
        plan.failure_map = "." * setup + "W"

    stats, setup = asyncio.run(_status_calls(transport, ws, opts, 2, arm))
    assert transport.plan.applied["W"] == 1
    assert dict(stats.faults) == {"stall": 1}, stats.faults
    assert transport.deadlines[setup : setup + 2] == [_COLD_STATUS, 2 * _COLD_STATUS]


def test_the_cold_deadline_is_only_until_the_kind_is_warm() -> None:
    policy = CallDeadlines(60.0, warmup=2)
    assert policy.deadline("staged", cold=5.0) == 5.0
    assert policy.deadline("staged", stalls=2, cold=5.0) == 20.0
    assert policy.deadline("staged", stalls=9, cold=5.0) == 60.0  # never past the ceiling
    assert policy.deadline("staged") == 60.0  # not a status: the ceiling
    for _ in range(2):
        policy.observe("staged", 100, 0.1)
    assert policy.deadline("staged", cold=5.0) == policy.deadline("staged") < 5.0
