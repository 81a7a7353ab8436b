"""The compression level (issue 13): chosen from the link's measured speed, pinned with
``--compress-level``, remembered per link; the pure rules, then real pulls over ``local:``."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_exact, local, options, run_pull
from wsync import chaos
from wsync.daemon.config import SandboxConfig, load_config
from wsync.engine import linkmemo
from wsync.errors import StagingFailed, UsageError
from wsync.protocol import level
from wsync.protocol.level import LinkMeter

MB = 1e6
WSYNC = (sys.executable, "-m", "wsync")


# -- the rules ---------------------------------------------------------------------------


def test_the_level_rises_as_the_link_slows() -> None:
    rates = [1e9, 100 * MB, 30 * MB, 24 * MB, 12.5 * MB, 5 * MB, 2.5 * MB, 1 * MB, 1.0]
    levels = [level.level_for(r) for r in rates]
    assert levels == sorted(levels)
    assert levels[0] == 1 and levels[-1] == 9  # never above -9: guest memory
    assert level.level_for(12.5 * MB) == 3  # 100 Mbit/s
    assert level.level_for(2.5 * MB) == 9  # 20 Mbit/s
    for nothing in (None, 0.0, -5.0, math.nan, math.inf):
        assert level.level_for(nothing) == level.DEFAULT


def test_a_big_sample_of_this_run_beats_what_was_remembered() -> None:
    slow, fast = 1 * MB, 100 * MB
    assert level.choose(level.TRUSTED, fast, slow) == level.level_for(fast)
    # a small manifest's one read: the remembered rate (of 4 MiB reads) counts more
    assert level.choose(level.SAMPLE, fast, slow) == level.level_for(slow)
    assert level.choose(level.SAMPLE, fast, None) == level.level_for(fast)
    assert level.choose(level.SAMPLE - 1, fast, None) == level.DEFAULT
    assert level.choose(0, None, None) == level.DEFAULT


@pytest.mark.parametrize(
    ("ceiling", "floor", "expected"),
    [
        (30 * MB, 7 * MB, level.DEFAULT),  # 100 Mbit/s: the bounds disagree
        (1e9, 18 * MB, level.DEFAULT),  # loopback's one manifest read
        (1e9, 1.6 * MB, level.DEFAULT),  # a fast link answering 100 ms late
        (2.7 * MB, 2.2 * MB, 9),  # 20 Mbit/s: slow even by the fast bound
        (5 * MB, 2.2 * MB, 6),  # slow by both: the fast bound's level
        (1e9, 30 * MB, 1),  # fast even by the slow bound
        (30 * MB, 26 * MB, 1),
    ],
)
def test_a_small_sample_leaves_the_default_only_where_both_bounds_agree(
    ceiling: float, floor: float, expected: int
) -> None:
    assert level.choose(level.SAMPLE, floor, None, run_ceiling=ceiling) == expected
    # with a large sample the rate counted whole decides
    big = level.choose(level.TRUSTED, floor, None, run_ceiling=ceiling)
    assert big == level.level_for(floor)


@pytest.mark.parametrize("text", ["auto", "AUTO", " auto "])
def test_auto_is_no_level(text: str) -> None:
    assert level.parse_level(text) is None


@pytest.mark.parametrize("text", ["0", "20", "-3", "x", "", "3.5", "1e1"])
def test_anything_but_auto_or_1_to_19_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        level.parse_level(text)


def test_the_meter_counts_overlapping_reads_once_and_gaps_not_at_all() -> None:
    meter = LinkMeter()
    half = level.SAMPLE // 2
    meter.begin(0.0)
    meter.begin(0.5)  # two reads share the link from 0 to 2 s
    meter.end(1.0, half)
    assert meter.rate() is None  # too few bytes to tell
    meter.end(2.0, half)
    meter.begin(10.0)  # eight idle seconds (waiting for the guest): not the link's
    meter.end(11.0, level.SAMPLE)
    assert meter.rate() == pytest.approx(2 * level.SAMPLE / 3.0)
    with pytest.raises(ValueError):
        meter.end(12.0, 1)


def test_a_read_that_ends_while_others_run_waits_for_its_span() -> None:
    """Bytes count with their busy time: a fast read ending inside a long span must not
    be divided by the time before it alone."""
    meter = LinkMeter()
    meter.begin(0.0)
    meter.begin(0.0)
    meter.end(0.001, 10 * level.SAMPLE)
    assert meter.bytes == 0 and meter.rate() is None
    meter.end(100.0, 0)
    assert meter.rate() == pytest.approx(10 * level.SAMPLE / 100.0)


def test_each_span_loses_one_round_trip_but_never_all_of_it() -> None:
    meter = LinkMeter()
    meter.begin(0.0)
    meter.end(0.1, level.SAMPLE)
    meter.begin(5.0)
    meter.end(5.1, level.SAMPLE)
    assert meter.rate() == pytest.approx(2 * level.SAMPLE / 0.2)
    assert meter.rate(0.09) == pytest.approx(2 * level.SAMPLE / 0.02)
    # a round trip longer than the span: the floor, "very fast"
    assert meter.rate(1.0) == pytest.approx(2 * level.SAMPLE / (0.2 * level.MIN_FLOWING))


def test_reads_that_follow_each_other_each_lose_their_round_trip() -> None:
    """The fresh-clone CI failure of d3b69aa: a 0.5 s round trip, a manifest read as two
    reads of which the second began a moment before the first ended (one span of 1 s).
    Taking one round trip off the span left 0.5 s: 1.5 MB/s for a fast link, and -9.
    Each read's own wait is taken off where no other read was flowing."""
    meter = LinkMeter()
    meter.begin(0.0)
    meter.begin(0.49)
    meter.end(0.5, 4 * level.SAMPLE, 0.0)
    meter.end(0.995, 8 * level.SAMPLE, 0.49)
    assert meter.rate() == pytest.approx(12 * level.SAMPLE / 0.995)
    flowing = 0.025  # [0.49, 0.5] and [0.98, 0.995]: the link carried bytes then
    assert meter.rate(0.49) == pytest.approx(12 * level.SAMPLE / flowing)
    assert level.level_for(meter.rate(0.49)) == 1  # fast, as it is
    # reads in parallel hide each other's waits: only the time all were waiting goes
    meter = LinkMeter()
    for _ in range(4):
        meter.begin(0.0)
    for _ in range(4):
        meter.end(1.0, level.SAMPLE, 0.0)
    assert meter.rate(0.2) == pytest.approx(4 * level.SAMPLE / 0.8)


