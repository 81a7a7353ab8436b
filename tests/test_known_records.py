"""Known records (wsync.protocol.manifest, PullState.known): a manifest record the last pull
read byte for byte is copied from the state instead of parsed again, and the load must be
the very load a parse of every record gives.  Real guest listings (GNU find, as the
producer runs it), real trees, the real state."""

from __future__ import annotations

import io
import os
import random
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from incr_helpers import OPTIONS, listing, pull
from wsync.engine import incstate
from wsync.engine.api import PullOptions
from wsync.engine.destdir import DestDir
from wsync.engine.excludes import Excludes
from wsync.engine.incremental import HashLog, Incremental, read_manifest
from wsync.engine.incstate import PullState, state_path
from wsync.errors import LimitExceeded, UnstableFiles
from wsync.protocol.manifest import Entry, Known, ManifestParser, fingerprint
from wsync.treediff import diff as treediff

RECORDS = [
    (b"d 755 4096 1796108389.0447479200 1796108389.0447479200 2173675", b".", b""),
    (b"f 644 3 1796108389.5 1796108389.5 2173676", b"./a", b""),
    (b"l 777 1 1796108389.0 1796108389.0 2173678", b"./l", b"a\nb"),
    (b"f 600 0 -2.5 0 0", b"./d/\xff\nx", b""),
]
DATA = b"".join(b"\0".join(r) + b"\0" for r in RECORDS)


def feed(parser: ManifestParser, chunks: list[bytes]) -> list[Entry]:
    out: list[Entry] = []
    for chunk in chunks:
        parser.receive_data(chunk)
        out += parser.entries()
    parser.receive_eof()
    return out + parser.entries()


@pytest.mark.parametrize("step", [len(DATA), 1, 7])
def test_the_parser_skips_known_records_fed_any_way(step: int) -> None:
    seen = fingerprint(*RECORDS[1])
    unlisted = fingerprint(b"f 644 1 1 1 1", b"./gone", b"")
    known = Known({seen, unlisted})
    parser = ManifestParser(known)
    entries = feed(parser, [DATA[i : i + step] for i in range(0, len(DATA), step)])
    assert [e.path for e in entries] == [b".", b"l", b"d/\xff\nx"]
    assert [e.record for e in entries] == [fingerprint(*RECORDS[i]) for i in (0, 2, 3)]
    assert known.matched == 1 and known.left == {unlisted}
    assert parser.count == 4
    # without known records nothing is fingerprinted: the entries are as before
    plain = feed(ManifestParser(), [DATA])
    assert [e.record for e in plain] == [b""] * 4
    assert [e._replace(record=b"") for e in feed(ManifestParser(Known(set())), [DATA])] == plain


def _man(state: PullState) -> list[tuple[object, ...]]:
    return state.db.execute("SELECT * FROM s.man ORDER BY path").fetchall()


def _loads(state_dir: Path, guest: Path, dest: Path) -> tuple[list[tuple[object, ...]], int]:
    """Load the guest's listing the way a pull does (known records copied), then again
    parsing every record; both loads must give the same table."""
    data = listing(guest)
    with PullState.open(state_dir, dest, "local:guest") as st:
        known = st.known(OPTIONS)
        st.load_manifest(feed(ManifestParser(known), [data]), Excludes.none(), known=known)
        fast, fast_kb = _man(st), st.listed_kb
        st.load_manifest(feed(ManifestParser(Known(set())), [data]), Excludes.none())
        assert _man(st) == fast
        assert st.listed_kb == fast_kb
    return fast, known.matched


