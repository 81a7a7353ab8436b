"""The confined extractor against real archives (GNU tar, busybox tar, tarfile-built hostile ones).

Every test writes real files under ``tmp_path``: the extraction root sits two levels deep so
that an escape via ``..`` would land in a directory the test watches (``outside`` snapshot).
Parsing the stream itself (headers, truncation, trailers) is tested in ``test_tarstream.py``.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extract_helpers import (
    DIR,
    LIMITS,
    LNK,
    SYM,
    T0,
    build,
    extract,
    gnu_tar,
    make_root,
    member,
    outside,
    restore_writable,
    small_archive,
    snapshot,
)
from wsync.engine.api import ExtractLimits, GiB, MiB
from wsync.engine.extract import extract_tar_stream
from wsync.errors import DiskLow, HostileArchive, HostIOError, LimitExceeded, WsyncError

# -- helpers ------------------------------------------------------------------------------------


def make_tree(src: Path) -> None:
    """A realistic workspace with everything the extractor must keep exactly."""
    src.mkdir()
    (src / "README.md").write_text("hello\n")
    (src / "bin").mkdir()
    run = src / "bin" / "run.sh"
    run.write_text("#!/bin/sh\necho hi\n")
    run.chmod(0o755)
    (src / "bin" / "ro.txt").write_text("read only\n")
    (src / "bin" / "ro.txt").chmod(0o444)
    (src / "empty").mkdir()
    (src / "empty" / "nested-empty").mkdir()
    (src / "big.bin").write_bytes(os.urandom(3 * MiB + 123))
    (src / "zero").write_bytes(b"")
    os.link(src / "README.md", src / "bin" / "hardlink-to-readme")
    os.symlink("README.md", src / "link-to-readme")
    os.symlink("../link-to-readme", src / "bin" / "chain")  # chain: bin/chain -> link -> file
    os.symlink("bin", src / "link-to-dir")
    os.symlink(".", src / "empty" / "self")
    os.symlink("dangling-but-inside", src / "dangling")
    odd = os.fsencode(src) + b"/odd"
    os.mkdir(odd)
    for name in (b"caf\xe9-latin1", b"new\nline", b"-leading-dash", b"sp ace s", "ünï".encode()):
        with open(odd + b"/" + name, "wb") as f:
            f.write(name * 3)
    long_name = "x" * 150 + ".txt"
    (src / "odd" / long_name).write_text("long\n")
    deep = src / "deep"
    for i in range(60):  # deeper than the extractor's fd window
        deep = deep / f"d{i}"
        deep.mkdir(parents=True)
        if i % 20 == 0:
            (deep / "f").write_text(str(i))
    (src / "deep" / "top.txt").write_text("after the deep chain\n")
    ro = src / "readonly"
    ro.mkdir()
    (ro / "inner").mkdir()
    (ro / "inner" / "file").write_text("in a read-only dir\n")
    # Fixed, distinct mtimes, children before parents; read-only dirs last.
    for n, (dirpath, dirnames, filenames) in enumerate(os.walk(src, topdown=False)):
        for k, name in enumerate(sorted(filenames + dirnames)):
            os.utime(Path(dirpath) / name, (T0, T0 + 1000 * n + k), follow_symlinks=False)
        os.utime(dirpath, (T0, T0 + 1000 * n + 999))
    (ro / "inner").chmod(0o500)
    ro.chmod(0o555)
    src.chmod(0o750)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path)


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "producer",
    [
        pytest.param(lambda src: gnu_tar(src), id="gnu"),
        pytest.param(lambda src: gnu_tar(src, "--format=posix"), id="gnu-posix"),
        pytest.param(
            lambda src: (
                subprocess.run(
                    ["busybox", "tar", "-cf", "-", "-C", str(src), "."],
                    check=True,
                    capture_output=True,
                ).stdout
            ),
            id="busybox",
        ),
    ],
)
def test_round_trip_matches_source(
    tmp_path: Path, root: Path, producer: Callable[[Path], bytes]
) -> None:
    src = tmp_path / "src"
    make_tree(src)
    try:
        stats = extract(producer(src), root)
        want = snapshot(src)
        assert snapshot(root) == want
        kinds = [(v[0], k == v[-1]) for k, v in want.items()]
        assert stats.files == kinds.count(("file", True))
        assert stats.hardlinks == kinds.count(("file", False)) == 1
        assert stats.symlinks == sum(1 for v in want.values() if v[0] == "link") == 5
        assert stats.dirs == sum(1 for v in want.values() if v[0] == "dir") - 1
        sizes = {p.stat().st_ino: p.stat().st_size for p in src.rglob("*") if p.is_file()}
        assert stats.bytes == sum(sizes.values())
    finally:
        restore_writable(root)
        restore_writable(src)


def test_posix_format_keeps_nanosecond_mtimes(tmp_path: Path, root: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    os.utime(src / "f", ns=(T0 * 10**9, T0 * 10**9 + 123_456_789))
    os.symlink("f", src / "l")
    os.utime(src / "l", ns=(T0 * 10**9, T0 * 10**9 + 987_654_321), follow_symlinks=False)
    os.utime(src, ns=(T0 * 10**9, T0 * 10**9 + 5))
    extract(gnu_tar(src, "--format=posix"), root)
    assert snapshot(root) == snapshot(src)


# -- hostile archives ---------------------------------------------------------------------------

HOSTILE: dict[str, list[tuple[tarfile.TarInfo, bytes]]] = {
    "dotdot": [member("../sentinel", data=b"pwned")],
    "dotdot-deep": [member("./a", DIR), member("a/../../sentinel", data=b"pwned")],
    "absolute": [member("/etc/wsync-test-pwned", data=b"pwned")],
    "empty-name": [member("", data=b"x")],
    "nul-in-pax-path": [member("ok", data=b"x", pax={"path": "a\x00b"})],
    "symlink-then-write-through": [
        member("d", DIR),
        member("l", SYM, link="d"),
        member("l/x", data=b"through a link"),
    ],
    "symlink-empty": [member("l", SYM, link="")],
    "hardlink-outside": [member("h", LNK, link="../outside/passwd")],
    "hardlink-absolute": [member("h", LNK, link="/etc/passwd")],
    "hardlink-to-symlink": [
        member("f", data=b"x"),
        member("s", SYM, link="f"),
        member("h", LNK, link="s"),
    ],
    "hardlink-to-dir": [member("d", DIR), member("h", LNK, link="d")],
    "hardlink-forward": [member("h", LNK, link="later"), member("later", data=b"x")],
    "hardlink-through-symlink": [
        member("d", DIR),
        member("d/f", data=b"x"),
        member("l", SYM, link="d"),
        member("h", LNK, link="l/f"),
    ],
    "chardev": [member("c", tarfile.CHRTYPE)],
    "blockdev": [member("b", tarfile.BLKTYPE)],
    "fifo": [member("p", tarfile.FIFOTYPE)],
    "unknown-type": [member("v", b"V")],
    "setuid": [member("su", data=b"x", mode=0o4755)],
    "setgid": [member("sg", data=b"x", mode=0o2755)],
    "sticky-file": [member("st", data=b"x", mode=0o1644)],
    "setuid-dir": [member("sd", DIR, mode=0o4755)],
    "dup-file-then-dir": [member("n", data=b"x"), member("n", DIR)],
    "dup-dir-then-symlink": [member("n", DIR), member("n", SYM, link=".")],
    "dup-file-then-file": [member("n", data=b"x"), member("n", data=b"y")],
    "dup-symlink-then-file": [member("n", SYM, link="m"), member("n", data=b"y")],
    "dup-root": [member(".", DIR), member("./", DIR)],
    "parent-missing": [member("nodir/f", data=b"x")],
    "parent-is-file": [member("f", data=b"x"), member("f/g", data=b"y")],
    "huge-pax-header": [member("f", data=b"x", pax={"comment": "c" * (2 * MiB)})],
}


#: the reason each case must be refused for (not some incidental other check)
REASON: dict[str, str] = {
    "absolute": "absolute name",
    "blockdev": "block device",
    "chardev": "character device",
    "dotdot": "'..' component",
    "dotdot-deep": "'..' component",
    "dup-dir-then-symlink": "already exists",
    "dup-file-then-dir": "already exists",
    "dup-file-then-file": "already exists",
    "dup-root": "appears twice",
    "dup-symlink-then-file": "already exists",
    "empty-name": "empty name",
    "fifo": "FIFO",
    "hardlink-absolute": "absolute name",
    "hardlink-forward": "not an earlier regular file",
    "hardlink-outside": "'..' component",
    "hardlink-through-symlink": "not an earlier regular file",
    "hardlink-to-dir": "not an earlier regular file",
    "hardlink-to-symlink": "not an earlier regular file",
    "huge-pax-header": "extended header of",
    "nul-in-pax-path": "NUL byte",
    "parent-is-file": "crosses a symlink",
    "parent-missing": "not an earlier member",
    "setgid": "setgid",
    "setuid": "setuid",
    "setuid-dir": "setuid bit on a directory",
    "sticky-file": "sticky",
    "symlink-empty": "empty target",
    "symlink-then-write-through": "crosses a symlink",
    "unknown-type": "unsupported member type",
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archive_is_refused(root: Path, case: str) -> None:
    fmt = tarfile.PAX_FORMAT if "pax" in case else tarfile.GNU_FORMAT
    before = outside(root)
    with pytest.raises(HostileArchive) as err:
        extract(build(*HOSTILE[case], fmt=fmt), root)
    message = str(err.value)
    assert REASON[case] in message
    assert "\n" not in message
    assert outside(root) == before
    assert not Path("/etc/wsync-test-pwned").exists()
    for dirpath, _dirnames, _filenames in os.walk(root):  # every real directory is inside root
        assert Path(dirpath).resolve().is_relative_to(root.resolve())


def test_refusal_names_the_member_escaped(root: Path) -> None:
    name = "bad\x1b[31m\nname\udcff"
    with pytest.raises(HostileArchive, match=r"bad\\x1b\[31m\\nname\\\\xff"):
        extract(build(member(name, tarfile.FIFOTYPE)), root)


def test_sticky_and_setgid_directories_are_kept(root: Path) -> None:
    extract(build(member("t", DIR, mode=0o1777), member("g", DIR, mode=0o2755)), root)
    assert stat.S_IMODE((root / "t").stat().st_mode) == 0o1777
    assert stat.S_IMODE((root / "g").stat().st_mode) == 0o2755


def test_non_empty_root_is_a_host_error(root: Path) -> None:
    (root / "stray").write_text("x")
    with pytest.raises(HostIOError):
        extract(build(member("f", data=b"x")), root)


# -- limits and bombs ---------------------------------------------------------------------------


class GeneratedStream(io.RawIOBase):
    """A non-seekable reader over a generator of chunks, counting what was read."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._pending = b""
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        while not self._pending:
            self._pending = next(self._chunks, b"")
            if not self._pending:
                return 0
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        self.consumed += n
        return n


