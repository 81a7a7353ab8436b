"""The kept directories (``.NAME.wsync-skel``): an incremental pull strips the old tree of
everything but its directories and the next farm starts from them (on the development
VM's disk a mkdir or rmdir costs about 20 times a link).  Whatever is found there, the
new tree is exactly the guest's, and nothing is followed out of it."""

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


def skeleton(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.wsync-skel"


def only_dirs(root: Path) -> bool:
    return all(p.is_dir() and not p.is_symlink() for p in root.rglob("*"))


@pytest.fixture
def kept(tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    """A DEST whose last (incremental, changing) pull left its directories beside it."""
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=20)
    dest = tmp_path / "dest"
    opts = options(tmp_path)
    go(ws, dest, opts)
    (ws / "src" / "f1.txt").write_text("changed\n")
    assert go(ws, dest, opts).mode == "incremental"
    assert skeleton(dest).is_dir() and only_dirs(skeleton(dest))
    assert (skeleton(dest) / "src" / "deep" / "er" / "est").is_dir()
    return ws, dest, opts


def test_the_kept_directories_are_reused_and_kept_again(
    kept: tuple[Path, Path, PullOptions],
) -> None:
    ws, dest, opts = kept
    reused = os.stat(skeleton(dest) / "src" / "deep").st_ino
    (ws / "src" / "f2.txt").write_text("changed again\n")
    (ws / "src" / "deep" / "new").mkdir()
    go(ws, dest, opts)
    assert_exact(ws, dest)
    assert os.stat(dest / "src" / "deep").st_ino == reused  # the same directory, not a new one
    assert only_dirs(skeleton(dest))
    assert go(ws, dest, opts).changed_files == 0


def test_whatever_the_kept_directories_hold_the_tree_is_exact(
    kept: tuple[Path, Path, PullOptions], tmp_path: Path
) -> None:
    ws, dest, opts = kept
    skel = skeleton(dest)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me\n")
    (skel / "src" / "stray.txt").write_text("not the guest's\n")  # a file
    (skel / "not-in-guest" / "sub").mkdir(parents=True)  # directories the guest lacks
    (skel / "blob.bin").mkdir()  # a directory where the guest has a file
    (skel / "src" / "deep" / "escape").symlink_to(outside)  # a way out
    (skel / "empty").chmod(0o500)  # read-only
    os.setxattr(skel / "src", "user.host-only", b"1")
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
    skel = skeleton(dest)
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
    assert skel.is_dir() and not skel.is_symlink() and only_dirs(skel)


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