def _mutate(root: Path, rng: random.Random) -> str:
    """One random change of the kinds a workspace sees between pulls."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    dirs = sorted(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())
    links = sorted(p for p in root.rglob("*") if p.is_symlink())
    what = rng.choice(
        ["append", "rewrite", "delete", "new", "mkdir", "rmdir", "rename", "chmod", "relink",
         "file-to-dir", "dir-to-file", "odd"]
    )  # fmt: skip
    if what == "append" and files:
        with rng.choice(files).open("a") as f:
            f.write("more\n")
    elif what == "rewrite" and files:  # same size, the mtime put back
        path = rng.choice(files)
        st = path.stat()
        path.write_bytes(bytes(b ^ 1 for b in path.read_bytes()))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif what == "delete" and files:
        rng.choice(files).unlink()
    elif what == "new":
        (rng.choice([root, *dirs]) / f"new{rng.randrange(10**6)}").write_text("new\n")
    elif what == "mkdir":
        (rng.choice([root, *dirs]) / f"dir{rng.randrange(10**6)}" / "sub").mkdir(parents=True)
    elif what == "rmdir" and dirs:
        shutil.rmtree(rng.choice(dirs))
    elif what == "rename" and dirs:
        path = rng.choice(dirs)
        path.rename(root / f"moved{rng.randrange(10**6)}")
    elif what == "chmod" and files:
        path = rng.choice(files)
        path.chmod(path.stat().st_mode ^ 0o111)
    elif what == "relink" and links:
        path = rng.choice(links)
        path.unlink()
        path.symlink_to(f"elsewhere{rng.randrange(100)}")
    elif what == "file-to-dir" and files:
        path = rng.choice(files)
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("x\n")
    elif what == "dir-to-file" and dirs:
        path = rng.choice(dirs)
        shutil.rmtree(path)
        path.write_text("was a dir\n")
    elif what == "odd":
        (root / os.fsdecode(b"odd-\xfe\n" + b"%d" % rng.randrange(100))).write_text("o\n")
    return what


def _tree(root: Path) -> Path:
    for d in range(4):
        sub = root / f"d{d}" / "deeper"
        sub.mkdir(parents=True)
        for f in range(5):
            (root / f"d{d}" / f"f{f}.txt").write_text(f"{d}/{f}\n")
            (sub / f"g{f}").write_text(f"deep {d}/{f}\n")
    (root / "link").symlink_to("d0/f0.txt")
    os.link(root / "d1" / "f1.txt", root / "hard")
    return root


@pytest.mark.parametrize("seed", range(6))
def test_known_records_load_what_a_full_parse_loads(tmp_path: Path, seed: int) -> None:
    """Random changes between pulls: each load with known records equals a parse of every
    record, most records are known, and every pull leaves DEST exactly the guest's."""
    rng = random.Random(seed)
    guest, dest, state = _tree(tmp_path / "guest"), tmp_path / "dest", tmp_path / "state"
    pull(state, guest, dest, parse=True)
    for _ in range(8):
        changes = [_mutate(guest, rng) for _ in range(rng.randrange(1, 4))]
        rows, matched = _loads(state, guest, dest)
        assert matched >= len(rows) // 2, changes  # a few changes leave most records known
        pull(state, guest, dest, parse=True)
        assert treediff(guest, dest) == [], changes


def test_an_unchanged_guest_is_all_known(tmp_path: Path) -> None:
    guest, dest, state = _tree(tmp_path / "guest"), tmp_path / "dest", tmp_path / "state"
    first = pull(state, guest, dest, parse=True)
    assert first.fetched
    rows, matched = _loads(state, guest, dest)
    assert matched == len(rows) == 1 + 4 * 2 + 4 * 5 * 2 + 2
    assert pull(state, guest, dest, parse=True).diff.nothing_to_do


def test_records_are_known_only_under_the_same_options(tmp_path: Path) -> None:
    guest, dest, state = _tree(tmp_path / "guest"), tmp_path / "dest", tmp_path / "state"
    pull(state, guest, dest, parse=True)
    with PullState.open(state, dest, "local:guest") as st:
        assert len(st.known(OPTIONS).left) == 51
        assert st.known("other excludes").left == set()
    with PullState.open(state, dest, "ssh://another/sandbox") as st:
        assert st.known(OPTIONS).left == set()


def test_a_large_state_parses_every_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    guest, dest, state = _tree(tmp_path / "guest"), tmp_path / "dest", tmp_path / "state"
    pull(state, guest, dest, parse=True)
    monkeypatch.setattr(incstate, "KNOWN_MAX", 50)
    with PullState.open(state, dest, "local:guest") as st:
        assert st.known(OPTIONS).left == set()
    monkeypatch.setattr(incstate, "KNOWN_MAX", 51)
    with PullState.open(state, dest, "local:guest") as st:
        assert len(st.known(OPTIONS).left) == 51


