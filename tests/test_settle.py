"""Files that change while the guest reads them (issue 7 item 5, docs/design.md, guarantee 8).

Every file in DEST must be a version that existed in the guest: a file written while tar
read it is read again until it settles, or the pull fails with exit 24 naming it (or, with
``best_effort``, takes it as last read and lists it).  The deterministic tests put a writer
at exact points around the guest's real ``tar`` with a wrapper script; the racing tests run
a real writer thread against a real pull.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from extract_helpers import DIR, SYM, build, extract, make_root, member, snapshot
from helpers import (
    assert_exact,
    busybox_bin,
    local,
    make_tree,
    options,
    run_pull,
    writer_around_tar,
)
from wsync.engine.settle import remove_gone
from wsync.errors import HostileArchive, UnstableFiles


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = make_tree(tmp_path / "ws", big=256 * 1024, small=20)
    (ws / "log.txt").write_text("first\n")
    (ws / "doomed.txt").write_text("here for now\n")
    return ws


def test_a_file_torn_by_a_writer_is_read_again(tmp_path: Path, workspace: Path) -> None:
    """The first read sees a half-written version; the file is read again once settled."""
    transport = writer_around_tar(
        tmp_path,
        'if [ $N = 1 ]; then printf TORN > "$WS/log.txt"; fi\n'
        'real_tar "$@"; rc=$?\n'
        'if [ $N = 1 ]; then printf "FINAL\\n" > "$WS/log.txt"; fi\n'
        "exit $rc",
    )
    dest = tmp_path / "out"
    result = run_pull(transport, workspace, dest, options(tmp_path))
    assert (dest / "log.txt").read_text() == "FINAL\n"
    assert_exact(workspace, dest)
    assert result.unstable_files == []
    assert int((tmp_path / "tar-count").read_text()) == 2  # one re-read round


def test_a_file_that_never_settles_fails_with_exit_24(tmp_path: Path, workspace: Path) -> None:
    transport = writer_around_tar(
        tmp_path, 'real_tar "$@"; rc=$?\necho "write $N" >> "$WS/log.txt"\nexit $rc'
    )
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep").write_text("old tree\n")
    opts = options(tmp_path, force=True)
    with pytest.raises(UnstableFiles, match=r"log\.txt") as info:
        run_pull(transport, workspace, dest, opts)
    assert info.value.exit_code == 24
    assert sorted(p.name for p in dest.iterdir()) == ["keep"]  # DEST untouched
    assert int((tmp_path / "tar-count").read_text()) == 4  # the first read and 3 re-reads
    # the snapshot that failed is not resumed: the guest staging is gone at once
    assert list(Path(opts.staging_root).glob("s*")) == []


def test_best_effort_takes_the_last_read_and_lists_it(tmp_path: Path, workspace: Path) -> None:
    transport = writer_around_tar(
        tmp_path, 'real_tar "$@"; rc=$?\necho "write $N" >> "$WS/log.txt"\nexit $rc'
    )
    dest = tmp_path / "out"
    result = run_pull(transport, workspace, dest, options(tmp_path, best_effort=True))
    assert result.unstable_files == ["log.txt"]
    # the last read happened before the last write: a version that existed
    assert (dest / "log.txt").read_text() == "first\nwrite 1\nwrite 2\nwrite 3\n"
    assert any("kept changing" in w for w in result.warnings)


def test_a_file_that_vanishes_after_a_torn_read_is_not_kept(
    tmp_path: Path, workspace: Path
) -> None:
    """Changed during the first read, gone before the second: DEST must not keep the torn
    first version; the guest no longer has any."""
    transport = writer_around_tar(
        tmp_path,
        'if [ $FOLLOW = 1 ]; then rm -f "$WS/doomed.txt"; fi\n'
        'real_tar "$@"; rc=$?\n'
        'if [ $N = 1 ]; then echo torn >> "$WS/doomed.txt"; fi\n'
        "exit $rc",
    )
    dest = tmp_path / "out"
    result = run_pull(transport, workspace, dest, options(tmp_path))
    assert not (dest / "doomed.txt").exists()
    assert_exact(workspace, dest)
    assert any("vanished" in w and "doomed.txt" in w for w in result.warnings)


def test_busybox_guest_cannot_reread_so_it_fails_clearly(tmp_path: Path, workspace: Path) -> None:
    bb = busybox_bin(tmp_path / "bb")
    transport = writer_around_tar(
        tmp_path,
        'real_tar "$@"; rc=$?\nif [ $N = 1 ]; then echo more >> "$WS/log.txt"; fi\nexit $rc',
        tar=str(bb / "tar"),
    )
    with pytest.raises(UnstableFiles, match=r"log\.txt"):
        run_pull(transport, workspace, tmp_path / "out", options(tmp_path, compressor="gzip"))
    assert not (tmp_path / "out").exists()


_WRITER = """
import os, sys
target, a, b = sys.argv[1], os.urandom(4 << 20), bytes(4 << 20)
n = 0
while True:
    with open(target, "wb") as f:  # truncate, then two writes (each grows it page by page)
        v = (a, b)[n % 2]
        f.write(v[: 1 << 20])
        f.write(v[1 << 20 :])
    n += 1
