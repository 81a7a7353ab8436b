"""Paths longer than PATH_MAX (4096 bytes) in the workspace.

Linux refuses such a path in one system call (``ENAMETOOLONG``), but a tree may hold it:
every name is short, only the whole is long (deep generated trees, nested packages).  The
extractor writes by directory fds, so the first pull always worked; every pull after it
failed with "host write failed: building the new tree, …": the farm opened parents with
one ``openat2`` of the whole relative path.  ``open_beneath`` now walks such a path a
component at a time, as it does where ``openat2`` is missing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from helpers import busybox_bin, local, options, run_pull, writer_around_tar
from wsync.engine.destdir import open_beneath
from wsync.engine.excludes import Excludes
from wsync.errors import StagingFailed, UsageError
from wsync.transports.local import LocalTransport

DEPTH = 40
NAME = "d" * 120  # 40 x 124 bytes: about 5,000 bytes of path


def _deep(root: Path) -> None:
    """``root`` with a chain of DEPTH directories and a file at its bottom (made by
    directory fds: the whole path is too long for one call)."""
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(DEPTH):
            os.mkdir(f"{NAME}{i}", dir_fd=fd)
            nxt = os.open(f"{NAME}{i}", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        leaf = os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(leaf, b"one\n")
        os.close(leaf)
    finally:
        os.close(fd)


def _append_to_leaf(root: Path, text: bytes) -> None:
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = open_beneath(top, _chain())
    finally:
        os.close(top)
    try:
        leaf = os.open("leaf.txt", os.O_WRONLY | os.O_APPEND, dir_fd=fd)
        os.write(leaf, text)
        os.close(leaf)
    finally:
        os.close(fd)


def _chain() -> tuple[str, ...]:
    return tuple(f"{NAME}{i}" for i in range(DEPTH))


def _tree(root: Path) -> dict[str, tuple[object, ...]]:
    """Every entry below ``root`` (kind, mode, mtime, content hash), walked by fds."""
    found: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames, dirfd in os.fwalk(root):
        rel = os.path.relpath(dirpath, root)
        for name in dirnames + filenames:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            digest = ""
            if stat.S_ISREG(st.st_mode):
                fd = os.open(name, os.O_RDONLY, dir_fd=dirfd)
                with os.fdopen(fd, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            key = os.path.normpath(os.path.join(rel, name))
            # whole seconds: the guest's tar keeps no more (docs/fidelity.md)
            found[key] = (
                stat.S_IFMT(st.st_mode),
                stat.S_IMODE(st.st_mode),
                int(st.st_mtime),
                digest,
            )
    return found


@pytest.mark.parametrize("keep_prev", [False, True])
def test_a_path_past_path_max_is_pulled_and_pulled_again(tmp_path: Path, keep_prev: bool) -> None:
    """Changes beside the deep file go by a ``select`` run as always; a change of the deep
    file itself makes the pull a whole-tree one (a ``select`` run cannot name it: before,
    the guest took it for vanished and the pull removed it from DEST, reporting success)."""
    ws = tmp_path / "ws"
    _deep(ws)
    (ws / "top.txt").write_text("top\n")
    longest = max(len(p) for p in _tree(ws))
    assert longest > 4096  # what this test is about
    dest = tmp_path / "out"
    opts = options(tmp_path, keep_prev=keep_prev)

    assert run_pull(local(), ws, dest, opts).mode == "full"
    assert _tree(dest) == _tree(ws)

    (ws / "top.txt").write_text("top, again\n")
    beside = run_pull(local(), ws, dest, opts)
    assert (beside.mode, beside.changed_files) == ("incremental", 1)
    assert _tree(dest) == _tree(ws)

    for text in (b"two\n", b"three\n"):
        _append_to_leaf(ws, text)
        deep = run_pull(local(), ws, dest, opts)
        assert deep.mode == "full"
        assert _tree(dest) == _tree(ws)

    again = run_pull(local(), ws, dest, opts)
    assert (again.mode, again.changed_files) == ("incremental", 0)

    # beside it once more: with --keep-prev this reuses a kept tree that holds the deep path
    (ws / "top.txt").write_text("top, a third time\n")
    last = run_pull(local(), ws, dest, opts)
    assert (last.mode, last.changed_files) == ("incremental", 1)
    assert _tree(dest) == _tree(ws)


def test_with_excludes_a_deep_change_stops_the_pull_and_says_why(tmp_path: Path) -> None:
    """Excludes are applied by a ``select`` run only: a deep entry to fetch cannot be, so
    the pull stops with one clear line and DEST stays as it was."""
    ws = tmp_path / "ws"
    _deep(ws)
    (ws / "skip.log").write_text("noise\n")
    dest = tmp_path / "out"
    opts = options(tmp_path, excludes=Excludes(("*.log",)))
    with pytest.raises(UsageError, match="longer than the guest's tar takes") as info:
        run_pull(local(), ws, dest, opts)
    assert info.value.exit_code == 2
    assert not dest.exists()
    # a preview archives nothing: it lists the changes as they are
    preview = run_pull(local(), ws, dest, options(tmp_path, excludes=opts.excludes, dry_run=True))
    assert preview.ok and not dest.exists()


def test_a_guest_whose_find_cannot_reach_a_deep_name_fails_clearly(tmp_path: Path) -> None:
    """busybox ``find`` and ``stat`` (the listing's fallback where GNU find is missing)
    cannot reach a name past PATH_MAX: they print an error and go on.  An entry left out
    of the listing would be taken for deleted, so the listing fails instead (GNU tar here
    would archive the tree)."""
    ws = tmp_path / "ws"
    _deep(ws)
    bindir = busybox_bin(tmp_path / "bb")
    for tool in ("stat", "readlink"):
        (bindir / tool).symlink_to(shutil.which("busybox") or "busybox")
    (bindir / "tar").unlink()
    (bindir / "tar").symlink_to(shutil.which("tar") or "tar")
    guest = LocalTransport(env={"PATH": str(bindir), "HOME": str(tmp_path)})
    dest = tmp_path / "out"
    # (the message is find's, cut at 300 bytes: the path alone is longer)
    with pytest.raises(StagingFailed, match=r"the listing \(find\) exited 2: find: \./d"):
        run_pull(guest, ws, dest, options(tmp_path))
    assert not dest.exists()


def test_open_beneath_opens_a_directory_past_path_max(tmp_path: Path) -> None:
    _deep(tmp_path / "ws")
    root = os.open(tmp_path / "ws", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = open_beneath(root, _chain())
        try:
            assert "leaf.txt" in os.listdir(fd)
        finally:
            os.close(fd)
    finally:
        os.close(root)


def test_a_deep_file_written_while_tar_reads_it_is_read_again_not_dropped(
    tmp_path: Path,
) -> None:
    """The guest lists what changed while tar read (to read it again) and asks whether each
    still exists; ``[ -e ]`` fails for a name past PATH_MAX as for a vanished one, so the
    deep file went to the "gone" list and the pull dropped it from DEST, reporting
    success.  A name that long now counts as still there: read again, kept."""
    ws = tmp_path / "ws"
    _deep(ws)
    count = tmp_path / "tar-count"  # (writer_around_tar counts tar's runs there)
    touch = (
        "import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
        "for part in sys.argv[2:]:\n"
        "    nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)\n"
        "    os.close(fd)\n"
        "    fd = nxt\n"
        "leaf = os.open('leaf.txt', os.O_WRONLY | os.O_APPEND, dir_fd=fd)\n"
        "os.write(leaf, b'written while read\\n')\n"
    )
    (tmp_path / "touch.py").write_text(touch)
    chain = " ".join(_chain())
    deep_name = "/".join([*_chain(), "leaf.txt"])
    # the first archive's read: the deep file changes while tar reads the tree, and tar
    # says so as GNU tar does of a file written while it read it (torn() reads this)
    guest = writer_around_tar(
        tmp_path,
        f'[ "$N" = 1 ] && {sys.executable} {tmp_path / "touch.py"} "$WS" {chain}\n'
        'real_tar "$@"; rc=$?\n'
        f'[ "$N" = 1 ] && echo "tar: ./{deep_name}: file changed as we read it" >&2\n'
        "exit $rc",
    )
    dest = tmp_path / "out"
    result = run_pull(guest, ws, dest, options(tmp_path))
    assert result.mode == "full"
    assert int(count.read_text()) >= 2  # it was read again
    assert _tree(dest) == _tree(ws)


@pytest.mark.parametrize("keep_prev", [False, True])
def test_after_a_whole_tree_run_in_place_of_a_select_nothing_is_fetched_again(
    tmp_path: Path, keep_prev: bool
) -> None:
    """The whole-tree run writes every entry afresh (new inodes): the commit must not
    compare them with the diff's kept entries, which left all of them out of the state
    and made the next pull fetch the whole workspace again (found in review)."""
    ws = tmp_path / "ws"
    _deep(ws)
    for i in range(20):
        (ws / f"f{i}.txt").write_text(f"{i}\n")
    dest, opts = tmp_path / "out", options(tmp_path, keep_prev=keep_prev)
    assert run_pull(local(), ws, dest, opts).mode == "full"
    (ws / "f0.txt").write_text("x\n")
    one = run_pull(local(), ws, dest, opts)
    assert (one.mode, one.changed_files) == ("incremental", 1)
    _append_to_leaf(ws, b"two\n")
    assert run_pull(local(), ws, dest, opts).mode == "full"
    again = run_pull(local(), ws, dest, opts)
    assert (again.mode, again.changed_files) == ("incremental", 0)
    assert _tree(ws) == _tree(dest)