def test_past_max_reads_the_meter_takes_one_round_trip_a_span() -> None:
    meter = LinkMeter()
    for i in range(level.MAX_READS + 10):
        meter.begin(float(i))
        meter.end(i + 0.5, level.SAMPLE, float(i))
    n = level.MAX_READS + 10
    assert meter.rate(0.1) == pytest.approx(n * level.SAMPLE / (n * 0.4))
    meter.begin(1e6)
    meter.end(1e6 + 0.5, level.SAMPLE, 1e6)  # one more span: the same way, not a fresh list
    assert meter.rate(0.1) == pytest.approx((n + 1) * level.SAMPLE / ((n + 1) * 0.4))


def test_the_share_clock_counts_each_second_once_among_the_reads_in_flight() -> None:
    """A read's time alone on the link: two reads sharing two seconds had one each; a
    read joined halfway by three others had 1 + 1/4 of its two seconds."""
    meter = LinkMeter()
    start = meter.virtual(0.0)
    meter.begin(0.0)
    meter.begin(0.0)
    meter.end(2.0, 1)
    meter.end(2.0, 1)
    assert meter.virtual(2.0) - start == pytest.approx(1.0)
    meter.begin(10.0)
    start = meter.virtual(10.0)
    for _ in range(3):
        meter.begin(11.0)
    assert meter.virtual(12.0) - start == pytest.approx(1.25)
    assert meter.virtual(100.0) - meter.virtual(100.0) == 0.0