"""


@pytest.fixture
def racing_writer(workspace: Path) -> Iterator[Path]:
    """A real writer process that rewrites a 4 MiB file without pause (its own process, so
    it races the guest's tar whatever the test process is doing)."""
    target = workspace / "busy.bin"
    target.write_bytes(bytes(4 << 20))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(target)])
    yield target
    proc.kill()
    proc.wait(timeout=30)


def test_a_real_racing_writer_is_exact_or_fails_naming_the_file(
    tmp_path: Path, workspace: Path, racing_writer: Path
) -> None:
    """Exact or a clear failure, never a torn file: nearly always the file never settles
    (exit 24); should a loaded machine starve the writer for a whole round, the file was
    read while still, so DEST holds one of the states the writer left it in."""
    dest = tmp_path / "out"
    try:
        run_pull(local(), workspace, dest, options(tmp_path))
    except UnstableFiles as exc:
        assert "busy.bin" in str(exc)
        assert not dest.exists()
        return
    data = (dest / "busy.bin").read_bytes()
    # a state the writer left it in: a write of megabytes grows the file page by page, so
    # a writer starved mid-write leaves a length between its writes' ends (a fresh-clone CI
    # run saw 2 MiB of the zeros), never more than the whole
    assert len(data) <= 4 << 20
    assert data in (b"", bytes(len(data))) or data.count(0) < len(data) // 2