def raw_header(info: tarfile.TarInfo) -> bytes:
    return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")


def test_many_empty_files_stop_at_max_files(root: Path) -> None:
    def chunks() -> Iterator[bytes]:
        for i in range(1_000_000):
            yield raw_header(member(f"f{i}")[0])

    stream = GeneratedStream(chunks())
    with pytest.raises(LimitExceeded, match="more than 500 members"):
        extract_tar_stream(stream, root, ExtractLimits(max_files=500, min_free_bytes=0))  # type: ignore[arg-type]
    # no more than the limit (files still pending when it was hit are not created)
    assert 0 < len(os.listdir(root)) <= 500
    assert stream.consumed < 2 * MiB + 501 * 512  # one buffer ahead at most


def test_huge_zero_member_refused_before_writing(root: Path) -> None:
    info = member("bomb")[0]
    info.size = 10**12  # a terabyte of zeros, never materialised

    def chunks() -> Iterator[bytes]:
        yield raw_header(info)
        zeros = bytes(MiB)
        while True:
            yield zeros

    stream = GeneratedStream(chunks())
    limits = ExtractLimits(max_bytes=64 * MiB, min_free_bytes=0)
    with pytest.raises(LimitExceeded, match="bomb"):
        extract_tar_stream(stream, root, limits)  # type: ignore[arg-type]
    assert os.listdir(root) == []
    assert stream.consumed <= MiB


