"""The incremental state and diff: every kind of change, host tampering, excludes, hostile
manifests, bounded scratch tables.  Real trees on disk, the real farm; a plain copy stands
in for the transfer (tests/incr_helpers.py)."""

from __future__ import annotations

import io
import os
import shutil
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from incr_helpers import Entry, manifest, pull
from wsync.engine import incstate
from wsync.engine.api import ExtractLimits, PullOptions
from wsync.engine.destdir import DestDir
from wsync.engine.excludes import Excludes
from wsync.engine.incremental import HashLog, Incremental
from wsync.engine.incstate import PullState, state_path
from wsync.engine.itemize import _escape_each, escape
from wsync.errors import DiskLow, HostileArchive, HostIOError, LimitExceeded, StagingFailed
from wsync.treediff import diff as treediff


def guest_tree(root: Path) -> Path:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "empty").mkdir()
    (root / "a.txt").write_text("alpha\n")
    (root / "same.txt").write_text("12345678\n")
    (root / "src" / "main.py").write_text("print('hi')\n")
    (root / "src" / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "docs" / "readme.md").write_text("# docs\n")
    (root / "tool.sh").write_text("#!/bin/sh\n")
    (root / "link").symlink_to("a.txt")
    (root / "dirlink").symlink_to("src")
    os.link(root / "a.txt", root / "hard.txt")
    odd = os.fsencode(root) + b"/odd-\xff\n name"
    with open(odd, "wb") as f:
        f.write(b"odd\n")
    return root


@pytest.fixture
def env(tmp_path: Path) -> tuple[Path, Path, Path]:
    guest = guest_tree(tmp_path / "guest")
    return tmp_path / "state", guest, tmp_path / "dest"


def exact(guest: Path, dest: Path) -> None:
    assert treediff(guest, dest) == []


def test_first_pull_fetches_all_then_unchanged_does_nothing(env: tuple[Path, Path, Path]) -> None:
    state, guest, dest = env
    first = pull(state, guest, dest)
    exact(guest, dest)
    assert first.diff.changed > 0
    assert b"a.txt" in first.fetched and b"src/pkg/mod.py" in first.fetched
    assert not any(p in first.fetched for p in (b".", b"src", b"empty"))  # dirs never fetched
    with PullState.open(state, dest, "local:guest") as st:
        rows = st.db.execute("SELECT path, hash FROM main.state WHERE kind = 'f'").fetchall()
    assert len(rows) == 8 and all(h is not None and len(h) == 32 for _, h in rows)
    again = pull(state, guest, dest)
    assert again.diff.nothing_to_do, again.lines
    assert again.fetched == []
    assert again.lines == []


