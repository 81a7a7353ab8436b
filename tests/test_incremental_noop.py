"""The no-op shortcut of an unchanged re-pull (issue 8's 1.5x goal): once a pull found
nothing to do, the next one that sees the same manifest and the same DEST scan skips the
parse and the diff; DEST is still scanned, so nothing done to DEST on the host and nothing
changed in the guest slips past it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import assert_exact, make_tree, options, run_pull
from wsync.engine import linkmemo
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.excludes import Excludes
from wsync.engine.incstate import PullState
from wsync.transports.local import LocalTransport


def go(ws: Path, dest: Path, opts: PullOptions) -> PullResult:
    result = run_pull(LocalTransport(), ws, dest, opts)
    assert result.ok, result.error
    return result


class Loads:
    """Counts the manifests parsed into the state (the shortcut parses none)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = PullState.load_manifest

        def counted(state: PullState, *args: object, **kwargs: object) -> None:
            self.count += 1
            real(state, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(PullState, "load_manifest", counted)


def snapshot(dest: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every entry of DEST: inode, mode, mtime, ctime (a no-op writes nothing)."""
    found = {}
    for root, dirs, files in os.walk(dest):
        for name in [".", *dirs, *files]:
            st = os.lstat(os.path.join(root, name))
            found[os.path.join(root, name)] = (
                st.st_ino,
                st.st_mode,
                st.st_mtime_ns,
                st.st_ctime_ns,
            )
    return found


@pytest.fixture
def shortcut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, Path, PullOptions, Loads]]:
    """A DEST whose last pull found nothing to do: the next unchanged pull is a shortcut."""
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=20)
    dest = tmp_path / "dest"
    opts = options(tmp_path)
    assert go(ws, dest, opts).mode == "full"
    second = go(ws, dest, opts)  # finds nothing: records the no-op
    assert second.mode == "incremental" and second.changed_files == 0
    loads = Loads(monkeypatch)
    yield ws, dest, opts, loads


def test_an_unchanged_repull_changes_nothing_and_parses_nothing(
    shortcut: tuple[Path, Path, PullOptions, Loads],
) -> None:
    ws, dest, opts, loads = shortcut
    before = snapshot(dest)
    for _ in range(2):
        result = go(ws, dest, opts)
        assert result.mode == "incremental"
        assert result.changed_files == result.deleted_files == result.files == 0
    assert loads.count == 0  # the shortcut: no parse, no diff
    assert snapshot(dest) == before
    assert_exact(ws, dest)


def test_a_new_link_rate_does_not_break_the_shortcut(
    shortcut: tuple[Path, Path, PullOptions, Loads],
) -> None:
    """The manifest's compressed stream is what the shortcut compares: its level stays
    fixed whatever the link's remembered rate makes of the archive's."""
    ws, dest, opts, loads = shortcut
    for rate in (1e3, 1e12):
        linkmemo.remember(opts.state_dir, "local", rate)
        result = go(ws, dest, opts)
        assert result.mode == "incremental" and result.changed_files == 0
    assert loads.count == 0
    assert_exact(ws, dest)


def test_host_tampering_after_an_unchanged_pull_is_repaired(
    shortcut: tuple[Path, Path, PullOptions, Loads],
) -> None:
    """Same size, mtime put back: only the scan's ctime tells, and the shortcut must
    not hide it; a deletion and a chmod likewise."""
    ws, dest, opts, loads = shortcut
    victim = dest / "src" / "f3.txt"
    st = os.stat(victim)
    data = victim.read_bytes()
    with open(victim, "r+b") as f:
        f.write(bytes(b ^ 0x20 for b in data[:4]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    (dest / "src" / "f4.txt").unlink()
    (dest / "tool.sh").chmod(0o777)
    result = go(ws, dest, opts)
    assert loads.count == 1  # the full diff ran
    assert result.mode == "incremental" and result.changed_files >= 3
    assert_exact(ws, dest)
    # repaired, then unchanged twice: the second of those is a shortcut again
    assert go(ws, dest, opts).changed_files == 0
    assert go(ws, dest, opts).changed_files == 0
    assert loads.count == 2
    assert_exact(ws, dest)


@pytest.mark.parametrize("change", ["append", "touch-r", "delete", "chmod", "new-dir"])
def test_a_guest_change_after_an_unchanged_pull_is_picked_up(
    shortcut: tuple[Path, Path, PullOptions, Loads], change: str
) -> None:
    ws, dest, opts, _ = shortcut
    f = ws / "src" / "f5.txt"
    if change == "append":
        with f.open("ab") as out:
            out.write(b"more\n")
    elif change == "touch-r":  # same size, mtime put back: the manifest's ctime differs
        st = f.stat()
        data = f.read_bytes()
        f.write_bytes(bytes(b ^ 0x01 for b in data[:8]) + data[8:])
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "delete":
        shutil.rmtree(ws / "src" / "deep")
    elif change == "chmod":
        f.chmod(0o600)
    else:
        (ws / "new" / "dir").mkdir(parents=True)
    result = go(ws, dest, opts)
    assert result.mode == "incremental" and result.changed_files + result.deleted_files > 0
    assert_exact(ws, dest)


def test_other_excludes_are_not_the_recorded_noop(
    shortcut: tuple[Path, Path, PullOptions, Loads], tmp_path: Path
) -> None:
    """The no-op record holds for the options it was made under: new excludes diff."""
    ws, dest, _, loads = shortcut
    opts = options(tmp_path, excludes=Excludes.from_options(["*.txt"], []))
    result = go(ws, dest, opts)
    assert loads.count == 1
    assert result.deleted_files > 0 and not list(dest.rglob("*.txt"))


def _kept_tree(tmp_path: Path) -> tuple[Path, Path, PullOptions, str]:
    """A workspace pulled twice with ``--keep-prev`` (a kept tree beside DEST), and the
    name of this pull's own tmp tree (from its journal key, as the pull names it)."""
    from wsync.engine.destdir import tmp_name
    from wsync.engine.journal import Journal

    ws = make_tree(tmp_path / "ws", big=4096, small=10)
    dest = tmp_path / "out"
    opts = options(tmp_path, keep_prev=True)
    go(ws, dest, opts)
    (ws / "src" / "f1.txt").write_text("changed\n")
    go(ws, dest, opts)
    key = Journal(opts.state_dir, "local", dest.resolve()).key
    return ws, dest, opts, tmp_name(dest.name, key[:12])


def _beside(tmp_path: Path) -> list[str]:
    """wsync's names beside DEST ``out``."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out."))


@pytest.mark.parametrize("keep_prev", [False, True], ids=["default", "keep-prev"])
def test_an_unchanged_pull_removes_what_killed_runs_left_beside_dest(
    tmp_path: Path, keep_prev: bool
) -> None:
    """A ``--full`` pull killed while it extracted leaves its partial tree beside DEST
    (and an older wsync its ``.NAME.wsync-old``); a pull that then finds nothing to do
    removes them, where before only a pull that changed something did.  The kept tree
    of ``--keep-prev`` stays (the next pull starts from it)."""
    ws = make_tree(tmp_path / "ws", big=4096, small=10)
    dest = tmp_path / "out"
    opts = options(tmp_path, keep_prev=keep_prev)
    go(ws, dest, opts)
    (ws / "src" / "f1.txt").write_text("changed\n")
    go(ws, dest, opts)  # (with --keep-prev: the kept tree)
    go(ws, dest, opts)
    killed = tmp_path / ".out.wsync-tmp-0123456789ab"
    shutil.copytree(dest / "src", killed / "src")  # a partial copy of DEST
    (tmp_path / ".out.wsync-old").mkdir()
    beside = _beside(tmp_path)
    result = go(ws, dest, opts)
    assert result.changed_files == result.deleted_files == 0
    assert_exact(ws, dest)
    # the tree's size, as a pull that changed something says (it said 0: an empty DEST)
    files = [p for p in ws.rglob("*") if p.is_file() and not p.is_symlink()]
    assert result.tree_bytes == sum(p.stat().st_size for p in files) > 0
    left = _beside(tmp_path)
    assert left == ([".out.wsync-prev"] if keep_prev else []), (beside, left)
    assert result.warnings == []


def test_an_unchanged_pull_keeps_the_kept_tree_a_killed_run_took_up(tmp_path: Path) -> None:
    """A ``--keep-prev`` select run renames the kept tree to its own tmp name before it
    builds on it; killed there, it leaves that tree for the next run of the same pull.
    An unchanged pull in between leaves it too (found by a review: the sweep removed it,
    and the next pull that changed something built a whole farm again)."""
    ws, dest, opts, own = _kept_tree(tmp_path)
    (tmp_path / ".out.wsync-prev").rename(tmp_path / own)  # where the killed run left it
    assert go(ws, dest, opts).changed_files == 0
    assert (tmp_path / own).is_dir()
    kept = os.stat(tmp_path / own).st_ino
    (ws / "src" / "f2.txt").write_text("changed again\n")
    result = go(ws, dest, opts)
    assert result.changed_files == 1
    assert_exact(ws, dest)
    assert os.stat(dest).st_ino == kept  # the new DEST is that tree, taken up
    left = _beside(tmp_path)
    assert left == [".out.wsync-prev"]


def test_an_unchanged_keep_prev_pull_removes_a_killed_full_runs_copy(tmp_path: Path) -> None:
    """With the kept tree still beside DEST, this pull's own tmp name holds something
    else: the partial copy of a killed ``--full`` run.  An unchanged ``--keep-prev`` pull
    removes it and keeps the kept tree (found by a review: it kept both, and the next pull
    that changed something preferred the partial copy to the kept tree)."""
    ws, dest, opts, own = _kept_tree(tmp_path)
    shutil.copytree(dest / "src", tmp_path / own / "src")  # a killed --full run's copy
    assert go(ws, dest, opts).changed_files == 0
    left = _beside(tmp_path)
    assert left == [".out.wsync-prev"]