def test_cumulative_bytes_limit(root: Path) -> None:
    data = build(member("a", data=b"a" * 600_000), member("b", data=b"b" * 600_000))
    with pytest.raises(LimitExceeded, match="'b'"):
        extract(data, root, ExtractLimits(max_bytes=1_000_000, min_free_bytes=0))
    assert sorted(os.listdir(root)) == ["a"]


def test_min_free_bytes_refuses_at_start(root: Path) -> None:
    st = os.statvfs(root)
    limits = ExtractLimits(min_free_bytes=st.f_bavail * st.f_frsize + 1024 * GiB)
    with pytest.raises(DiskLow, match="free-space reserve"):
        extract(build(member("f", data=b"x")), root, limits)
    assert os.listdir(root) == []


def test_min_free_bytes_refuses_a_large_file_before_writing(root: Path) -> None:
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    info = member("large")[0]
    info.size = free + 8 * GiB  # more than the disk holds: refused from the header

    def chunks() -> Iterator[bytes]:
        yield raw_header(member("small", data=b"s")[0]) + b"s".ljust(512, b"\0")
        yield raw_header(info)
        while True:
            yield bytes(MiB)

    stream = GeneratedStream(chunks())
    limits = ExtractLimits(min_free_bytes=max(free - GiB, 0), max_bytes=2**62)
    with pytest.raises(DiskLow, match="free-space reserve"):
        extract_tar_stream(stream, root, limits)  # type: ignore[arg-type]
    assert os.listdir(root) == ["small"]