def test_cli_exit_24_and_best_effort_json(tmp_path: Path, workspace: Path) -> None:
    bindir = tmp_path / "wrapped-tar"
    writer_around_tar(tmp_path, 'real_tar "$@"; rc=$?\necho "write $N" >> "$WS/log.txt"\nexit $rc')
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    dest = tmp_path / "out"
    base = [sys.executable, "-m", "wsync", "pull", f"local:{workspace}", str(dest)]
    base += ["--state-dir", str(tmp_path / "state"), "--staging-dir", str(tmp_path / "stg")]
    proc = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 24, proc.stderr
    failed = json.loads(proc.stdout)
    assert failed["error_kind"] == "unstable" and "log.txt" in failed["error"]
    proc = subprocess.run(
        [*base, "--json", "--best-effort"], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["unstable_files"] == ["log.txt"]


# -- the host side: later archives of the stream, the gone list --------------------------------


def test_a_later_archive_replaces_what_it_read_again(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    first = build(
        member("d", DIR, mode=0o755),
        member("d/f", data=b"torn"),
        member("d/l", SYM, link="f"),
        member("g", data=b"stays"),
    )
    again = build(
        member("d", DIR, mode=0o700),
        member("d/f", data=b"settled", mode=0o600),
        member("d/l", SYM, link="../g"),
        member("n", DIR),
        member("n/new", data=b"created while read"),
    )
    stats = extract(first + again, root)
    got = snapshot(root)
    assert (root / "d" / "f").read_bytes() == b"settled"
    assert got[b"d/f"][1] == 0o600 and got[b"d"][1] == 0o700
    assert os.readlink(root / "d" / "l") == "../g"
    assert (root / "n" / "new").read_bytes() == b"created while read"
    assert (root / "g").read_bytes() == b"stays"
    assert sorted(os.listdir(root / "d")) == ["f", "l"]  # no temporary names left
    assert (stats.files, stats.symlinks) == (3, 1)  # replacements are not new files


def test_a_later_archive_cannot_put_a_file_over_a_directory(tmp_path: Path) -> None:
    """Refused, the directory left whole: the workspace changed while read (``rm -rf d &&
    touch d``), exit 24 and run again, not a hostile archive."""
    root = make_root(tmp_path)
    first = build(member("d", DIR), member("d/x", data=b"x"))
    with pytest.raises(UnstableFiles, match="a directory, then a non-directory"):
        extract(first + build(member("d", data=b"file now")), root)
    assert (root / "d" / "x").read_bytes() == b"x"


def test_a_later_archive_is_confined_like_the_first(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    first = build(member("s", SYM, link=str(tmp_path)))
    with pytest.raises(HostileArchive):
        extract(first + build(member("s/sentinel", data=b"overwritten")), root)
    assert (tmp_path / "sentinel").read_text() == "outside"


def test_gone_names_are_removed_without_following_links(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    extract(
        build(
            member("d", DIR),
            member("d/f", data=b"f"),
            member("d/sub", DIR),
            member("d/sub/x", data=b"x"),
            member("e", DIR),
            member("e/y", data=b"y"),
            member("link", SYM, link="e"),
            member("keep", data=b"k"),
        ),
        root,
    )
    names = [b"d/f", b"d/sub", b"link/y", b"../sentinel", b"missing/x", b"d/nothing"]
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert remove_gone(fd, names) == 2
    finally:
        os.close(fd)
    assert sorted(os.listdir(root)) == ["d", "e", "keep", "link"]
    assert os.listdir(root / "d") == [] and os.listdir(root / "e") == ["y"]
    assert (tmp_path / "sentinel").read_text() == "outside"


def test_gone_names_leave_their_directory_as_the_archive_made_it(tmp_path: Path) -> None:
    """The extractor has already set the final directory modes and mtimes: removing a gone
    name from a read-only directory works and puts both back."""
    root = make_root(tmp_path)
    extract(build(member("ro", DIR, mode=0o555), member("ro/f", data=b"torn")), root)
    before = os.stat(root / "ro")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert remove_gone(fd, [b"ro/f"]) == 1
    finally:
        os.close(fd)
    after = os.stat(root / "ro")
    assert os.listdir(root / "ro") == []
    assert (after.st_mode & 0o7777, after.st_mtime_ns) == (0o555, before.st_mtime_ns)


def test_a_torn_file_that_vanished_before_the_next_look_is_not_kept(
    tmp_path: Path, workspace: Path
) -> None:
    """Written while read, then renamed away within milliseconds (an editor's temp file):
    no later ``find`` sees it, but tar named it, so it is left out of DEST."""
    (workspace / "x.tmp").write_text("half written")
    transport = writer_around_tar(
        tmp_path,
        'real_tar "$@"; rc=$?\n'
        "if [ $N = 1 ]; then\n"
        '  echo "tar: ./x.tmp: file changed as we read it" >&2; rm -f "$WS/x.tmp"; rc=1\n'
        "fi\n"
        "exit $rc",
    )
    dest = tmp_path / "out"
    result = run_pull(transport, workspace, dest, options(tmp_path))
    assert not (dest / "x.tmp").exists()
    assert_exact(workspace, dest)
    assert any("vanished" in w and "x.tmp" in w for w in result.warnings)


#: names GNU tar gives only in its escape quoting (C locale): a colon, bytes that are not
#: ASCII, a backslash, a tab, a newline, and a ``%`` that printf must not read as a format
ESCAPED = [
    "log:12.txt",
    "r\u00e9sum\u00e9.txt",
    "back\\slash",
    "tab\tname",
    "new\nline",
    "100%s.txt",
]


def _torn_once(then: str, when: str = "[ $N = 1 ]") -> str:
    """A tar wrapper whose first read (or each read ``when`` holds) tears ``$NAME``: it
    warns as real tar does (its own quoting of the name, from a real tar's message about
    a missing file) and then does ``then`` to the file (``$F``) before the next look."""
    return (
        'real_tar "$@"; rc=$?\n'
        f"if {when}; then\n"
        '  F="$WS/$NAME"\n'
        '  m=$(cd "$WS" && LC_ALL=C real_tar --no-unquote -cf /dev/null "./$NAME.none" 2>&1 | sed -n 1p)\n'
        "  m=${m%.none: Cannot stat: No such file or directory}\n"
        "  printf '%s: file changed as we read it\\n' \"$m\" >&2\n"
        f"  {then}; rc=1\n"
        "fi\n"
        "exit $rc"
    )


@pytest.mark.parametrize("name", ESCAPED, ids=lambda n: ascii(n).strip("'"))
def test_a_torn_file_named_escaped_that_settles_is_taken(
    tmp_path: Path, workspace: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tar names a torn file in its escape quoting: the guest undoes it, so a file whose
    re-read settled is taken as for any other name (before: listed unstable, exit 24)."""
    (workspace / name).write_text("half written")
    monkeypatch.setenv("NAME", name)
    transport = writer_around_tar(tmp_path, _torn_once('echo settled >> "$F"'))
    dest = tmp_path / "out"
    result = run_pull(transport, workspace, dest, options(tmp_path))
    assert int((tmp_path / "tar-count").read_text()) == 2  # read again once
    assert (dest / name).read_text() == "half writtensettled\n"
    assert_exact(workspace, dest)
    assert result.unstable_files == []
    assert not any("kept changing" in w or "vanished" in w for w in result.warnings)


@pytest.mark.parametrize("name", ESCAPED, ids=lambda n: ascii(n).strip("'"))
def test_a_torn_file_named_escaped_that_vanished_is_not_kept(
    tmp_path: Path, workspace: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Torn and then removed: the name tar gave, undone, is gone, so DEST leaves it out
    (before: listed unstable, exit 24, though the guest could tell)."""
    (workspace / name).write_text("half written")
    monkeypatch.setenv("NAME", name)
    transport = writer_around_tar(tmp_path, _torn_once('rm -f "$F"'))
    dest = tmp_path / "out"
    result = run_pull(transport, workspace, dest, options(tmp_path))
    assert not (dest / name).exists()
    assert_exact(workspace, dest)
    assert any("vanished" in w for w in result.warnings)


def test_an_escaped_name_that_never_settles_is_listed_once(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Torn in every read: with ``best_effort`` it is taken as last read and listed once,
    by its name (before: twice, also in tar's quoting)."""
    name = "r\u00e9sum\u00e9:final.txt"
    (workspace / name).write_text("first\n")
    monkeypatch.setenv("NAME", name)
    transport = writer_around_tar(tmp_path, _torn_once('echo "write $N" >> "$F"', when="true"))
    dest = tmp_path / "out"
    result = run_pull(transport, workspace, dest, options(tmp_path, best_effort=True))
    assert result.unstable_files == [name]
    assert (dest / name).read_text() == "first\nwrite 1\nwrite 2\nwrite 3\n"


def test_a_torn_name_that_is_no_quoting_tar_gives_fails_naming_it(
    tmp_path: Path, workspace: Path
) -> None:
    """A name in tar's warning that undone and quoted again is not what tar gave (``\\q``
    is no escape of tar's, and an older tar may quote otherwise): the guest cannot tell
    which file it was, so it is unstable and the pull fails naming it (exit 24) rather
    than keep a torn file."""
    transport = writer_around_tar(
        tmp_path,
        'real_tar "$@"; rc=$?\n'
        "if [ $N = 1 ]; then\n"
        "  printf '%s\\n' 'tar: ./ghost\\qname: file changed as we read it' >&2; rc=1\n"
        "fi\n"
        "exit $rc",
    )
    dest = tmp_path / "out"
    with pytest.raises(UnstableFiles, match="ghost") as info:
        run_pull(transport, workspace, dest, options(tmp_path))
    assert info.value.exit_code == 24
    assert not dest.exists()


def test_a_shrunk_and_vanished_file_named_escaped_is_not_kept(
    tmp_path: Path, workspace: Path
) -> None:
    """tar's other warning of a torn read (a file that shrank), of a name it can give only
    escaped: the guest undoes the quoting, finds the file gone, and DEST leaves it out
    (before the guest could undo it, the pull failed with exit 24 naming it)."""
    (workspace / "odd\\name.tmp").write_text("half written")
    transport = writer_around_tar(
        tmp_path,
        'real_tar "$@"; rc=$?\n'
        "if [ $N = 1 ]; then\n"
        "  printf '%s\\n' 'tar: ./odd\\\\name.tmp: File shrank by 3 bytes; padding with zeros' >&2\n"
        '  rm -f "$WS/odd\\\\name.tmp"; rc=1\n'
        "fi\n"
        "exit $rc",
    )
    dest = tmp_path / "out"
    result = run_pull(transport, workspace, dest, options(tmp_path))
    assert not (dest / "odd\\name.tmp").exists()
    assert_exact(workspace, dest)
    assert any("vanished" in w and "odd" in w for w in result.warnings)