def test_every_kind_of_change(env: tuple[Path, Path, Path]) -> None:
    state, guest, dest = env
    pull(state, guest, dest)
    with open(guest / "a.txt", "a") as f:  # append (hard.txt is the same inode)
        f.write("more\n")
    st = os.stat(guest / "same.txt")
    (guest / "same.txt").write_text("87654321\n")  # same size, mtime put back
    os.utime(guest / "same.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
    (guest / "docs" / "readme.md").unlink()
    shutil.rmtree(guest / "src" / "pkg")  # a deleted directory
    (guest / "new" / "deeper").mkdir(parents=True)
    (guest / "new" / "deeper" / "f").write_text("new\n")
    (guest / "newempty").mkdir()
    (guest / "empty").rmdir()
    os.rename(guest / "src" / "main.py", guest / "src" / "renamed.py")
    os.rename(guest / "docs", guest / "documents")
    (guest / "tool.sh").chmod(0o755)
    (guest / "link").unlink()
    (guest / "link").symlink_to("same.txt")  # retargeted
    (guest / "dirlink").unlink()
    (guest / "dirlink").mkdir()  # symlink -> directory
    res = pull(state, guest, dest)
    exact(guest, dest)
    fetched = set(res.fetched)
    assert {b"a.txt", b"hard.txt", b"same.txt", b"new/deeper/f", b"src/renamed.py"} <= fetched
    assert {b"tool.sh", b"link"} <= fetched
    assert b"odd-\xff\n name" not in fetched
    assert res.diff.deleted >= 4  # readme, pkg, pkg/mod.py, main.py, docs, empty
    lines = res.lines
    assert "*deleting   src/pkg/mod.py" in lines
    assert ">f.st...... a.txt" in lines
    assert ">fc........ same.txt" in lines
    assert ">f...p..... tool.sh" in lines
    assert "cL+++++++++ link -> same.txt" not in lines  # same kind: a changed link
    assert any(line.startswith("cLc") and line.endswith("link -> same.txt") for line in lines)
    assert "cd+++++++++ newempty/" in lines
    # and back: file <-> dir, file -> symlink, symlink -> file, chmod -x
    (guest / "a.txt").unlink()
    (guest / "a.txt").mkdir()
    shutil.rmtree(guest / "new")
    (guest / "new").write_text("now a file\n")
    (guest / "same.txt").unlink()
    (guest / "same.txt").symlink_to("hard.txt")
    (guest / "link").unlink()
    (guest / "link").write_text("a file now\n")
    (guest / "tool.sh").chmod(0o644)
    pull(state, guest, dest)
    exact(guest, dest)
    assert pull(state, guest, dest).diff.nothing_to_do
    with PullState.open(state, dest, "local:guest") as st:
        size = sum(
            os.lstat(p).st_size for p in guest.rglob("*") if p.is_file() and not p.is_symlink()
        )
        assert st.tree_bytes() == size


def test_unchanged_entries_are_linked_not_copied(env: tuple[Path, Path, Path]) -> None:
    state, guest, dest = env
    pull(state, guest, dest)
    before = os.stat(dest / "src" / "pkg" / "mod.py").st_ino
    (guest / "a.txt").write_text("changed\n")
    res = pull(state, guest, dest)
    assert res.fetched == [b"a.txt", b"hard.txt"] and res.diff.fetch == 2
    assert os.stat(dest / "src" / "pkg" / "mod.py").st_ino == before
    exact(guest, dest)


def test_tampering_with_dest_is_repaired(env: tuple[Path, Path, Path]) -> None:
    state, guest, dest = env
    pull(state, guest, dest)
    # edited in place with the mtime put back: same inode, same size, only ctime moves
    target = dest / "same.txt"
    st = os.stat(target)
    with open(target, "r+b") as f:
        f.write(b"XXXX")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    (dest / "src" / "main.py").unlink()  # deleted on the host
    (dest / "tool.sh").chmod(0o777)  # chmod on the host
    (dest / "extra.txt").write_text("host only\n")  # added on the host
    (dest / "docs" / "extra-dir").mkdir()
    os.symlink("/etc", dest / "src" / "pkg" / "sneaky")
    # replaced by an identical copy (new inode, same bytes, mtime put back): re-hash keeps it
    copy = dest / "docs" / "readme.md"
    st = os.stat(copy)
    data = copy.read_bytes()
    copy.unlink()
    copy.write_bytes(data)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = pull(state, guest, dest)
    exact(guest, dest)
    assert set(res.fetched) == {b"same.txt", b"src/main.py", b"tool.sh"}
    assert res.diff.deleted == 3  # extra.txt, docs/extra-dir, src/pkg/sneaky
    lines = res.lines
    assert ">fc........ same.txt" in lines
    assert ">f+++++++++ src/main.py" in lines
    assert "*deleting   extra.txt" in lines
    assert pull(state, guest, dest).diff.nothing_to_do


def test_failed_pull_after_farm_costs_only_a_rehash(env: tuple[Path, Path, Path]) -> None:
    """Linking (a farm that was never swapped in) changes every ctime: re-hash, keep all."""
    state, guest, dest = env
    pull(state, guest, dest)
    farm = dest.parent / "abandoned-farm"
    farm.mkdir()
    for i, name in enumerate(("a.txt", "same.txt", "tool.sh")):
        os.link(dest / name, farm / f"{i}")
    shutil.rmtree(farm)
    res = pull(state, guest, dest)
    assert res.diff.nothing_to_do
    exact(guest, dest)
    # the verified signatures were recorded: the next diff hashes nothing
    with PullState.open(state, dest, "local:guest") as st:
        st.load_manifest(manifest(guest), Excludes.none())
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert st.diff(fd).nothing_to_do
        finally:
            os.close(fd)
        assert st.db.execute("SELECT count(*) FROM s.verdict").fetchone()[0] == 0


def test_hardlinked_guest_files_are_fetched_together(env: tuple[Path, Path, Path]) -> None:
    state, guest, dest = env
    pull(state, guest, dest)
    os.unlink(dest / "hard.txt")  # only one name lost on the host
    res = pull(state, guest, dest)
    assert set(res.fetched) == {b"a.txt", b"hard.txt"}
    assert any(line.startswith("hf") and line.endswith(" a.txt") for line in res.lines)


def test_excludes_filter_and_remove_what_an_earlier_pull_left(
    env: tuple[Path, Path, Path],
) -> None:
    state, guest, dest = env
    pull(state, guest, dest)
    res = pull(state, guest, dest, excludes=Excludes.from_options(["src/", "*.md"], []))
    assert res.fetched == [] and res.diff.fetch == 0 and not res.diff.nothing_to_do
    assert res.diff.deleted == 5  # src, src/main.py, src/pkg, src/pkg/mod.py, docs/readme.md
    assert not (dest / "src").exists() and not (dest / "docs" / "readme.md").exists()
    assert (dest / "docs").is_dir()
    # an excluded file changing in the guest changes nothing
    (guest / "src" / "main.py").write_text("changed\n")
    again = pull(state, guest, dest, excludes=Excludes.from_options(["src/", "*.md"], []))
    assert again.diff.nothing_to_do


def test_another_sandbox_is_no_baseline(env: tuple[Path, Path, Path]) -> None:
    state, guest, dest = env
    pull(state, guest, dest)
    with PullState.open(state, dest, "local:guest") as st:
        assert st.has_baseline()
    with PullState.open(state, dest, "ssh://other/ws") as st:
        assert not st.has_baseline()
    res = pull(state, guest, dest, key="ssh://other/ws")
    assert b"a.txt" in res.fetched  # everything again
    exact(guest, dest)


def test_damaged_state_starts_afresh(env: tuple[Path, Path, Path]) -> None:
    state, guest, dest = env
    pull(state, guest, dest)
    path = state_path(state, dest)
    path.write_bytes(b"this is not a database" * 100)
    with PullState.open(state, dest, "local:guest") as st:
        assert not st.has_baseline()
    pull(state, guest, dest)
    exact(guest, dest)
    with PullState.open(state, dest, "local:guest") as st:
        assert st.has_baseline()
        st.forget()
    assert not path.exists()


def test_a_torn_state_file_is_set_aside(env: tuple[Path, Path, Path]) -> None:
    """Damaged pages behind a valid header: quick_check catches it, a full pull follows."""
    state, guest, dest = env
    pull(state, guest, dest)
    path = state_path(state, dest)
    data = bytearray(path.read_bytes())
    assert len(data) >= 3 * 4096
    for page in range(4096, len(data), 4096):  # every table page, headers left alone
        data[page + 8 : page + 4000] = os.urandom(3992)
    path.write_bytes(bytes(data))
    with PullState.open(state, dest, "local:guest") as st:
        assert not st.has_baseline()
    assert b"a.txt" in pull(state, guest, dest).fetched
    exact(guest, dest)


def _load(tmp_path: Path, entries: list[Entry]) -> PullState:
    st = PullState.open(tmp_path / "state", tmp_path / "d", "k")
    st.load_manifest(entries, Excludes.none())
    return st


ROOT = Entry(b".", "d", 0o755, 0, 1, 1, 1, b"")


@pytest.mark.parametrize("bad", [b"../x", b"/abs", b"a//b", b"a/./b", b"a/../b", b"", b"a\0b"])
def test_hostile_manifest_paths_are_refused(tmp_path: Path, bad: bytes) -> None:
    with pytest.raises(HostileArchive):
        _load(tmp_path, [ROOT, Entry(bad, "f", 0o644, 1, 1, 1, 2, b"")])


def test_manifest_longer_than_the_limit_is_refused(tmp_path: Path) -> None:
    many = [ROOT] + [Entry(b"d%d" % i, "d", 0o755, 0, 1, 1, 2 + i, b"") for i in range(10)]
    st = PullState.open(tmp_path / "state", tmp_path / "d", "k")
    with pytest.raises(LimitExceeded):
        st.load_manifest(many, Excludes.none(), max_entries=10)
    st.load_manifest(many, Excludes.none(), max_entries=11)
    st.close()


def test_manifest_without_root_fails(tmp_path: Path) -> None:
    with pytest.raises(StagingFailed):
        _load(tmp_path, [Entry(b"a", "f", 0o644, 1, 1, 1, 2, b"")])


def test_orphans_and_sockets_are_dropped(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    entries = [
        ROOT,
        Entry(b"f", "f", 0o644, 1, 1, 1, 2, b""),
        Entry(b"f/under-a-file", "f", 0o644, 1, 1, 1, 3, b""),
        Entry(b"gone/a/b/c", "f", 0o644, 1, 1, 1, 4, b""),
        Entry(b"sock", "s", 0o755, 0, 1, 1, 5, b""),
        Entry(b"dir", "d", 0o755, 0, 1, 1, 6, b""),
        Entry(b"dir/x", "f", 0o644, 1, 1, 1, 7, b""),
    ]
    with _load(tmp_path, entries) as st:
        fd = os.open(tmp_path / "d", os.O_RDONLY | os.O_DIRECTORY)
        try:
            d = st.diff(fd)
        finally:
            os.close(fd)
        assert list(d.fetch_paths()) == [b"dir/x", b"f"]
        assert list(d.keep()) == [(b"dir", "d")]
        assert [x.path for x in d.dirs()] == [b"dir", b"."]


def test_a_deep_chain_of_orphans_costs_a_pass_not_a_pass_per_level(tmp_path: Path) -> None:
    """A hostile listing of nested directories under one that is not listed (``x/a``,
    ``x/a/a``, ... a few KiB compressed): the orphans went one level per full pass over
    the table, passes times rows times path length (3,000 levels: 80 s of one
    uninterruptible SQL loop; 10,000: hours).  Counted in SQLite's VM steps, not time:
    linear is a few dozen steps per entry, the old loop two thousand at this depth."""
    depth = 1000
    entries, path = [ROOT], b"x"
    for i in range(depth):
        path += b"/a"
        entries.append(Entry(path, "d", 0o755, 0, 1, 1, 2 + i, b""))
    entries.append(Entry(b"kept", "d", 0o755, 0, 1, 1, 1 + 2 * depth, b""))
    entries.append(Entry(b"kept/f", "f", 0o644, 1, 1, 1, 2 + 2 * depth, b""))
    st = PullState.open(tmp_path / "state", tmp_path / "d", "k")
    steps = 0

    def tick() -> int:
        nonlocal steps
        steps += 1
        return 0

    st.db.set_progress_handler(tick, 1000)
    try:
        st.load_manifest(entries, Excludes.none())
        st.db.set_progress_handler(None, 0)
        rows = st.db.execute("SELECT path FROM s.man ORDER BY path").fetchall()
    finally:
        st.close()
    assert [r[0] for r in rows] == [b".", b"kept", b"kept/f"]
    assert steps * 1000 < 200 * depth, f"{steps}k VM steps for {depth} nested orphans"


class _LongTargets(io.RawIOBase):
    """A guest's manifest stream: the root, then ``count`` symlinks whose targets are 64
    KiB each, made as read (``records`` counts those read so far)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.records = 0
        self.pending = b". 0\0.\0\0".replace(b". 0", b"d 755 0 1 1 1")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not self.pending and self.records < self.count:
            self.records += 1
            self.pending = b"l 777 0 1 1 %d\0./l%06d\0%s\0" % (
                1 + self.records,
                self.records,
                b"t" * 65536,
            )
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n


def test_a_listing_of_long_targets_keeps_the_scratch_disks_reserve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing is bounded in entries, not in bytes: a hostile ``find`` lists symlinks
    with 64 KiB targets (a few KiB compressed), and every byte lands in the scratch table,
    on the disk of SQLite's temporary directory: 5M entries (the default --max-files) are
    320 GB.  That disk is already below the reserve here; the load stops after about 64
    MiB of rows, never writing the whole 128 MiB."""
    tmp = tmp_path / "sqlite-tmp"
    tmp.mkdir()
    monkeypatch.setenv("SQLITE_TMPDIR", str(tmp))
    st = os.statvfs(tmp)
    reserve = st.f_bavail * st.f_frsize + (1 << 30)
    opts = PullOptions(state_dir=tmp_path / "state", limits=ExtractLimits(min_free_bytes=reserve))
    (tmp_path / "dest").mkdir()
    inc = Incremental(opts, DestDir.open(tmp_path / "dest"), "k", HashLog(tmp_path / "h"))
    listing = _LongTargets(2048)
    try:
        with pytest.raises(DiskLow, match="free-space reserve"):
            inc.load(io.BufferedReader(listing, 1 << 20))
    finally:
        inc.close()
    assert listing.records <= 1100


def test_itemize_escapes_odd_bytes(env: tuple[Path, Path, Path]) -> None:
    state, guest, dest = env
    res = pull(state, guest, dest)
    lines = res.lines
    assert ">f+++++++++ odd-\\#377\\#012 name" in lines
    assert all("\n" not in line for line in lines)
    assert "cd+++++++++ src/" in lines
    assert "cL+++++++++ link -> a.txt" in lines


def test_escape_of_any_name_is_one_printable_line_that_tells_names_apart() -> None:
    import random

    rng = random.Random(8)
    pieces = [b"a", b"Z", b"/", b" ", b"\\", b"#", b"\n", b"\x7f", b"\xff", b"\xc3\xa9",
              b"\xe2\x80\xae", b"\xf0\x9f\x98\x80", b"\xc3", b"\xed\xa0\x80", b"\x00"]  # fmt: skip
    names = {b"", b"plain/ascii name.txt", b"caf\xc3\xa9", b"back\\slash", b"\xff"}
    names |= {b"".join(rng.choices(pieces, k=rng.randrange(1, 12))) for _ in range(3000)}
    shown = {}
    for name in names:
        text = escape(name)
        # the shortcut for a name printable as a whole gives what the rule gives
        assert text == _escape_each(name.decode("utf-8", "surrogateescape")), name
        assert text.isprintable() and "\n" not in text
        assert shown.setdefault(text, name) == name  # two names never print the same
    assert escape("caf\xe9 \u202e".encode()) == "caf\xe9 \\#342\\#200\\#256"


def test_scratch_tables_live_outside_the_state_file(env: tuple[Path, Path, Path]) -> None:
    """The durable file holds only the recorded tree: a dry-run writes nothing to it."""
    state, guest, dest = env
    pull(state, guest, dest)
    path = state_path(state, dest)
    before = path.read_bytes()
    with PullState.open(state, dest, "local:guest") as st:
        (guest / "a.txt").write_text("x\n")
        st.load_manifest(manifest(guest), Excludes.none())
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert not st.diff(fd).nothing_to_do
        finally:
            os.close(fd)
    assert path.read_bytes() == before
    tables = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master")}
    assert tables <= {"meta", "state", "records", "sqlite_autoindex_meta_1"}


def test_a_commit_that_fails_midway_keeps_the_old_baseline(
    env: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state moves in one SQLite transaction: a failure (or kill -9) leaves the old one."""
    from wsync.engine import hostscan

    state, guest, dest = env
    pull(state, guest, dest)
    with PullState.open(state, dest, "local:guest") as st:
        before = st.db.execute("SELECT * FROM main.state ORDER BY path").fetchall()
        (guest / "a.txt").write_text("changed\n")
        st.load_manifest(manifest(guest), Excludes.none())
        real = hostscan.scan

        def failing(fd: int):  # type: ignore[no-untyped-def]
            for i, item in enumerate(real(fd)):
                if i == 5:
                    raise OSError(5, "Input/output error")
                yield item

        monkeypatch.setattr(hostscan, "scan", failing)
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(HostIOError):
                st.commit(fd, {})
        finally:
            os.close(fd)
        assert st.db.execute("SELECT * FROM main.state ORDER BY path").fetchall() == before
        assert st.has_baseline()


def test_a_host_edit_of_a_kept_file_during_the_pull_is_fetched_next_time(
    env: tuple[Path, Path, Path],
) -> None:
    """The host edits DEST while a pull transfers (an editor saving, a chmod): the commit
    scans DEST again after the old tree is gone, and used to record what it found beside
    the hash the diff had verified, so every later pull took the edit for the guest's."""
    state, guest, dest = env
    pull(state, guest, dest)
    (guest / "a.txt").write_text("changed in the guest\n")  # something to pull

    def host_at_work() -> None:
        with open(dest / "same.txt", "ab") as f:  # kept by this pull: linked, not fetched
            f.write(b"host edit\n")
        (dest / "tool.sh").chmod(0o600)
        # a name replaced in the old tree only: the new one holds the linked inode
        os.unlink(dest / "src" / "pkg" / "mod.py")
        (dest / "src" / "pkg" / "mod.py").write_text("replaced\n")

    during = pull(state, guest, dest, during=host_at_work)
    assert b"same.txt" not in during.fetched  # the edit came after the diff
    assert (dest / "src" / "pkg" / "mod.py").read_text() == "x = 1\n"
    after = pull(state, guest, dest)
    assert set(after.fetched) == {b"same.txt", b"tool.sh"}
    exact(guest, dest)
    assert pull(state, guest, dest).diff.nothing_to_do


def test_hardlinks_made_or_broken_on_the_host_are_repaired(tmp_path: Path) -> None:
    """An inode the host put under a name is verified by content only when it is alone:
    linked to another name (in DEST or outside) it is fetched, and a guest hardlink group
    split on the host is fetched whole.  Before, all four were kept as re-hashed."""
    guest, state, dest = tmp_path / "guest", tmp_path / "state", tmp_path / "dest"
    guest.mkdir()
    for name in ("a", "b"):
        (guest / name).write_text("same\n")
    (guest / "c").write_text("linked\n")
    os.link(guest / "c", guest / "d")
    (guest / "e").write_text("alone\n")
    outside = tmp_path / "outside"
    outside.write_text("alone\n")
    pull(state, guest, dest)
    exact(guest, dest)
    os.unlink(dest / "b")
    os.link(dest / "a", dest / "b")  # two separate files joined
    copy = (dest / "d").read_bytes()
    os.unlink(dest / "d")
    (dest / "d").write_bytes(copy)  # a linked pair split
    os.unlink(dest / "e")
    os.link(outside, dest / "e")  # the same bytes, an inode shared with a file outside
    res = pull(state, guest, dest)  # (this helper copies files one by one: see the e2e test)
    assert set(res.fetched) == {b"b", b"c", b"d", b"e"}
    exact(guest, dest)
    assert os.stat(dest / "e").st_nlink == 1 and os.stat(outside).st_nlink == 1


def test_a_full_disk_under_the_hash_log_is_a_host_write_error() -> None:
    """The extractor's hash log lies in the state directory; a red team filled that
    (ENOSPC) and got "internal error: OSError" (exit 1) instead of exit 8.  /dev/full
    fails every write with ENOSPC, as a full filesystem does."""
    from wsync.engine.incremental import HashLog

    log = HashLog(Path("/dev/full"))
    log.start()
    with pytest.raises(HostIOError, match="No space left on device") as info:
        for i in range(10_000):  # past the file's buffer, or at the latest its close
            log.add(f"f{i}".encode(), "0" * 32, (i, 0o100644, 1, 0))
        log.close()
    assert info.value.exit_code == 8


@pytest.mark.parametrize("hold", [100_000, 2])
def test_dest_is_scanned_beside_the_manifest_load(
    env: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch, hold: int
) -> None:
    """The manifest's load holds the state's lock (``Incremental.busy``) for its whole run.
    DEST's scan held it too, for its whole walk, so the load waited for the walk instead of
    running beside it.  A scan that fits in memory (HOLD rows) now never takes the lock;
    a larger one takes it only to write its rows, and the diff is the same either way."""
    state, guest, dest = env
    pull(state, guest, dest)
    (guest / "a.txt").write_bytes(b"an edit\n")
    (dest / "new-on-host").write_bytes(b"x")
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with PullState.open(state, dest, "local:guest") as st:  # the scan inside the diff
            st.load_manifest(manifest(guest), Excludes(()))
            ref = st.diff(fd)
            expected = (ref.changed, ref.deleted, list(ref.fetch_paths()))
        assert expected[1:] == (1, [b"a.txt", b"hard.txt"])  # (a.txt has a second name)
        monkeypatch.setattr(incstate, "HOLD", hold)
        monkeypatch.setattr(incstate, "BATCH", min(hold, incstate.BATCH))
        opts = PullOptions(state_dir=state)
        inc = Incremental(opts, DestDir.open(dest), "local:guest", HashLog(state / "h"))
        try:
            scanned = threading.Event()
            scanner = threading.Thread(target=lambda: (inc.scan(), scanned.set()))
            with inc.busy:  # the load, still running
                scanner.start()
                # (a scan that must write cannot finish while the lock is held)
                under_load = scanned.wait(30 if hold > 100 else 0.5)
            assert scanned.wait(60)
            scanner.join()
            assert under_load == (hold > 100), "the scan of a small tree waited for the load"
            inc.state.load_manifest(manifest(guest), Excludes(()))
            got = inc.state.diff(fd)
            assert (got.changed, got.deleted, list(got.fetch_paths())) == expected
        finally:
            inc.close()
    finally:
        os.close(fd)


def test_a_scan_stopped_while_it_ran_publishes_nothing(env: tuple[Path, Path, Path]) -> None:
    """A scan the pull no longer needs is stopped and left to end in its thread (found by
    a review: since the scan walks without the state's lock, one that ended after the
    pull went on could hand its rows to a diff of another tree, a full pull's empty one).
    It publishes its rows and digest at its end only if it was not stopped by then."""
    state, guest, dest = env
    pull(state, guest, dest)
    opts = PullOptions(state_dir=state)
    inc = Incremental(opts, DestDir.open(dest), "local:guest", HashLog(state / "h"))
    try:
        failed: list[BaseException] = []

        def scan() -> None:
            try:
                inc.scan()
            except BaseException as exc:  # (kept for the assertion below)
                failed.append(exc)

        inc.stop()  # (before it ends: a tree this small is not looked at midway)
        scanner = threading.Thread(target=scan)
        scanner.start()
        scanner.join(60)
        assert not scanner.is_alive()
        assert [type(e).__name__ for e in failed] == ["Interrupted"]
        assert inc.state.held_scan() is None and inc.host_digest == ""
    finally:
        inc.close()
