"""The spare tree (``.NAME.wsync-spare``): after a farm-built pull the old tree, minus what
the new tree does not share, is kept beside DEST (directories, and hard links of DEST's own
inodes), and the next farm starts from it: only what changed is linked, unlinked or made
(on the development VM's disk a mkdir or rmdir costs about 20 links).  Whatever is found
there, the new tree is exactly the guest's, and nothing is followed out of it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from helpers import assert_exact, make_tree, options
from wsync.engine import incstate
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.pull import pull
from wsync.transports.local import LocalTransport


def go(ws: Path, dest: Path, opts: PullOptions) -> PullResult:
    async def run() -> PullResult:
        transport = LocalTransport()
        try:
            return await pull(transport, str(ws), dest, opts)
        finally:
            await transport.aclose()

    result = asyncio.run(run())
    assert result.ok, result.error
    return result


def spare(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.wsync-spare"


def shares_dest(root: Path, dest: Path) -> bool:
    """Every entry of the spare tree is a directory of DEST or DEST's very inode."""
    for p in root.rglob("*"):
        twin = dest / p.relative_to(root)
        if p.is_dir() and not p.is_symlink():
            if not (twin.is_dir() and not twin.is_symlink()):
                return False
        elif not os.path.lexists(twin) or os.lstat(p).st_ino != os.lstat(twin).st_ino:
            return False
    return True


@pytest.fixture
def kept(tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    """A DEST whose last (incremental, changing) pull left a spare tree beside it."""
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=20)
    dest = tmp_path / "dest"
    opts = options(tmp_path)
    go(ws, dest, opts)
    (ws / "src" / "f1.txt").write_text("changed\n")
    assert go(ws, dest, opts).mode == "incremental"
    assert spare(dest).is_dir() and shares_dest(spare(dest), dest)
    assert (spare(dest) / "src" / "deep" / "er" / "est").is_dir()
    assert not (spare(dest) / "src" / "f1.txt").exists()  # the old version is gone
    assert (spare(dest) / "src" / "f2.txt").exists()
    return ws, dest, opts


def test_the_spare_tree_is_reused_and_kept_again(
    kept: tuple[Path, Path, PullOptions],
) -> None:
    ws, dest, opts = kept
    reused = os.stat(spare(dest) / "src" / "deep").st_ino
    kept_file = os.stat(dest / "src" / "f3.txt")
    (ws / "src" / "f2.txt").write_text("changed again\n")
    (ws / "src" / "deep" / "new").mkdir()
    (ws / "src" / "f4.txt").unlink()
    go(ws, dest, opts)
    assert_exact(ws, dest)
    assert os.stat(dest / "src" / "deep").st_ino == reused  # the same directory, not a new one
    again = os.stat(dest / "src" / "f3.txt")  # kept: neither linked nor unlinked this time
    assert (again.st_ino, again.st_ctime_ns) == (kept_file.st_ino, kept_file.st_ctime_ns)
    assert shares_dest(spare(dest), dest)
    assert go(ws, dest, opts).changed_files == 0
    assert go(ws, dest, opts).changed_files == 0


def test_whatever_the_kept_directories_hold_the_tree_is_exact(
    kept: tuple[Path, Path, PullOptions], tmp_path: Path
) -> None:
    ws, dest, opts = kept
    skel = spare(dest)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me\n")
    (skel / "src" / "stray.txt").write_text("not the guest's\n")  # a file
    (skel / "not-in-guest" / "sub").mkdir(parents=True)  # directories the guest lacks
    (skel / "blob.bin").unlink()
    (skel / "blob.bin").mkdir()  # a directory where the guest has a file
    (skel / "src" / "deep" / "escape").symlink_to(outside)  # a way out
    (skel / "empty").chmod(0o500)  # read-only
    os.setxattr(skel / "src", "user.host-only", b"1")
    (skel / "src" / "f5.txt").unlink()  # another file under a kept name
    (skel / "src" / "f5.txt").write_text("not the guest's either\n")
    victim = skel / "src" / "f6.txt"  # DEST's own inode, edited in place, mtime put back
    st = victim.stat()
    with open(victim, "r+b") as f:
        f.write(b"XX")
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    (ws / "src" / "f2.txt").write_text("changed again\n")
    go(ws, dest, opts)
    assert_exact(ws, dest)
    assert sorted(p.name for p in outside.iterdir()) == ["precious"]
    assert (outside / "precious").read_text() == "keep me\n"
    assert "user.host-only" not in os.listxattr(dest / "src")
    assert go(ws, dest, opts).changed_files == 0


@pytest.mark.parametrize("what", ["symlink", "file"])
def test_kept_directories_that_are_not_a_directory_are_not_used(
    kept: tuple[Path, Path, PullOptions], tmp_path: Path, what: str
) -> None:
    ws, dest, opts = kept
    skel = spare(dest)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x").write_text("not ours\n")
    os.rename(skel, tmp_path / "was-skel")
    if what == "symlink":
        skel.symlink_to(elsewhere)
    else:
        skel.write_text("a file\n")
    (ws / "src" / "f2.txt").write_text("changed again\n")
    go(ws, dest, opts)
    assert_exact(ws, dest)
    assert (elsewhere / "x").read_text() == "not ours\n"
    assert skel.is_dir() and not skel.is_symlink() and shares_dest(skel, dest)


def test_a_scan_larger_than_what_it_holds_spills_to_the_database(
    kept: tuple[Path, Path, PullOptions], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DEST's scan during the manifest run keeps HOLD rows in memory; beyond that they go
    to the scratch table as they come (memory stays bounded for a million entries)."""
    ws, dest, opts = kept
    monkeypatch.setattr(incstate, "BATCH", 4)
    monkeypatch.setattr(incstate, "HOLD", 8)
    (ws / "src" / "f2.txt").write_text("changed again\n")
    (dest / "src" / "f3.txt").chmod(0o600)  # and tampered on the host
    result = go(ws, dest, opts)
    assert result.changed_files >= 2
    assert_exact(ws, dest)
    assert go(ws, dest, opts).changed_files == 0
    assert go(ws, dest, opts).changed_files == 0