def test_a_failed_read_counts_its_time_not_bytes() -> None:
    meter = LinkMeter()
    meter.begin(0.0)
    meter.end(1.0, 0)
    meter.begin(1.0)
    meter.end(2.0, level.SAMPLE)
    assert meter.rate() == pytest.approx(level.SAMPLE / 2.0)


def test_remembered_links_round_trip_and_keep_the_newest() -> None:
    links = {f"ssh://h{i}:22": (float(1000 + i), float(i)) for i in range(level.REMEMBERED + 5)}
    back = level.parse_links(level.render_links(links))
    assert len(back) == level.REMEMBERED
    assert "ssh://h0:22" not in back  # the oldest went
    newest = f"ssh://h{level.REMEMBERED + 4}:22"
    assert back[newest] == links[newest]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe not json",
        b"[]",
        b'{"version": 2, "links": {"k": {"rate": 1, "at": 1}}}',
        b'{"version": 1, "links": []}',
        b'{"version": 1, "links": {"k": {"rate": "fast", "at": 1}}}',
        b'{"version": 1, "links": {"k": {"rate": 1}}}',
        b'{"version": 1, "links": {"k": 5}}',
        b'{"version": 1, "links": {"k": {"rate": 1' + b"0" * 400 + b', "at": 1}}}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_an_unreadable_memory_is_no_memory(data: bytes) -> None:
    assert level.parse_links(data) == {}


def test_impossible_rates_are_forgotten_one_by_one() -> None:
    data = json.dumps(
        {
            "version": 1,
            "links": {
                "bad": {"rate": -1, "at": 1},
                "nan": {"rate": "NaN", "at": 1},
                "good": {"rate": 5e6, "at": 2},
            },
        }
    ).encode()
    assert level.parse_links(data) == {"good": (5e6, 2.0)}


# -- real pulls --------------------------------------------------------------------------


