"""The hardlink farm and the directory metadata pass, on real trees."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from wsync.engine.farm import CANCEL_EVERY, build_farm, set_dir_meta
from wsync.engine.incdiff import DirMeta
from wsync.errors import HostileArchive, HostIOError, Interrupted


@pytest.fixture
def trees(tmp_path: Path) -> Iterator[tuple[Path, int, Path, int]]:
    dest, tmp = tmp_path / "dest", tmp_path / "tmp"
    dest.mkdir()
    tmp.mkdir()
    dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    tfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    yield dest, dfd, tmp, tfd
    os.close(dfd)
    os.close(tfd)


def test_links_files_and_symlinks_and_makes_dirs(trees: tuple[Path, int, Path, int]) -> None:
    dest, dfd, tmp, tfd = trees
    (dest / "d" / "e").mkdir(parents=True)
    (dest / "d" / "e" / "f.txt").write_text("x")
    (dest / "top").write_text("t")
    (dest / "d" / "abs").symlink_to("/etc/passwd")
    (dest / "d" / "dangling").symlink_to("nowhere")
    keep = [
        (b"d", "d"),
        (b"d/abs", "l"),
        (b"d/dangling", "l"),
        (b"d/e", "d"),
        (b"d/e/f.txt", "f"),
        (b"newdir", "d"),
        (b"top", "f"),
    ]
    assert build_farm(dfd, tfd, keep, lambda: None) == 7
    assert os.stat(tmp / "top").st_ino == os.stat(dest / "top").st_ino
    assert os.stat(tmp / "d/e/f.txt").st_ino == os.stat(dest / "d/e/f.txt").st_ino
    assert os.readlink(tmp / "d" / "abs") == "/etc/passwd"
    assert os.lstat(tmp / "d" / "abs").st_ino == os.lstat(dest / "d" / "abs").st_ino
    assert os.path.islink(tmp / "d" / "dangling")
    assert stat.S_IMODE(os.stat(tmp / "newdir").st_mode) == 0o700
    assert os.stat(tmp / "d").st_ino != os.stat(dest / "d").st_ino  # directories are fresh


def test_never_follows_a_symlink_in_dest(trees: tuple[Path, int, Path, int]) -> None:
    """DEST's "d" was swapped for a symlink to elsewhere after the diff: refused, not followed."""
    dest, dfd, tmp, tfd = trees
    outside = dest.parent / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    (dest / "d").symlink_to(outside)
    with pytest.raises(HostIOError, match="DEST changed during the pull"):
        build_farm(dfd, tfd, [(b"d", "d"), (b"d/secret", "f")], lambda: None)
    assert not (tmp / "d" / "secret").exists()


def test_missing_entry_fails_clearly(trees: tuple[Path, int, Path, int]) -> None:
    _, dfd, _, tfd = trees
    with pytest.raises(HostIOError, match="run the pull again"):
        build_farm(dfd, tfd, [(b"gone", "f")], lambda: None)


def test_a_file_that_became_a_directory_is_a_change_not_an_immutable_file(
    trees: tuple[Path, int, Path, int],
) -> None:
    """link(2) of a directory fails with EPERM, as for an immutable file: where DEST's
    entry is a directory now, the error says DEST changed (run again), not chattr."""
    dest, dfd, _, tfd = trees
    (dest / "was-a-link").mkdir()
    with pytest.raises(HostIOError, match="DEST changed during the pull") as failed:
        build_farm(dfd, tfd, [(b"was-a-link", "l")], lambda: None)
    assert "immutable" not in str(failed.value)


def test_hostile_names_are_refused(trees: tuple[Path, int, Path, int]) -> None:
    _, dfd, _, tfd = trees
    for bad in (b"..", b"a/..", b"a/"):
        with pytest.raises((HostileArchive, HostIOError)):
            build_farm(dfd, tfd, [(bad, "f")], lambda: None)


def test_cancel_is_checked_every_few_hundred(trees: tuple[Path, int, Path, int]) -> None:
    dest, dfd, _, tfd = trees
    for i in range(CANCEL_EVERY * 3):
        (dest / f"f{i:05d}").write_text("")
    calls = 0

    def check() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise Interrupted("stop")

    keep = [(f"f{i:05d}".encode(), "f") for i in range(CANCEL_EVERY * 3)]
    with pytest.raises(Interrupted):
        build_farm(dfd, tfd, keep, check)
    assert calls == 3


def test_deep_tree_uses_few_fds(trees: tuple[Path, int, Path, int]) -> None:
    dest, dfd, tmp, tfd = trees
    parts = [f"d{i}" for i in range(200)]
    deep = dest.joinpath(*parts)
    deep.mkdir(parents=True)
    (deep / "leaf").write_text("l")
    keep = [("/".join(parts[: i + 1]).encode(), "d") for i in range(len(parts))]
    keep.append(("/".join([*parts, "leaf"]).encode(), "f"))
    before = len(os.listdir("/proc/self/fd"))
    assert build_farm(dfd, tfd, keep, lambda: None) == 201
    assert len(os.listdir("/proc/self/fd")) == before
    assert tmp.joinpath(*parts, "leaf").read_text() == "l"


def test_dir_meta_deepest_first_root_last(trees: tuple[Path, int, Path, int]) -> None:
    _, _, tmp, tfd = trees
    (tmp / "a" / "b").mkdir(parents=True)
    (tmp / "c").mkdir()
    metas = [
        DirMeta(b"a/b", 0o000, 1_000_000_000_123),
        DirMeta(b"c", 0o2755, 2_000_000_000_000),
        DirMeta(b"a", 0o500, 3_000_000_000_000),
        DirMeta(b".", 0o750, 4_000_000_000_000),
    ]
    set_dir_meta(tfd, metas)
    try:
        assert stat.S_IMODE(os.stat(tmp / "a").st_mode) == 0o500
        assert stat.S_IMODE(os.stat(tmp / "c").st_mode) == 0o2755
        assert os.stat(tmp / "c").st_mtime_ns == 2_000_000_000_000
        assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o750
        assert os.stat(tmp).st_mtime_ns == 4_000_000_000_000
        os.chmod(tmp / "a", 0o700)
        assert stat.S_IMODE(os.lstat(tmp / "a" / "b").st_mode) == 0o000
        assert os.lstat(tmp / "a" / "b").st_mtime_ns == 1_000_000_000_123
    finally:
        os.chmod(tmp / "a", 0o700)
        os.chmod(tmp / "a" / "b", 0o700)


def test_dir_meta_refuses_setuid_and_symlinks(trees: tuple[Path, int, Path, int]) -> None:
    _, _, tmp, tfd = trees
    (tmp / "d").mkdir()
    with pytest.raises(HostileArchive):
        set_dir_meta(tfd, [DirMeta(b"d", 0o4755, 0)])
    (tmp / "l").symlink_to("d")
    with pytest.raises(HostIOError):
        set_dir_meta(tfd, [DirMeta(b"l", 0o755, 0)])
