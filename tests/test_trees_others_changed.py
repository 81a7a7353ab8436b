"""What someone else did to the trees wsync removes or reuses (found by a review): a mount
below one (wsync never mounts: what it holds is not wsync's to remove or to carry into
DEST), a kept directory made immutable.  Needs root, and a kernel and filesystem that let
it mount or set the flag (skipped elsewhere)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import assert_exact, make_tree, options, run_pull
from test_prevtree import change, pull, tmp_trees
from wsync.engine.api import PullOptions
from wsync.engine.fsutil import remove_tree_at
from wsync.errors import DiskLow, HostIOError, WsyncError
from wsync.transports.local import LocalTransport

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mount needs root")


@contextlib.contextmanager
def mounted(*args: str, under: Path) -> Iterator[None]:
    """``mount ARGS``, and every mount below ``under`` lazily unmounted afterwards."""
    if subprocess.run(["mount", *args], capture_output=True).returncode:
        pytest.skip("cannot mount here")
    try:
        yield
    finally:
        for line in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            point = line.split()[1]
            if point.startswith(str(under)):
                subprocess.run(["umount", "-l", point], check=False)


@contextlib.contextmanager
def mounted_in_dest(tmp_path: Path, dest: Path, kind: str) -> Iterator[None]:
    """A tmpfs (or a directory of tmp_path bound) on ``DEST/sub`` holding ``precious``;
    afterwards, wherever the mount went with the trees' renames, ``precious`` is intact."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = ["-t", "tmpfs", "none"] if kind == "tmpfs" else ["--bind", str(elsewhere)]
    with mounted(*args, str(dest / "sub"), under=tmp_path):
        (dest / "sub" / "precious").write_text("not wsync's\n")
        fs = os.stat(dest / "sub")
        yield
        where = [
            Path(top)
            for top, _, _ in os.walk(tmp_path)
            if (os.stat(top).st_dev, os.stat(top).st_ino) == (fs.st_dev, fs.st_ino)
        ]
        assert where and (where[0] / "precious").read_text() == "not wsync's\n", where