@pytest.mark.parametrize("known", [False, True])
@pytest.mark.parametrize("same_bytes", [False, True])
def test_a_path_listed_twice_is_refused(tmp_path: Path, known: bool, same_bytes: bool) -> None:
    """Either record may be the wrong one: the pull fails as for a file that changed while
    read (exit 24, run again), with known records or without, whichever comes first."""
    guest, dest, state = _tree(tmp_path / "guest"), tmp_path / "dest", tmp_path / "state"
    pull(state, guest, dest, parse=True)
    data = listing(guest)
    header = data[: data.index(b"\0./d0/f0.txt\0")].split(b"\0")[-1]
    twice = header if same_bytes else header.replace(b"f 644 ", b"f 600 ", 1)
    assert twice.startswith(b"f 6")
    extra = twice + b"\0./d0/f0.txt\0\0"
    for doubled in (data + extra, extra + data):
        with (
            PullState.open(state, dest, "local:guest") as st,
            pytest.raises(UnstableFiles, match="more than once"),
        ):
            read_manifest(
                io.BytesIO(doubled), st, Excludes.none(), 10**9, OPTIONS if known else "x"
            )


def test_the_entry_limit_counts_known_records(tmp_path: Path) -> None:
    guest, dest, state = _tree(tmp_path / "guest"), tmp_path / "dest", tmp_path / "state"
    pull(state, guest, dest, parse=True)
    data = listing(guest)
    with PullState.open(state, dest, "local:guest") as st:
        with pytest.raises(LimitExceeded):
            read_manifest(io.BytesIO(data), st, Excludes.none(), 50, OPTIONS)
        assert read_manifest(io.BytesIO(data), st, Excludes.none(), 51, OPTIONS) == 51


def test_a_state_of_an_older_wsync_keeps_its_baseline(tmp_path: Path) -> None:
    """A state written before records were kept (no ``records`` table): it is added, the
    baseline holds (no full pull), and every record is parsed once, then known."""
    guest, dest, state = _tree(tmp_path / "guest"), tmp_path / "dest", tmp_path / "state"
    pull(state, guest, dest, parse=True)
    with sqlite3.connect(state_path(state, dest)) as db:
        db.execute("DROP TABLE records")
        db.execute("DELETE FROM meta WHERE k = 'records'")
    with PullState.open(state, dest, "local:guest") as st:
        assert st.has_baseline()
        assert st.known(OPTIONS).left == set()
    (guest / "d2" / "f2.txt").write_text("changed\n")
    res = pull(state, guest, dest, parse=True)
    assert res.fetched == [b"d2/f2.txt"]
    assert treediff(guest, dest) == []
    rows, matched = _loads(state, guest, dest)
    assert matched == len(rows)


def test_an_older_wsyncs_commit_makes_the_records_stale(tmp_path: Path) -> None:
    """A rolled-back install commits the same file: its state rows and listing, not the
    records (it knows no such table).  Its rows may describe other records now, so none
    is known until the next commit of this wsync writes them again."""
    guest, dest, state = _tree(tmp_path / "guest"), tmp_path / "dest", tmp_path / "state"
    pull(state, guest, dest, parse=True)
    with sqlite3.connect(state_path(state, dest)) as db:
        # what an older wsync's commit of a later listing leaves: other rows, another key
        db.execute("UPDATE state SET mode = 448 WHERE path = x'64302f66302e747874'")
        db.execute("UPDATE meta SET v = 'a later listing' WHERE k = 'listing'")
    with PullState.open(state, dest, "local:guest") as st:
        assert st.has_baseline()
        assert st.known(OPTIONS).left == set()
    pull(state, guest, dest, parse=True)
    with PullState.open(state, dest, "local:guest") as st:
        assert len(st.known(OPTIONS).left) == 51


def test_a_pull_that_changes_nothing_keeps_the_records(tmp_path: Path) -> None:
    """A no-op pull writes a listing key of its own (the no-op record), and the records,
    which still describe the same rows, stay known with it."""
    guest, dest, state = _tree(tmp_path / "guest"), tmp_path / "dest", tmp_path / "state"
    pull(state, guest, dest, parse=True)
    with PullState.open(state, dest, "local:guest") as st:
        st.record_noop("key", "another listing", "a scan")
        assert len(st.known(OPTIONS).left) == 51


