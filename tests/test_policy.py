"""Read-size adaptation and backoff: pure decisions, tested directly."""

from __future__ import annotations

import random

from wsync.protocol.policy import ReadSizer, backoff
from wsync.protocol.scripts import BLOCK


def test_read_size_grows_shrinks_and_stays_aligned() -> None:
    sizer = ReadSizer(maximum=4 << 20, start=1 << 20)
    sizer.success()
    assert sizer.size == 2 << 20
    for _ in range(10):
        sizer.success()
    assert sizer.size == 4 << 20
    sizer.loss()
    assert sizer.size == 4 << 20  # one loss may be chance
    for _ in range(20):
        sizer.loss()
    assert sizer.size == BLOCK
    assert sizer.size % BLOCK == 0


def test_a_size_that_keeps_failing_is_not_retried_every_other_read() -> None:
    """Model a backend that loses every read above 96 KiB (a pre-attach ring)."""
    sizer = ReadSizer(maximum=4 << 20, start=1 << 20, patience=32)
    failures = 0
    for _ in range(1000):
        if sizer.size > 96 * 1024:
            failures += 1
            sizer.loss()
        else:
            sizer.success()
    # two losses (one may be chance) per probe after ``patience`` clean reads
    assert failures < 1000 * 2 / 32 + 10


def test_backoff_is_capped_and_jittered() -> None:
    rng = random.Random(1)
    waits = [backoff(attempt, rng=rng) for attempt in range(1, 40)]
    assert all(0 <= w <= 2.0 for w in waits)
    assert len(set(waits)) > 30


def test_random_isolated_losses_do_not_shrink_reads() -> None:
    sizer = ReadSizer(maximum=4 << 20, start=4 << 20)
    rng = random.Random(3)
    for _ in range(1000):
        if rng.random() < 0.1:
            sizer.loss()
            sizer.success()  # the retry succeeded
        else:
            sizer.success()
    assert sizer.size == 4 << 20
