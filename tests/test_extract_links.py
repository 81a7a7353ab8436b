"""Links are data (docs/design.md, guarantee 10; issue 7, item 6): targets verbatim, nothing through.

A symlink is stored exactly as the guest had it, wherever it points: a Python venv's absolute
``python3 -> /usr/bin/python3``, a relative link out of the workspace, a dangling one.  What
stays refused is every way an archive could *use* a link to write outside the root: a member
under a symlinked directory, a file, directory or symlink created over a symlink's name, a
hardlink through or to a symlink.  Each refusal is checked against the sentinel files around
the root (``outside``), which must not change, and the links' targets point at them.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from extract_helpers import (
    DIR,
    LNK,
    SYM,
    T0,
    build,
    extract,
    gnu_tar,
    make_root,
    member,
    outside,
    snapshot,
)
from wsync.errors import HostileArchive

Members = list[tuple[tarfile.TarInfo, bytes]]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path)


def make_venv_tree(src: Path) -> dict[str, str]:
    """A workspace shaped like a real project with a venv; returns its symlinks' targets."""
    links = {
        ".venv/bin/python3": "/usr/bin/python3",  # absolute, as `python3 -m venv` makes it
        ".venv/bin/python": "python3",
        ".venv/lib64": "lib",
        "data": "../../shared/datasets",  # relative, leaves the workspace
        "up": "..",
        "far-up": "../../../../../../../../etc",
        "dangling-abs": "/nonexistent/wsync/target",
        "chain/s": "../..",
        "chain/l": "s/../sentinel",  # climbs through another link: text looks harmless
        "odd\nname": "/tmp/odd\ntarget \udce9",  # invalid UTF-8 byte 0xe9
    }
    (src / ".venv/bin").mkdir(parents=True)
    (src / ".venv/lib/python3.11/site-packages").mkdir(parents=True)
    (src / ".venv/pyvenv.cfg").write_text("home = /usr/bin\n")
    (src / ".venv/lib/python3.11/site-packages/mod.py").write_text("x = 1\n")
    (src / "chain").mkdir()
    (src / "main.py").write_text("print('hi')\n")
    for name, target in links.items():
        os.symlink(os.fsencode(target), os.fsencode(src / name))
    for dirpath, dirnames, filenames in os.walk(src, topdown=False):
        for name in dirnames + filenames:
            os.utime(Path(dirpath, name), (T0, T0 + 7), follow_symlinks=False)
        os.utime(dirpath, (T0, T0 + 9))
    return links


