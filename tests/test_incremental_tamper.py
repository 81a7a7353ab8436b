"""DEST changed on the host between pulls is repaired by the next (incremental) pull, and
excludes end to end give what ``rsync -a --exclude`` gives (issue 8, "done means")."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import assert_exact, make_tree, options, writer_around_tar
from incr_helpers import EarlyFarms
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.excludes import Excludes
from wsync.engine.pull import pull
from wsync.transports.local import LocalTransport


def go(ws: Path, dest: Path, opts: PullOptions, guest: LocalTransport | None = None) -> PullResult:
    async def run() -> PullResult:
        transport = guest or LocalTransport()
        try:
            return await pull(transport, str(ws), dest, opts)
        finally:
            await transport.aclose()

    result = asyncio.run(run())
    assert result.ok, result.error
    return result


@pytest.fixture
def pulled(tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    ws = make_tree(tmp_path / "ws", big=256 * 1024, small=20)
    dest = tmp_path / "dest"
    opts = options(tmp_path)
    first = go(ws, dest, opts)
    assert first.mode == "full"
    assert_exact(ws, dest)
    again = go(ws, dest, opts)
    assert again.mode == "incremental" and again.changed_files == again.deleted_files == 0
    return ws, dest, opts


def test_host_edits_deletes_chmods_and_additions_are_repaired(
    pulled: tuple[Path, Path, PullOptions],
) -> None:
    ws, dest, opts = pulled
    # edited in place with size and mtime put back: only the ctime tells
    victim = dest / "src" / "f3.txt"
    st = os.stat(victim)
    data = victim.read_bytes()
    with open(victim, "r+b") as f:
        f.write(bytes(b ^ 0x20 for b in data[:4]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    (dest / "src" / "f4.txt").unlink()  # deleted
    shutil.rmtree(dest / "src" / "deep")  # a whole directory deleted
    (dest / "tool.sh").chmod(0o777)  # chmod
    (dest / "blob.bin").write_bytes(b"truncated")  # rewritten
    (dest / "extra").write_text("host only\n")  # added
    (dest / "empty" / "made-on-host").mkdir()  # added directory
    (dest / "zeros.bin").unlink()
    (dest / "zeros.bin").symlink_to("/etc/passwd")  # a file swapped for a symlink
    result = go(ws, dest, opts)
    assert_exact(ws, dest)
    assert result.mode == "incremental"
    assert result.changed_files >= 8
    assert result.deleted_files == 2  # extra and made-on-host, nothing else
    assert go(ws, dest, opts).changed_files == 0


def test_an_identical_copy_on_the_host_is_rehashed_not_fetched(
    pulled: tuple[Path, Path, PullOptions],
) -> None:
    """A file replaced by an identical one (new inode, mtime put back): re-hash keeps it."""
    ws, dest, opts = pulled
    target = dest / "src" / "f5.txt"
    st = os.stat(target)
    parent = os.stat(dest / "src")
    copy = dest / "src" / "copy.tmp"
    shutil.copyfile(target, copy)
    os.chmod(copy, st.st_mode & 0o7777)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(copy, target)
    os.utime(dest / "src", ns=(parent.st_atime_ns, parent.st_mtime_ns))
    ino = os.stat(target).st_ino
    (ws / "src" / "f6.txt").write_text("changed in the guest\n")  # so the tree is rebuilt
    result = go(ws, dest, opts)
    assert_exact(ws, dest)
    assert os.stat(dest / "src" / "f5.txt").st_ino == ino  # linked into the new tree, not fetched
    assert result.changed_files <= 2  # f6.txt and the src directory's new mtime


def _swap_link(dest: Path, name: str, target: str) -> int:
    """Replace DEST's symlink ``name`` by a new one to ``target``, its mtime and its
    directory's put back: kind, mode, size and mtime as recorded, only the inode and ctime
    tell.  Returns the new link's inode."""
    link = dest / name
    st, parent = os.lstat(link), os.stat(link.parent)
    link.unlink()
    link.symlink_to(target)
    os.utime(link, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    os.utime(link.parent, ns=(parent.st_atime_ns, parent.st_mtime_ns))
    return os.lstat(link).st_ino


def test_a_symlink_remade_on_the_host_is_read_again(
    pulled: tuple[Path, Path, PullOptions],
) -> None:
    """Two symlinks remade on the host with the mtime put back: one to the same target is
    kept as it is (its target read again, nothing fetched), one to another target of the
    same length (same size) is repaired."""
    ws, dest, opts = pulled
    same = _swap_link(dest, "link-to-blob", "blob.bin")
    _swap_link(dest, "src/link-up", "../zero.bin")  # "../blob.bin" has as many bytes
    (ws / "src" / "f6.txt").write_text("changed in the guest\n")  # so the tree is rebuilt
    result = go(ws, dest, opts)
    assert_exact(ws, dest)
    assert os.readlink(dest / "src" / "link-up") == "../blob.bin"
    assert os.lstat(dest / "link-to-blob").st_ino == same  # linked into the new tree
    assert go(ws, dest, opts).changed_files == 0
    assert result.changed_files <= 3  # f6.txt, link-up and the src directory's new mtime


def test_state_lost_between_swap_and_commit_costs_a_rehash(
    pulled: tuple[Path, Path, PullOptions],
) -> None:
    """A kill -9 after the swap but before the commit leaves the old state beside the new
    tree: every kept file then differs in ctime only (it was linked and unlinked), so the
    next pull re-hashes and keeps it; only what changed is fetched."""
    ws, dest, opts = pulled
    state_dir = opts.state_dir / "incremental"
    saved = {p.name: p.read_bytes() for p in state_dir.iterdir()}
    (ws / "src" / "f1.txt").write_text("changed in the guest\n")
    go(ws, dest, opts)
    for name, data in saved.items():  # as if the commit never happened
        (state_dir / name).write_bytes(data)
    result = go(ws, dest, opts)
    assert_exact(ws, dest)
    # f1.txt is fetched again (its guest record moved on); nothing else crosses (the
    # directories are re-made: the full pull's tar gave them whole-second mtimes)
    assert result.files == 1, result
    assert go(ws, dest, opts).changed_files == 0


RSYNC = shutil.which("rsync")


@pytest.mark.skipif(RSYNC is None, reason="rsync not installed")
@pytest.mark.parametrize(
    "patterns",
    [["*.txt"], ["/src/deep/", "blob.bin"], ["src/**", "*-dash"], ["latin1-*"], ["empty/"]],
    ids=lambda p: " ".join(p),
)
def test_excludes_end_to_end_equal_rsync(tmp_path: Path, patterns: list[str]) -> None:
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=10)
    dest, expected = tmp_path / "dest", tmp_path / "rsync"
    subprocess.run(
        [RSYNC or "rsync", "-a", *(f"--exclude={p}" for p in patterns), f"{ws}/", f"{expected}/"],
        check=True,
        capture_output=True,
    )
    opts = options(tmp_path, excludes=Excludes.from_options(patterns, []))
    go(ws, dest, opts)
    assert_exact(expected, dest)
    (ws / "src" / "f1.txt").write_text("changed\n")
    (ws / "new.bin").write_text("new\n")  # something not excluded, so a select runs
    subprocess.run([RSYNC or "rsync", "-a", "--delete", *(f"--exclude={p}" for p in patterns),
                    f"{ws}/", f"{expected}/"], check=True, capture_output=True)  # fmt: skip
    assert go(ws, dest, opts).mode == "incremental"
    assert_exact(expected, dest)