def prev_of(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.wsync-prev"


def kept_tree(tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    """A workspace pulled twice with ``--keep-prev``: DEST and a kept tree beside it."""
    ws = make_tree(tmp_path / "ws", big=4096, small=10)
    dest = tmp_path / "out"
    opts = options(tmp_path, keep_prev=True)
    assert run_pull(LocalTransport(), ws, dest, opts).ok
    (ws / "src" / "f1.txt").write_text("round 1\n")
    assert run_pull(LocalTransport(), ws, dest, opts).ok
    return ws, dest, opts


@pytest.mark.parametrize("kind", ["tmpfs", "bind"])
def test_removing_a_tree_never_enters_a_mount_in_it(tmp_path: Path, kind: str) -> None:
    """Another filesystem, or a directory bind-mounted from this one (same ``st_dev``):
    its files stay, the removal fails naming it, the rest of the tree goes."""
    tree = tmp_path / "tree"
    (tree / "a" / "m").mkdir(parents=True)
    (tree / "a" / "file").write_text("ours\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = ["-t", "tmpfs", "none"] if kind == "tmpfs" else ["--bind", str(elsewhere)]
    with mounted(*args, str(tree / "a" / "m"), under=tmp_path):
        (tree / "a" / "m" / "precious").write_text("not wsync's\n")
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(HostIOError, match="a mount point"):
                remove_tree_at(fd, "tree")
        finally:
            os.close(fd)
        assert (tree / "a" / "m" / "precious").read_text() == "not wsync's\n"
        assert not (tree / "a" / "file").exists()


def test_the_warning_names_where_a_mount_in_the_old_tree_stays(tmp_path: Path) -> None:
    """A tmpfs mounted inside DEST: the pull replaces DEST, the old tree's removal leaves
    the mount where it is, and the warning names that very place (before: the name the
    old tree had before it was set aside for its removal, which no longer exists)."""
    ws = make_tree(tmp_path / "ws", big=4096, small=10)
    dest = tmp_path / "out"
    opts = options(tmp_path)
    assert run_pull(LocalTransport(), ws, dest, opts).ok
    (dest / "sub").mkdir()
    with mounted("-t", "tmpfs", "none", str(dest / "sub"), under=tmp_path):
        fs = os.stat(dest / "sub").st_dev
        (ws / "src" / "f1.txt").write_text("round 1\n")
        result = run_pull(LocalTransport(), ws, dest, opts)
        assert result.ok
        assert_exact(ws, dest)
        where = [Path(top) for top, _, _ in os.walk(tmp_path) if os.stat(top).st_dev == fs]
        shown = [w for w in result.warnings if "not fully removed" in w]
        assert where and shown, (where, result.warnings)
        assert f"{where[0]}:" in shown[0], (where, shown)


def test_a_mount_in_the_kept_tree_is_not_emptied(tmp_path: Path) -> None:
    """A tmpfs mounted on a directory of ``.NAME.wsync-prev``: the pull neither reuses that
    tree nor deletes the mount's files, and DEST comes out exact."""
    ws, dest, opts = kept_tree(tmp_path)
    point = prev_of(dest) / "src" / "deep"
    with mounted("-t", "tmpfs", "none", str(point), under=tmp_path):
        (point / "precious.txt").write_text("on another filesystem\n")
        fs_id = os.stat(point).st_dev
        (ws / "src" / "f2.txt").write_text("round 2\n")
        run_pull(LocalTransport(), ws, dest, opts)
        assert_exact(ws, dest)
        # the mount travels with the tree's renames: found again by its device
        where = [Path(top) for top, _, _ in os.walk(tmp_path) if os.stat(top).st_dev == fs_id]
        assert where and (where[0] / "precious.txt").exists(), where


def test_a_file_bind_mounted_in_the_kept_tree_never_reaches_dest(tmp_path: Path) -> None:
    """A file bind-mounted over one of the kept tree's: the directory listing gives the
    covered inode (DEST's own), so only the mount table shows it; the tree is not reused."""
    ws, dest, opts = kept_tree(tmp_path)
    planted = tmp_path / "planted.txt"
    planted.write_text("NOT THE GUEST'S\n" * 3)
    with mounted("--bind", str(planted), str(prev_of(dest) / "src" / "f4.txt"), under=tmp_path):
        (ws / "src" / "f2.txt").write_text("round 2\n")
        assert run_pull(LocalTransport(), ws, dest, opts).ok
        assert_exact(ws, dest)


@pytest.mark.skipif(shutil.which("chattr") is None, reason="no chattr")
def test_an_immutable_kept_directory_never_blocks_dest_for_good(tmp_path: Path) -> None:
    """A directory of the kept tree made immutable (``chattr +i``) passes the reuse's walk
    and verdict; the extractor then cannot write into it.  That pull fails, and the tree
    is not reused again: the next pull makes a fresh farm and lands DEST exactly (found by
    a review: every later pull took the same tree and failed the same way)."""
    ws, dest, opts = kept_tree(tmp_path)
    stuck = prev_of(dest) / "src" / "deep"
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode:
        pytest.skip("no immutable flag here")
    try:
        (ws / "src" / "deep" / "new.txt").write_text("new in the guest\n")
        errors = []
        for _ in range(2):  # the first may fail; the second must land DEST
            try:
                result = run_pull(LocalTransport(), ws, dest, opts)
            except WsyncError as exc:
                errors.append(str(exc))
                continue
            assert result.ok, result.error
            break
        else:
            pytest.fail(f"two pulls in a row failed: {errors}")
        assert_exact(ws, dest)
    finally:
        for path in [*dest.parent.glob(f".{dest.name}.wsync-*/src/deep"), dest / "src/deep"]:
            subprocess.run(["chattr", "-i", str(path)], check=False)


@pytest.mark.parametrize("kind", ["tmpfs", "bind"])
def test_a_mount_inside_dest_keeps_its_files_when_the_old_tree_goes(
    tmp_path: Path, kind: str
) -> None:
    """Someone mounts a filesystem (or binds a directory) on a directory of DEST.  The next
    pull that changes something replaces DEST and removes the old tree: the mount goes
    with the old tree, its files stay where they are (the code before deleted them: a
    default pull's removal walked into the mount), and DEST is the guest's tree."""
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "a").write_text("a\n")
    (ws / "sub" / "b").write_text("b\n")
    dest = tmp_path / "out"
    opts = options(tmp_path)
    assert run_pull(LocalTransport(), ws, dest, opts).ok
    with mounted_in_dest(tmp_path, dest, kind):
        (ws / "a").write_text("a, changed\n")
        result = run_pull(LocalTransport(), ws, dest, opts)
        assert result.ok, result.error
        assert any("not fully removed" in w for w in result.warnings), result.warnings
        assert_exact(ws, dest)


@pytest.mark.parametrize("in_guest", [True, False], ids=["dir-in-guest", "dir-not-in-guest"])
@pytest.mark.parametrize("kind", ["tmpfs", "bind"])
def test_keep_prev_never_deletes_a_mount_inside_dest(
    tmp_path: Path, kind: str, in_guest: bool
) -> None:
    """As test_a_mount_inside_dest_keeps_its_files_when_the_old_tree_goes, with
    --keep-prev: the old DEST would become the kept tree and be pruned path by path (the
    prune took the files DEST's scan had seen in the mount for the tree's; found by a
    review).  A tree with a mount below it is not kept, and its removal leaves the mount."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a").write_text("a\n")
    if in_guest:
        (ws / "sub").mkdir()
        (ws / "sub" / "b").write_text("b\n")
    dest = tmp_path / "out"
    opts = options(tmp_path, keep_prev=True)
    assert run_pull(LocalTransport(), ws, dest, opts).ok
    (dest / "sub").mkdir(exist_ok=True)  # (a directory someone made in DEST to mount on)
    with mounted_in_dest(tmp_path, dest, kind):
        for round_no in (1, 2):
            (ws / "a").write_text(f"a, round {round_no}\n")
            result = run_pull(LocalTransport(), ws, dest, opts)
            assert result.ok, result.error
            assert_exact(ws, dest)


def test_a_pull_stopped_by_a_full_disk_leaves_its_reused_tree(tmp_path: Path) -> None:
    """DEST's filesystem drops below --min-free while a --keep-prev pull extracts into the
    kept tree: DiskLow, the host's condition (the same command resumes once there is
    room).  No write failed in the tree and no thread is at work in it: it is left for the
    next run, which reuses it (a review caught f5752e6 throwing it away)."""
    box = tmp_path / "box"
    box.mkdir()
    with mounted("-t", "tmpfs", "-o", "size=300m", "none", str(box), under=tmp_path):
        ws = make_tree(tmp_path / "ws", big=64 * 1024, small=30)
        dest = box / "out"
        opts = options(tmp_path, keep_prev=True)  # default --min-free: 256 MiB
        assert pull(ws, dest, opts).mode == "full"
        change(ws, 1)
        assert pull(ws, dest, opts).mode == "incremental"
        kept = os.stat(prev_of(dest)).st_ino
        filler = box / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (60 << 20))  # someone fills the disk: 240 MiB free
        change(ws, 2)
        with pytest.raises(DiskLow):
            run_pull(LocalTransport(), ws, dest, opts)
        filler.unlink()  # room again: the same command resumes
        left = [os.stat(t).st_ino for t in tmp_trees(dest)] + (
            [os.stat(prev_of(dest)).st_ino] if prev_of(dest).exists() else []
        )
        assert kept in left, "the kept tree was thrown away after DiskLow"
        assert pull(ws, dest, opts).mode == "incremental"
        assert os.stat(dest).st_ino == kept  # reused, not a fresh farm
