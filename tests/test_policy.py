"""Read-size adaptation and backoff: pure decisions, tested directly."""

from __future__ import annotations

import random

from wsync.protocol.policy import ReadSizer, backoff, bucket
from wsync.protocol.scripts import BLOCK

MiB = 1 << 20


def test_buckets_are_powers_of_two_from_4k() -> None:
    assert bucket(1) == 4096
    assert bucket(4097) == 8192
    assert bucket(BLOCK) == BLOCK
    assert bucket(BLOCK + 1) == 2 * BLOCK
    assert bucket(3 * MiB) == 4 * MiB


def test_read_size_grows_on_success_and_stays_aligned() -> None:
    sizer = ReadSizer(maximum=4 * MiB, start=MiB)
    sizer.success(MiB)
    assert sizer.size == 2 * MiB
    for _ in range(10):
        sizer.success(sizer.size)
    assert sizer.size == 4 * MiB


def test_a_size_that_always_fails_is_left_quickly_and_probed_rarely() -> None:
    """Model a backend that loses every read above 96 KiB (a pre-attach ring)."""
    sizer = ReadSizer(maximum=4 * MiB, start=MiB, decay=64)
    failures = reads = 0
    while reads < 1000:
        if sizer.size > 96 * 1024:
            failures += 1
            sizer.loss(sizer.size, delivered=96 * 1024)
        else:
            reads += 1
            sizer.success(sizer.size)
    assert sizer.size <= 96 * 1024
    assert failures < 60  # two failed probes per 64 reads, not one in two


def test_the_first_read_finds_the_ring_size_in_two_failures() -> None:
    sizer = ReadSizer(maximum=4 * MiB, start=MiB)
    sizer.loss(MiB, delivered=64 * 1024 + 100)
    assert sizer.size == MiB  # once may be chance
    sizer.loss(MiB, delivered=64 * 1024 + 100)
    assert sizer.size == 64 * 1024


def test_reads_shorter_than_the_size_go_smaller_when_their_own_size_fails() -> None:
    """Reads of a small chunk ask for less than the sizer's size (128 KiB of 1 MiB): when
    those lose their head to a 96 KiB ring, such reads must go below the ring, or every
    attempt asks for the same failing 128 KiB (seen with growing chunks).  The size
    itself stays: reads of big chunks are not made small by what failed at a small size
    (a backend losing fast reads at random would drag every read down)."""
    sizer = ReadSizer(maximum=4 * MiB, start=MiB)
    assert sizer.ask(128 * 1024) == 128 * 1024
    sizer.loss(128 * 1024, delivered=96 * 1024)
    assert sizer.ask(128 * 1024) == 128 * 1024  # once may be chance
    sizer.loss(128 * 1024, delivered=96 * 1024)
    assert sizer.ask(128 * 1024) == 64 * 1024
    assert sizer.ask(100 * 1024) == 64 * 1024
    assert sizer.size == MiB and sizer.ask(4 * MiB) == MiB
    assert sizer.ask(10_000) == 10_000


def test_random_losses_do_not_shrink_reads() -> None:
    """35% of reads lost at random, at every size: reads stay large."""
    sizer = ReadSizer(maximum=4 * MiB, start=4 * MiB)
    rng = random.Random(3)
    sizes = []
    for _ in range(2000):
        if rng.random() < 0.35:
            sizer.loss(sizer.size)
        else:
            sizer.success(sizer.size)
        sizes.append(sizer.size)
    assert sum(sizes) / len(sizes) > 2 * MiB


def test_backoff_is_capped_and_jittered() -> None:
    rng = random.Random(1)
    waits = [backoff(attempt, rng=rng) for attempt in range(1, 40)]
    assert all(0 <= w <= 2.0 for w in waits)
    assert len(set(waits)) > 30