def test_adding_excludes_removes_what_an_earlier_pull_left(tmp_path: Path) -> None:
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=10)
    dest = tmp_path / "dest"
    go(ws, dest, options(tmp_path))
    opts = options(tmp_path, excludes=Excludes.from_options(["*.txt", "/src/deep/"], []))
    result = go(ws, dest, opts)
    assert result.mode == "incremental" and result.deleted_files > 0
    assert not list(dest.rglob("*.txt")) and not (dest / "src" / "deep").exists()
    assert (dest / "blob.bin").exists()


@pytest.mark.parametrize("guest_changed", [False, True])
def test_hardlinks_joined_or_split_on_the_host_are_repaired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guest_changed: bool
) -> None:
    """DEST mirrors the guest's hardlink groups (docs/fidelity.md); the host joining two
    files, splitting a linked pair, or putting an inode shared with a file outside DEST
    under a name, is repaired by the next pull.  Before, each was re-hashed, found equal
    and kept: DEST's groups stayed the host's for good.  With a change in the guest too,
    the early farm has linked every DEST file while the diff re-checks them: its own link
    is counted, the host's joins still are not kept."""
    ws, dest, opts = tmp_path / "ws", tmp_path / "dest", options(tmp_path)
    ws.mkdir()
    for name in ("a", "b", "e"):
        (ws / name).write_text("same bytes\n")
    (ws / "c").write_text("linked\n")
    os.link(ws / "c", ws / "d")
    outside = tmp_path / "outside"
    outside.write_text("same bytes\n")
    go(ws, dest, opts)

    def groups(root: Path) -> list[list[str]]:
        by_ino: dict[int, list[str]] = {}
        for name in sorted(os.listdir(root)):
            by_ino.setdefault(os.lstat(root / name).st_ino, []).append(name)
        return sorted(by_ino.values())

    assert groups(dest) == groups(ws) == [["a"], ["b"], ["c", "d"], ["e"]]
    os.unlink(dest / "b")
    os.link(dest / "a", dest / "b")  # joined
    data = (dest / "d").read_bytes()
    os.unlink(dest / "d")
    (dest / "d").write_bytes(data)  # split
    os.unlink(dest / "e")
    os.link(outside, dest / "e")  # shared with a file outside DEST
    shutil.copystat(ws / "d", dest / "d")
    farms = EarlyFarms(monkeypatch)
    if guest_changed:
        (ws / "new").write_text("new in the guest\n")
    result = go(ws, dest, opts)
    assert result.mode == "incremental"
    assert farms.finished == (1 if guest_changed else 0)
    assert_exact(ws, dest)
    assert groups(dest) == sorted([["a"], ["b"], ["c", "d"], ["e"], *([["new"]] * guest_changed)])
    assert os.stat(outside).st_nlink == 1  # DEST's e is not that inode any more
    again = go(ws, dest, opts)
    assert again.changed_files == again.deleted_files == 0