@pytest.fixture
def compressible(tmp_path: Path) -> Path:
    """Text that compresses at every level, differently at each, and 3 MiB of noise
    (over ``TRUSTED`` bytes of reads, so a pull measures its link)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    rng = random.Random(5)
    words = [f"w{rng.randrange(5000)}" for _ in range(400)]
    for i in range(40):
        text = " ".join(rng.choice(words) for _ in range(20000))
        (ws / f"doc{i}.txt").write_text(text)
    (ws / "noise.bin").write_bytes(rng.randbytes(3 * 1024 * 1024))
    return ws


@pytest.fixture
def measured(compressible: Path) -> Path:
    """The same, with enough noise that a pull reads over ``TRUSTED`` bytes: its link's
    rate is remembered."""
    (compressible / "more-noise.bin").write_bytes(random.Random(6).randbytes(level.TRUSTED))
    return compressible


def test_a_pinned_level_is_the_guests_and_every_level_gives_the_same_tree(
    tmp_path: Path, compressible: Path
) -> None:
    sizes = {}
    for pinned in (1, 19):
        dest = tmp_path / f"out{pinned}"
        opts = options(tmp_path, compress_level=pinned, state_dir=tmp_path / f"st{pinned}")
        result = run_pull(local(), compressible, dest, opts)
        assert_exact(compressible, dest)
        assert result.compress_level == pinned
        sizes[pinned] = result.bytes
    assert sizes[19] < sizes[1] * 0.95


def test_gzip_stops_at_9_and_auto_gzip_stays_at_1(tmp_path: Path, compressible: Path) -> None:
    pinned = run_pull(
        local(),
        compressible,
        tmp_path / "out9",
        options(tmp_path, compressor="gzip", compress_level=19, state_dir=tmp_path / "a"),
    )
    auto = run_pull(
        local(),
        compressible,
        tmp_path / "out1",
        options(tmp_path, compressor="gzip", state_dir=tmp_path / "b"),
    )
    assert_exact(compressible, tmp_path / "out9")
    assert_exact(compressible, tmp_path / "out1")
    assert pinned.compress_level == 9 and auto.compress_level == 1
    assert pinned.bytes < auto.bytes


def test_a_fast_link_that_answers_late_is_not_taken_for_a_slow_one(tmp_path: Path) -> None:
    """Every call answers 0.5 s late (an HTTP exec backend's round trip) over a fast
    pipe: the manifest's one read is mostly that wait.  Counted whole it rates the link
    under 0.3 MB/s (-9); with the session's fastest call taken off it is fast; the
    bounds disagree, so the default stays.  (The delay hides each call's own work: with
    0.25 s, a loaded CI machine once took longer than that over the read's, and the
    link looked slow both ways.  And the manifest is 0.7 MB, not 0.1: a fresh-clone CI
    run's read of 107 KB took 22 ms more than the fastest call, 4 MB/s by the fast bound;
    over 0.7 MB the same noise still rates the link fast)"""
    ws = tmp_path / "ws"
    ws.mkdir()
    rng = random.Random(7)
    for _ in range(10_000):  # a manifest of many times SAMPLE bytes, compressed
        (ws / rng.randbytes(60).hex()).write_bytes(b"")
    transport = chaos.wrap(local(), "slow=0.5")
    result = run_pull(transport, ws, tmp_path / "out", options(tmp_path))
    assert_exact(ws, tmp_path / "out")
    # counted whole, the wait rates the link slow by both bounds: -9.  With it taken off
    # the fast bound is whatever the machine moves 0.7 MB at: on a quiet one the default
    # (the bounds disagree); a loaded 2-core CI run once measured 0.93 MB/s and chose -6.
    # Either way the link is not taken for a slow one.
    assert result.compress_level in (level.DEFAULT, 6), result


def test_a_narrow_link_is_taken_for_one_and_compressed_harder(tmp_path: Path) -> None:
    """The other side of the same read: a link that carries 1 MB/s (8 Mbit/s) is slow
    by both bounds, and its archive goes at -9 (and every level gives the tree).  (At
    2.5 MB/s the 110 KB manifest crossed in 45 ms, and a fresh-clone CI run's fastest
    small call took 25 ms longer than the read's own round trip: with that taken off,
    the fast bound came to 6 MB/s, -6.  The manifest is now 0.2 MB, 0.2 s on the link.)"""
    ws = tmp_path / "ws"
    ws.mkdir()
    rng = random.Random(7)
    for _ in range(3000):
        (ws / rng.randbytes(60).hex()).write_bytes(b"")
    plan = chaos.FaultPlan.parse("bw=1000000")
    assert plan.bw == 1_000_000
    result = run_pull(chaos.wrap(local(), plan), ws, tmp_path / "out", options(tmp_path))
    assert_exact(ws, tmp_path / "out")
    assert result.compress_level == 9
    assert 0.2 * MB < result.link_bytes_per_s <= 1.0 * MB


def test_a_small_pull_measures_but_does_not_remember(tmp_path: Path, compressible: Path) -> None:
    result = run_pull(local(), compressible, tmp_path / "out", options(tmp_path))
    assert result.link_bytes_per_s > 0
    assert linkmemo.remembered(tmp_path / "state", "local") is None


def test_auto_remembers_the_link_and_the_next_pull_uses_it(tmp_path: Path, measured: Path) -> None:
    compressible = measured
    state = tmp_path / "state"
    first = run_pull(local(), compressible, tmp_path / "out1", options(tmp_path))
    assert first.link_bytes_per_s > 0
    rate = linkmemo.remembered(state, "local")
    assert rate == pytest.approx(first.link_bytes_per_s, rel=0.01)
    # another DEST, same link: its manifest is one small read, so the memory decides
    second = run_pull(local(), compressible, tmp_path / "out2", options(tmp_path))
    assert second.compress_level == level.level_for(rate)
    assert_exact(compressible, tmp_path / "out2")


def test_a_slow_link_remembered_compresses_harder(tmp_path: Path, measured: Path) -> None:
    compressible = measured
    state = tmp_path / "state"
    linkmemo.remember(state, "local", 1 * MB)
    result = run_pull(local(), compressible, tmp_path / "out", options(tmp_path))
    assert_exact(compressible, tmp_path / "out")
    assert result.compress_level == level.level_for(1 * MB) == 9
    # ... and this pull's own reads (a fast pipe) replace the memory for the next one
    assert linkmemo.remembered(state, "local") == pytest.approx(result.link_bytes_per_s, rel=0.01)


@pytest.mark.parametrize(
    "planted",
    [
        b"\x00garbage",
        b'{"version": 1, "links": {"local": 7}}',
        b'{"version": 1, "links": {"local": {"rate": 1' + b"0" * 400 + b', "at": 1}}}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_a_damaged_memory_is_ignored_and_rewritten(
    tmp_path: Path, measured: Path, planted: bytes
) -> None:
    compressible = measured
    state = tmp_path / "state"
    state.mkdir()
    (state / "links.json").write_bytes(planted)
    result = run_pull(local(), compressible, tmp_path / "out", options(tmp_path))
    assert_exact(compressible, tmp_path / "out")
    assert result.ok and linkmemo.remembered(state, "local") is not None


@pytest.mark.parametrize("pinned", [None, 5])
def test_a_memory_that_cannot_be_written_does_not_fail_the_pull(
    tmp_path: Path, measured: Path, pinned: int | None
) -> None:
    state = tmp_path / "state"
    (state / "links.json").mkdir(parents=True)  # a directory where the file goes
    opts = options(tmp_path, compress_level=pinned)
    result = run_pull(local(), measured, tmp_path / "out", opts)
    assert_exact(measured, tmp_path / "out")
    assert result.ok and result.compress_level > 0
    assert list((state / "pulls").iterdir()) == []  # the journal went: a clean finish


def test_a_fifo_planted_as_the_memory_does_not_hang_the_pull(
    tmp_path: Path, compressible: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.mkfifo(state / "links.json")
    result = run_pull(local(), compressible, tmp_path / "out", options(tmp_path))
    assert_exact(compressible, tmp_path / "out")
    assert result.compress_level == level.DEFAULT


def test_a_level_out_of_range_is_refused_by_the_host_and_by_the_guest(
    tmp_path: Path, compressible: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host validates the level; the producer checks it again before it runs zstd
    with it (it is an argument in a guest script): a host that let 0 through meets it."""
    opts = options(tmp_path, compress_level=0)
    with pytest.raises(UsageError, match="compression level 0"):
        run_pull(local(), compressible, tmp_path / "out", opts)
    monkeypatch.setattr(level, "LEVELS", range(20))
    with pytest.raises(StagingFailed, match="bad compression level"):
        run_pull(local(), compressible, tmp_path / "out", opts)
    assert not (tmp_path / "out").exists()


# -- the interfaces ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["0", "20", "fast"])
def test_the_cli_refuses_a_bad_level_with_one_line(tmp_path: Path, bad: str) -> None:
    proc = subprocess.run(
        [*WSYNC, "pull", f"local:{tmp_path}", str(tmp_path / "out"), "--compress-level", bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--compress-level" in proc.stderr and "not auto or a level 1-19" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_cli_reports_the_level_in_json(tmp_path: Path, compressible: Path) -> None:
    proc = subprocess.run(
        [
            *WSYNC,
            "pull",
            f"local:{compressible}",
            str(tmp_path / "out"),
            *("--compress-level", "7", "--json", "--state-dir", str(tmp_path / "state")),
            *("--staging-dir", str(tmp_path / "staging")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["compress_level"] == 7 and result["link_bytes_per_s"] > 0
    assert_exact(compressible, tmp_path / "out")


def test_the_daemon_config_takes_a_level_per_sandbox(tmp_path: Path) -> None:
    (tmp_path / "roots").mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'dest_roots = ["{tmp_path / "roots"}"]\n'
        f'[sandboxes.pinned]\nuri = "local:{tmp_path}"\ncompress_level = 9\n'
        f'[sandboxes.auto]\nuri = "local:{tmp_path}"\n',
        encoding="utf-8",
    )
    config = load_config(cfg)
    assert config.pull_options(config.sandboxes["pinned"]).compress_level == 9
    assert config.pull_options(config.sandboxes["auto"]).compress_level is None
    assert config.pull_options(None).compress_level is None
    for bad in (0, 20):
        with pytest.raises(ValueError, match="compress_level"):
            SandboxConfig(uri="local:/tmp/x", compress_level=bad)