@pytest.mark.parametrize("fmt", [(), ("--format=posix",)], ids=["gnu", "posix"])
def test_venv_and_outward_links_are_stored_verbatim(
    tmp_path: Path, root: Path, fmt: tuple[str, ...]
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    links = make_venv_tree(src)
    before = outside(root)
    stats = extract(gnu_tar(src, *fmt), root)
    assert snapshot(root) == snapshot(src)
    assert stats.symlinks == len(links)
    for name, target in links.items():
        assert os.readlink(os.fsencode(root / name)) == os.fsencode(target)
    assert outside(root) == before


def test_busybox_tar_venv_round_trips(tmp_path: Path, root: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_venv_tree(src)
    data = subprocess.run(
        ["busybox", "tar", "-cf", "-", "-C", str(src), "."], check=True, capture_output=True
    ).stdout
    extract(data, root)
    assert snapshot(root) == snapshot(src)


# -- what is still refused: every way to write through a link ---------------------------------

#: case -> (members given the absolute path of the watched ``outside`` dir, expected reason)
ATTACKS: dict[str, tuple[Callable[[str], Members], str]] = {
    "abs-link-to-tmp-then-file-under-it": (
        lambda out: [member("l", SYM, link="/tmp"), member("l/wsync-pwned", data=b"x")],
        "crosses a symlink",
    ),
    "abs-link-then-file-under-it": (
        lambda out: [member("l", SYM, link=out), member("l/passwd2", data=b"x")],
        "crosses a symlink",
    ),
    "rel-link-out-then-file-under-it": (
        lambda out: [member("l", SYM, link="../../outside"), member("l/new", data=b"x")],
        "crosses a symlink",
    ),
    "link-then-dir-under-it": (
        lambda out: [member("l", SYM, link=out), member("l/sub", DIR)],
        "crosses a symlink",
    ),
    "link-then-link-under-it": (
        lambda out: [member("l", SYM, link=out), member("l/evil", SYM, link="/")],
        "crosses a symlink",
    ),
    "link-in-the-middle-of-a-path": (
        lambda out: [
            member("d", DIR),
            member("d/l", SYM, link=out),
            member("d/l/x/y", data=b"x"),
        ],
        "crosses a symlink",
    ),
    "link-then-file-of-same-name": (
        lambda out: [member("l", SYM, link=out + "/passwd"), member("l", data=b"pwned")],
        "already exists",
    ),
    "link-then-dir-of-same-name": (
        lambda out: [member("l", SYM, link=out), member("l", DIR)],
        "already exists",
    ),
    "link-then-link-of-same-name": (
        lambda out: [member("l", SYM, link="a"), member("l", SYM, link=out)],
        "already exists",
    ),
    "link-then-hardlink-through-it": (
        lambda out: [member("l", SYM, link=out), member("h", LNK, link="l/passwd")],
        "not an earlier regular file",
    ),
    "hardlink-to-abs-symlink": (
        lambda out: [member("s", SYM, link=out + "/passwd"), member("h", LNK, link="s")],
        "not an earlier regular file",
    ),
    "hardlink-named-through-a-link": (
        lambda out: [
            member("f", data=b"x"),
            member("l", SYM, link=out),
            member("l/h", LNK, link="f"),
        ],
        "crosses a symlink",
    ),
    "chain-then-write-through": (
        lambda out: [
            member("a", DIR),
            member("a/s", SYM, link="../.."),
            member("a/s/outside/x", data=b"x"),
        ],
        "crosses a symlink",
    ),
    "pax-path-through-a-link": (
        lambda out: [
            member("l", SYM, link=out),
            member("ok", data=b"x", pax={"path": "l/" + "p" * 120}),
        ],
        "crosses a symlink",
    ),
    "gnu-long-name-through-a-link": (
        lambda out: [member("l", SYM, link=out), member("l/" + "g" * 150, data=b"x")],
        "crosses a symlink",
    ),
    "dotdot-file": (lambda out: [member("a/../../sentinel", data=b"x")], "'..' component"),
    "dotdot-symlink-name": (
        lambda out: [member("../outside/l", SYM, link="/")],
        "'..' component",
    ),
    "dotdot-dir": (lambda out: [member("../newdir", DIR)], "'..' component"),
    "dotdot-hardlink-name": (
        lambda out: [member("f", data=b"x"), member("../h", LNK, link="f")],
        "'..' component",
    ),
    "absolute-file": (lambda out: [member(out + "/new", data=b"x")], "absolute name"),
    "absolute-symlink-name": (lambda out: [member(out + "/l", SYM, link="/")], "absolute name"),
    "absolute-dir": (lambda out: [member(out + "/d", DIR)], "absolute name"),
    "absolute-hardlink-target": (
        lambda out: [member("h", LNK, link=out + "/passwd")],
        "absolute name",
    ),
}


@pytest.mark.parametrize("case", sorted(ATTACKS))
def test_writing_through_a_link_is_refused(root: Path, case: str) -> None:
    watched = root.parent.parent / "outside"
    make, reason = ATTACKS[case]
    fmt = tarfile.PAX_FORMAT if case.startswith("pax") else tarfile.GNU_FORMAT
    before = outside(root)
    tmp_before = set(os.listdir("/tmp"))
    with pytest.raises(HostileArchive, match=reason):
        extract(build(*make(str(watched)), fmt=fmt), root)
    assert outside(root) == before
    assert sorted(os.listdir(watched)) == ["passwd"]
    assert (watched / "passwd").read_text() == "secret"
    assert "wsync-pwned" not in set(os.listdir("/tmp")) - tmp_before
    for dirpath, _dirs, _files in os.walk(root):  # every real directory is inside root
        assert Path(dirpath).resolve().is_relative_to(root.resolve())


def test_links_are_never_followed_by_metadata(tmp_path: Path, root: Path) -> None:
    """Symlink mtimes and the final directory pass touch the link itself, not its target."""
    watched = tmp_path / "outside"
    os.utime(watched, (T0, T0))
    os.utime(watched / "passwd", (T0, T0))
    before = outside(root)
    extract(
        build(
            member("d", DIR, mode=0o700),
            member("d/l", SYM, link=str(watched)),
            member("d/p", SYM, link="../../../outside/passwd"),
        ),
        root,
    )
    assert outside(root) == before
    assert os.lstat(root / "d/l").st_mtime == T0
    assert os.stat(watched).st_mtime == T0