# -- cancellation and fds -----------------------------------------------------------------------


def test_check_cancel_aborts(root: Path) -> None:
    calls = []

    def cancel() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        extract_tar_stream(io.BytesIO(small_archive()), root, LIMITS, check_cancel=cancel)
    assert len(calls) == 3


def test_many_members_keep_fds_bounded(root: Path) -> None:
    """Deep, shallow, deep again: the fd window closes and reopens directories as needed."""
    deep = [f"d{i}" for i in range(120)]
    members = [member("/".join(deep[: i + 1]), DIR) for i in range(120)]
    members += [member("/".join(deep) + "/f", data=b"1"), member("d0/g", data=b"2")]
    members += [member("/".join(deep[:100]) + "/h", data=b"3")]
    before = len(os.listdir("/proc/self/fd"))
    extract(build(*members, fmt=tarfile.PAX_FORMAT), root)
    assert len(os.listdir("/proc/self/fd")) == before
    assert (root.joinpath(*deep[:100]) / "h").read_bytes() == b"3"
    shutil.rmtree(root / "d0")


# -- fuzz ---------------------------------------------------------------------------------------

FUZZ_BASE = build(
    member(".", DIR, mode=0o755),
    member("./d", DIR, mode=0o755),
    member("./d/a", data=b"A" * 1500, mode=0o755),
    member("./d/" + "n" * 120, data=b"long name"),
    member("./d/l", SYM, link="a"),
    member("./d/up", SYM, link="../d/a"),
    member("./h", LNK, link="./d/a"),
    member("./e", DIR, mode=0o555),
    member("./p", data=b"pax", pax={"mtime": "1600000000.5", "path": "./paxname"}),
    fmt=tarfile.PAX_FORMAT,
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(FUZZ_BASE)
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["flip", "byte", "cut", "insert", "zero-block", "copy", "field"]))
        if not data:
            break
        pos = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "field":  # edit a header byte and re-seal its checksum: reaches deeper checks
            start = pos - pos % 512
            block = data[start : start + 512]
            if len(block) == 512 and any(block):
                at = draw(st.sampled_from([0, 1, 2, 100, 101, 102, 103, 124, 135, 156, 157, 345]))
                block[at] = draw(
                    st.sampled_from([0, 0x2E, 0x2F, 0x31, 0x32, 0x33, 0x35, 0x37, 0x80])
                )
                block[148:156] = b"        "
                block[148:156] = b"%06o\0 " % sum(block)
                data[start : start + 512] = block
        elif op == "byte":
            data[pos] = draw(st.sampled_from([0, 0x2E, 0x2F, 0x30, 0x31, 0x32, 0x35, 0x36, 0x78]))
        elif op == "cut":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(max_size=600))
        elif op == "zero-block":
            data[pos - pos % 512 : pos - pos % 512 + 512] = bytes(512)
        else:  # duplicate a header-sized span elsewhere: reused names, repeated headers
            src = draw(st.integers(0, max(len(data) // 512 - 1, 0))) * 512
            data[pos - pos % 512 : pos - pos % 512] = data[src : src + 512]
    return bytes(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_fuzzed_archives_succeed_or_fail_cleanly(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "sentinel").write_text("outside")
        root = base / "stage" / "root"
        root.mkdir(parents=True)
        with contextlib.suppress(WsyncError):  # any other exception type fails the test
            extract(data, root, ExtractLimits(max_files=50, max_bytes=MiB, min_free_bytes=0))
        try:
            assert sorted(os.listdir(base)) == ["sentinel", "stage"]
            assert os.listdir(base / "stage") == ["root"]
            assert (base / "sentinel").read_text() == "outside"
            real_root = root.resolve()
            for dirpath, dirnames, filenames in os.walk(root):
                for name in dirnames + filenames:
                    path = Path(dirpath, name)
                    mode = path.lstat().st_mode
                    assert stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)
                    assert not mode & (stat.S_ISUID | stat.S_ISGID) or stat.S_ISDIR(mode)
                assert Path(dirpath).resolve().is_relative_to(real_root)
        finally:
            restore_writable(root)


def test_links_and_names_that_follow_a_file_still_being_written(root: Path, tmp_path: Path) -> None:
    """Small files are created by writer threads while the reader goes on (see
    wsync.engine.writers): a hardlink right after its target links the written file, a
    member under a file still pending is refused as crossing a non-directory, and a
    second member of a pending file's name is refused whichever is created first."""
    members = [member("d", DIR)]
    for i in range(300):
        data = os.urandom(100 + i)
        members += [member(f"d/f{i}", data=data), member(f"d/h{i}", LNK, link=f"d/f{i}")]
    extract(build(*members), root)
    for i in range(300):
        f, h = root / "d" / f"f{i}", root / "d" / f"h{i}"
        assert f.stat().st_ino == h.stat().st_ino and f.stat().st_size == 100 + i
    for n, (case, reason) in enumerate(
        (
            ([member("f", data=b"x"), member("f/g", data=b"y")], "crosses a symlink or a non-dir"),
            ([member("f", data=b"x"), member("f", data=b"y")], "name already exists"),
            ([member("f", data=b"x"), member("f", DIR)], "name already exists"),
        )
    ):
        (tmp_path / f"case{n}").mkdir()
        fresh = make_root(tmp_path / f"case{n}")
        with pytest.raises(HostileArchive, match=reason):
            extract(build(*case), fresh)