def test_sizes_past_64_bits_are_counted_exactly(tmp_path: Path) -> None:
    """The room a whole-tree run needs is the sum of what the guest claims, sizes past
    2**63 (kept as BLOBs) included, known or parsed."""
    huge = [2**63, 2**64 + 5, int.from_bytes(b"9e999999\x01", "little")]
    data = b"d 755 0 1 1 1\0.\0\0" + b"".join(
        b"f 644 %d 1 1 %d\0./f%d\0\0" % (size, i + 2, i) for i, size in enumerate(huge)
    )
    with PullState.open(tmp_path / "state", tmp_path / "dest", "k") as st:
        st.load_manifest(feed(ManifestParser(Known(set())), [data]), Excludes.none())
        assert st.listed_kb == -(-sum(huge) // 1024)


def test_records_read_under_other_rules_are_parsed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wsync that reads a record differently (tighter bounds, another ``check_path``)
    bumps RECORD_RULES: what an earlier one recorded is parsed again, never copied."""
    guest, dest, state = _tree(tmp_path / "guest"), tmp_path / "dest", tmp_path / "state"
    pull(state, guest, dest, parse=True)
    monkeypatch.setattr(incstate, "RECORD_RULES", "2")
    with PullState.open(state, dest, "local:guest") as st:
        assert st.known(OPTIONS).left == set()
    (guest / "d3" / "f3.txt").write_text("changed\n")
    pull(state, guest, dest, parse=True)  # a commit writes them under today's rules
    with PullState.open(state, dest, "local:guest") as st:
        assert len(st.known(OPTIONS).left) == 51


def _pull_cli(ws: Path, dest: Path, *extra: str) -> str:
    state = ["--state-dir", str(dest.parent / "state")]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "wsync",
            "pull",
            f"local:{ws}",
            str(dest),
            *state,
            "--debug",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert treediff(ws, dest) == []
    (line,) = [x for x in done.stderr.splitlines() if "manifest loaded" in x and "known=" in x]
    return line


def test_a_pull_copies_known_records_and_full_parses_everything(tmp_path: Path) -> None:
    """End to end: the second pull of a workspace copies what it knows, and ``--full``,
    which relies on nothing recorded, parses every record."""
    ws, dest = _tree(tmp_path / "ws"), tmp_path / "dest"
    assert "known=0 records=51" in _pull_cli(ws, dest)
    (ws / "d0" / "f0.txt").write_text("changed\n")
    assert "known=50 records=51" in _pull_cli(ws, dest)  # the file rewritten in place
    (ws / "d1" / "f1.txt").write_text("changed too\n")
    assert "known=0 records=51" in _pull_cli(ws, dest, "--full")
    # other excludes, other options: nothing is known (an excluded entry was never kept)
    assert "known=0 records=51" in _pull_cli(ws, dest, "--exclude", "*.nothing")


@pytest.mark.parametrize("use_known", [False, True])
def test_the_limit_stops_the_load_before_what_follows_it(tmp_path: Path, use_known: bool) -> None:
    """Known records count against the limit as they are met: past it, the load stops
    there with either route (a bad path after the limit is not reached)."""
    guest, dest, state = tmp_path / "g", tmp_path / "d", tmp_path / "s"
    guest.mkdir()
    (guest / "a").write_text("a")
    (guest / "b").write_text("b")
    pull(state, guest, dest, parse=True)
    data = listing(guest) + b"f 644 1 1 1 9\0./c\0\0f 644 1 1 1 9\0./a/../x\0\0"
    with PullState.open(state, dest, "local:guest") as st:
        known = st.known(OPTIONS) if use_known else Known(set())
        with pytest.raises(LimitExceeded):
            st.load_manifest(
                feed(ManifestParser(known), [data]), Excludes.none(), max_entries=3, known=known
            )


def test_the_scan_reads_the_known_records_ahead_of_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load's first step, reading the last pull's records (0.1-0.3 s on 59k entries),
    waited for the guest's listing to arrive; DEST's scan thread, which starts before the
    listing, now reads them first, and the load takes them (once: the parser uses them
    up).  Not after a pull that found nothing to do: the listing is then most likely not
    loaded at all."""
    guest, dest, state = _tree(tmp_path / "guest"), tmp_path / "dest", tmp_path / "state"
    pull(state, guest, dest, parse=True)
    (guest / "d0" / "f0.txt").write_bytes(b"an edit\n")
    monkeypatch.setattr(Incremental, "options_key", lambda self: OPTIONS)
    options, target = PullOptions(state_dir=state), DestDir.open(dest)
    inc = Incremental(options, target, "local:guest", HashLog(state / "h"))
    try:
        assert inc.recorded and not inc.noop_recorded
        inc.scan()
        ahead = inc._known
        assert ahead is not None and len(ahead.left) > 5
        inc.load(io.BytesIO(listing(guest)))
        assert inc._known is None
        assert ahead.matched == 1 + 4 * 2 + 4 * 5 * 2 + 2 - 1, "the load did not use them"
    finally:
        inc.close()
