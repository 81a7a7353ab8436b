"""Mtimes of every date survive (issue 7, item 9): after 2262, before 1970, absurd ones clamped.

After 2262 a time no longer fits in 64-bit nanoseconds (what ``os.utime(ns=...)`` takes), so the
extractor sets whole seconds there; before 1970 GNU tar writes base-256 (``--format=gnu``) or a
negative pax record (``--format=posix``); busybox tar writes 0 instead (pinned below, since the
docs say so).  A date is never a reason to refuse a file: a value beyond the host's ``time_t``
is clamped, and the kernel then clamps to what the filesystem stores, as for GNU tar's own
extraction (which instead sets -1 and exits 2).
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from extract_helpers import DIR, SYM, build, extract, gnu_tar, make_root, member, snapshot
from wsync.engine.tarstream import TarReader

NS = 1_000_000_000
Y2263 = 9_246_182_400  # 2263-01-01T00:00:00Z: past 2**63 ns
Y1960 = -315_619_200  # 1960-01-01T00:00:00Z


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path)


def dated_tree(src: Path, *, fraction_ns: int = 0) -> None:
    """A file, a directory, a symlink and the root dated 2263 or 1960 by ``touch -d``."""
    src.mkdir()
    (src / "future").write_text("f")
    (src / "past").write_text("p")
    (src / "dir").mkdir()
    (src / "dir" / "in").write_text("i")
    os.symlink("future", src / "link")
    touch = ["touch", "-h", "-d"]
    subprocess.run([*touch, "2263-01-01 UTC", src / "future", src / "link"], check=True)
    subprocess.run([*touch, "1960-01-01 UTC", src / "past", src / "dir" / "in"], check=True)
    past_ns = Y1960 * NS + fraction_ns
    os.utime(src / "past", ns=(past_ns, past_ns))
    subprocess.run([*touch, "2263-01-01 UTC", src / "dir", src], check=True)


@pytest.mark.parametrize("fmt", [(), ("--format=posix",)], ids=["gnu", "posix"])
def test_gnu_tar_dates_after_2262_and_before_1970_survive(
    tmp_path: Path, root: Path, fmt: tuple[str, ...]
) -> None:
    src = tmp_path / "src"
    dated_tree(src, fraction_ns=500_000_000 if fmt else 0)  # pax keeps the .5 s
    extract(gnu_tar(src, *fmt), root)
    assert snapshot(root) == snapshot(src)
    assert os.stat(root / "future").st_mtime_ns == Y2263 * NS
    assert os.lstat(root / "link").st_mtime_ns == Y2263 * NS
    assert os.stat(root).st_mtime_ns == Y2263 * NS
    assert os.stat(root / "past").st_mtime_ns == Y1960 * NS + (500_000_000 if fmt else 0)


def test_after_2262_the_fraction_is_dropped_whole_seconds_kept(root: Path) -> None:
    data = build(
        member("f", data=b"x", pax={"mtime": f"{Y2263}.75"}),
        member("d", DIR, pax={"mtime": f"{Y2263 + 1}.5"}),
        member("l", SYM, link="f", pax={"mtime": f"{Y2263 + 2}.25"}),
        fmt=tarfile.PAX_FORMAT,
    )
    extract(data, root)
    assert os.stat(root / "f").st_mtime_ns == Y2263 * NS
    assert os.stat(root / "d").st_mtime_ns == (Y2263 + 1) * NS
    assert os.lstat(root / "l").st_mtime_ns == (Y2263 + 2) * NS


def test_busybox_tar_turns_pre_1970_into_zero(tmp_path: Path, root: Path) -> None:
    """What docs/fidelity.md says about busybox guests: the guest's tar loses the date."""
    src = tmp_path / "src"
    dated_tree(src)
    data = subprocess.run(
        ["busybox", "tar", "-cf", "-", "-C", str(src), "."], check=True, capture_output=True
    ).stdout
    extract(data, root)
    assert os.stat(root / "past").st_mtime_ns == 0
    assert os.stat(root / "future").st_mtime_ns == Y2263 * NS


def base256_mtime(name: str, mtime: int) -> bytes:
    """A GNU header whose mtime field is base-256 (``tarfile`` writes it for big values)."""
    info, payload = member(name, data=b"x")
    info.mtime = mtime
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        tf.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def fs_limits(tmp_path: Path) -> tuple[int, int]:
    """The mtimes (s) this filesystem clamps to, found by asking the kernel."""
    probe = tmp_path / "probe"
    probe.write_text("")
    os.utime(probe, (0, 2**63 - 1))
    high = os.stat(probe).st_mtime_ns // NS
    os.utime(probe, (0, -(2**63)))
    low = os.stat(probe).st_mtime_ns // NS
    probe.unlink()
    return low, high


@pytest.mark.parametrize("mtime", [2**70, 2**63, 2**63 - 1, -(2**63) - 1, -(2**70)], ids=str)
def test_absurd_base256_mtimes_are_clamped_not_refused(
    tmp_path: Path, root: Path, mtime: int
) -> None:
    low, high = fs_limits(tmp_path)
    extract(base256_mtime("f", mtime), root)
    assert (root / "f").read_bytes() == b"x"
    assert os.stat(root / "f").st_mtime_ns // NS == (high if mtime > 0 else low)


@pytest.mark.parametrize(
    "value",
    [
        "9" * 40,  # GNU tar: "out of range", sets 0 and exits 2
        "-" + "9" * 40,
        "-315619199.5",  # 1960-01-01 00:00:00.5, the way GNU tar writes it
        "0.000000001",
        "-0.5",
    ],
)
def test_pax_mtimes_of_any_size_are_kept_or_clamped(tmp_path: Path, root: Path, value: str) -> None:
    low, high = fs_limits(tmp_path)
    extract(build(member("f", data=b"x", pax={"mtime": value}), fmt=tarfile.PAX_FORMAT), root)
    got = os.stat(root / "f").st_mtime_ns
    if len(value) > 30:
        assert got // NS == (low if value.startswith("-") else high)
    else:
        whole, _, frac = value.lstrip("-").partition(".")
        want = int(whole) * NS + int(frac.ljust(9, "0"))
        assert got == (-want if value.startswith("-") else want)


def test_reader_returns_exact_negative_pax_time(tmp_path: Path) -> None:
    data = build(member("f", data=b"", pax={"mtime": "-315619199.5"}), fmt=tarfile.PAX_FORMAT)
    reader = TarReader(io.BytesIO(data), lambda _: None)
    try:
        got = reader.next_member()
    finally:
        reader.close()
    assert got is not None
    assert got[5] == -315_619_199_500_000_000
