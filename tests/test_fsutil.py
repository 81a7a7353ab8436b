"""The iterative tree remover: any depth, few fds, never through a symlink, honest failures."""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from wsync.engine.fsutil import EarlyFlush, remove_tree_at, rmtree
from wsync.errors import HostIOError


def deep_tree(top: Path, depth: int, *, every: int = 100) -> None:
    """``top/d/d/…`` ``depth`` levels deep, with a file and a symlink every ``every`` levels.

    Built with directory fds: the full path is far beyond PATH_MAX.
    """
    top.mkdir()
    cur = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            if level % every == 0:
                fd = os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=cur)
                os.write(fd, b"x")
                os.close(fd)
                os.symlink("../../../../..", "up", dir_fd=cur)
            os.mkdir("d", dir_fd=cur)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
            os.close(cur)
            cur = nxt
    finally:
        os.close(cur)


@contextlib.contextmanager
def few_fds(spare: int) -> Iterator[None]:
    """Lower this process's fd limit to what is open now plus ``spare``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = max(int(n) for n in os.listdir("/proc/self/fd")) + 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + spare, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_removes_a_tree_5000_deep_with_a_bounded_number_of_fds(tmp_path: Path) -> None:
    """Issue 7 item 7: ``shutil.rmtree`` raised RecursionError at ~1,000 levels."""
    deep_tree(tmp_path / "t", 5000)
    with few_fds(64):
        rmtree(tmp_path / "t")
    assert os.listdir(tmp_path) == []


def test_symlinks_are_removed_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "keep").write_text("keep\n")
    tree = tmp_path / "t"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "to-dir").symlink_to(outside)
    (tree / "a" / "to-file").symlink_to(outside / "sub" / "keep")
    (tree / "a" / "to-sub").symlink_to("../../outside/sub")
    (tmp_path / "top-link").symlink_to(outside)
    rmtree(tree)
    rmtree(tmp_path / "top-link")  # a symlink given as the tree: only the link goes
    assert sorted(os.listdir(tmp_path)) == ["outside"]
    assert (outside / "sub" / "keep").read_text() == "keep\n"


def test_missing_path_and_single_file(tmp_path: Path) -> None:
    rmtree(tmp_path / "nothing-here")
    rmtree(tmp_path / "no" / "parent")
    (tmp_path / "file").write_text("x")
    rmtree(tmp_path / "file")
    assert os.listdir(tmp_path) == []


def test_read_only_directories_are_made_removable(tmp_path: Path) -> None:
    """As a user without root's override: 0o500 and 0o000 directories it owns go too."""
    if not hasattr(os, "setuid") or os.geteuid() != 0:
        pytest.skip("needs root to run the remover as another user")
    base = Path(tempfile.mkdtemp(prefix="wsync-rm-", dir="/tmp"))
    try:
        base.chmod(0o755)
        tree = base / "t"
        (tree / "ro" / "inner").mkdir(parents=True)
        (tree / "ro" / "inner" / "f").write_text("x")
        (tree / "none" / "x").mkdir(parents=True)
        (tree / "none" / "x" / "g").write_text("y")
        for dirpath, dirnames, filenames in os.walk(base):
            for name in (*dirnames, *filenames):
                os.chown(os.path.join(dirpath, name), 65534, 65534)
        os.chown(base, 65534, 65534)
        (tree / "ro" / "inner").chmod(0o500)
        (tree / "ro").chmod(0o500)
        (tree / "none" / "x").chmod(0o000)
        (tree / "none").chmod(0o000)
        # python itself lives under /root here, so fork instead of exec'ing it as nobody
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                rmtree(tree)
                code = 0
            except BaseException as exc:
                os.write(2, f"{exc!r}\n".encode())
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.listdir(base) == []
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(base)], check=False)
        subprocess.run(["rm", "-rf", str(base)], check=False)


@pytest.fixture
def busy_mount(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path/t/a/mnt`` is a tmpfs mount point: rmdir of it fails with EBUSY."""
    mnt = tmp_path / "t" / "a" / "mnt"
    mnt.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace')}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_real_failure_names_the_path_after_removing_the_rest(
    tmp_path: Path, busy_mount: Path
) -> None:
    tree = tmp_path / "t"
    (busy_mount / "inside").write_text("on the tmpfs\n")
    (tree / "a" / "b").mkdir()
    (tree / "a" / "b" / "f").write_text("x")
    (tree / "z").write_text("z")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(HostIOError, match=r"cannot remove .*/t/a/mnt: a mount point") as info:
            remove_tree_at(fd, "t", shown=str(tree))
    finally:
        os.close(fd)
    assert info.value.exit_code == 8
    # everything else went: the mount point, what it holds (another filesystem's: never
    # entered) and the directories holding it stay
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["t", "t/a", "t/a/mnt", "t/a/mnt/inside"]


def _fds_on(path: Path) -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == str(path):
                found.add(int(name))
    return found


def test_the_early_flush_uses_its_own_open_of_the_tree_and_lets_it_go(tmp_path: Path) -> None:
    """A separate open of the tree (a dup would share the writeback-error cursor that the
    last syncfs must see), flushed while the tree is written, closed once the flusher
    stops; the caller's fd is never touched."""
    tree = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert _fds_on(tmp_path) == {tree}
        flush = EarlyFlush(tree, interval=0.01)
        ours = _fds_on(tmp_path) - {tree}
        assert len(ours) == 1
        # status flags belong to the open file description: a dup would see this change
        fcntl.fcntl(tree, fcntl.F_SETFL, fcntl.fcntl(tree, fcntl.F_GETFL) | os.O_NONBLOCK)
        (fd,) = ours
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
        for i in range(20):
            (tmp_path / f"f{i}").write_bytes(b"x" * 65536)
        flush.stop()
        flush._thread.join(10)
        assert not flush._thread.is_alive()
        assert _fds_on(tmp_path) == {tree}
        os.fstat(tree)  # still open
    finally:
        os.close(tree)


def test_a_durable_write_that_fails_leaves_no_part_behind(tmp_path: Path) -> None:
    """A red team filled the state directory's disk: each failed write kept its temp
    file (up to a whole 4 MiB chunk), on the disk that was full.  Here the file-size
    limit fails the write (EFBIG; Python ignores SIGXFSZ) as a full disk would, in a
    process of its own (the limit would reach every thread of this one)."""
    script = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "from wsync.engine.fsutil import write_atomic\n"
        "from wsync.errors import HostIOError\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    write_atomic(Path(sys.argv[1]), b'x' * 100_000)\n"
        "except HostIOError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "chunk")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "File too large" in done.stdout, (done.stdout, done.stderr)
    assert list(tmp_path.iterdir()) == []