def test_a_host_edit_during_a_pull_is_repaired_by_the_next(tmp_path: Path) -> None:
    """The host edits a file of DEST while a pull transfers (here: from the guest's tar,
    which runs after the diff and before the commit).  That pull ends with the edit in
    DEST, as any edit made after a pull would; the next one must repair it.  Before, the
    commit recorded the edited file's signature beside the hash the diff had verified,
    and every later pull kept the edit."""
    ws = make_tree(tmp_path / "ws", big=4096, small=5)
    dest, opts = tmp_path / "dest", options(tmp_path)
    go(ws, dest, opts)
    victim = dest / "src" / "f3.txt"
    wrapper = writer_around_tar(
        tmp_path,
        f"if [ $N = 1 ]; then printf 'host edit\\n' >> {shlex.quote(str(victim))}; "
        f'chmod 600 {shlex.quote(str(dest / "tool.sh"))}; fi; real_tar "$@"',
    )
    (ws / "src" / "f1.txt").write_text("changed in the guest\n")  # a select run to wrap

    go(ws, dest, opts, wrapper)
    assert victim.read_bytes().endswith(b"host edit\n")  # made after the diff: not seen
    after = go(ws, dest, opts)
    assert after.changed_files == 2
    assert_exact(ws, dest)
    again = go(ws, dest, opts)
    assert again.changed_files == again.deleted_files == 0


@pytest.mark.parametrize("keep_prev", [False, True])
def test_a_fetched_file_changed_after_the_swap_is_repaired_by_the_next_pull(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep_prev: bool
) -> None:
    """A file this pull fetched, edited on the host between the swap and the state's
    commit (the old tree's removal lies between them): the commit recorded the
    extractor's hash beside what it found in DEST, and every later pull kept the edit."""
    from wsync.engine.incremental import Incremental

    ws = make_tree(tmp_path / "ws", big=4096, small=5)
    dest, opts = tmp_path / "dest", options(tmp_path, keep_prev=keep_prev)
    go(ws, dest, opts)
    (ws / "src" / "f1.txt").write_text("changed in the guest\n")
    (ws / "src" / "f2.txt").write_text("changed too\n")
    real = Incremental.commit

    def edited_first(self: Incremental, **kw: bool) -> None:
        with open(dest / "src" / "f1.txt", "ab") as f:
            f.write(b"host edit\n")
        os.chmod(dest / "src" / "f2.txt", 0o600)
        real(self, **kw)

    monkeypatch.setattr(Incremental, "commit", edited_first)
    during = go(ws, dest, opts)
    assert during.changed_files == 2
    monkeypatch.setattr(Incremental, "commit", real)
    after = go(ws, dest, opts)
    assert after.changed_files == 2
    assert_exact(ws, dest)
    again = go(ws, dest, opts)
    assert again.changed_files == again.deleted_files == 0
