"""A guest whose archive disagrees with its own listing: what a pull records of it.

The guest is hostile (docs/design.md): its ``find`` and ``tar`` may say anything.  A pull
cannot tell a content lie that keeps a file's size from the truth, but whatever it
records must not outlive the lie: once the guest answers honestly again, the next pull
must bring DEST back to the guest's tree.  Before, the commit recorded the listing's
record beside whatever the archive had put in DEST, so a later honest listing matched
the record, DEST's scan matched the state, and the wrong entry stayed for good (only
``--full`` repaired it).  Now a file is recorded only where DEST holds it with the size
the listing gave, and a symlink only where it points where the listing says.

The shims are Python programs put first in the guest's PATH; each runs the real tool and
rewrites what it wrote, where the environment asks it to (found by a red team, with
these cases).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from helpers import assert_exact, options, run_pull
from wsync.engine.api import PullOptions, PullResult
from wsync.transports.local import LocalTransport

#: the guest's tar: a select run (``-T``, the list of what to fetch) has its archive
#: rewritten by EVIL_TAR: ``plant:NAME:BYTES`` gives member NAME those bytes,
#: ``retarget:NAME:TARGET`` gives symlink member NAME that target
_TAR = """
import io, os, subprocess, sys, tarfile
real, args = os.environ["REAL_TAR"], sys.argv[1:]
evil = os.environ.get("EVIL_TAR", "")
if not evil or "-T" not in args:
    os.execv(real, [real] + args)
out = subprocess.run([real] + args, stdout=subprocess.PIPE)
how, name, value = evil.split(":", 2)
buf = io.BytesIO()
with tarfile.open(fileobj=io.BytesIO(out.stdout), mode="r:") as t, tarfile.open(
    fileobj=buf, mode="w:", format=tarfile.GNU_FORMAT
) as w:
    for m in t.getmembers():
        data = t.extractfile(m).read() if m.isreg() else None
        if m.name == name and how == "plant":
            data = value.encode()
            m.size = len(data)
        if m.name == name and how == "retarget":
            m.linkname = value
        w.addfile(m, io.BytesIO(data) if data is not None else None)
sys.stdout.buffer.write(buf.getvalue())
sys.exit(out.returncode)
"""

#: the guest's find: a listing (``-printf``) has EVIL_FIND's record rewritten:
#: ``ino:NAME:OTHER`` gives NAME's record the inode number of OTHER's
_FIND = """
import os, subprocess, sys
real, args = os.environ["REAL_FIND"], sys.argv[1:]
evil = os.environ.get("EVIL_FIND", "")
if not evil or "-printf" not in args:
    os.execv(real, [real] + args)
out = subprocess.run([real] + args, stdout=subprocess.PIPE)
_, name, other = evil.split(":", 2)
fields = out.stdout.split(b"\\0")
records = [fields[i : i + 3] for i in range(0, len(fields) - 1, 3)]
ino = {p: h.split(b" ")[5] for h, p, _ in records}
for rec in records:
    if rec[1] == name.encode():
        head = rec[0].split(b" ")
        head[5] = ino[other.encode()]
        rec[0] = b" ".join(head)
sys.stdout.buffer.write(b"".join(b"\\0".join(r) + b"\\0" for r in records))
sys.exit(out.returncode)
"""


def _guest(tmp_path: Path, **evil: str) -> LocalTransport:
    """A local guest with the shims first in its PATH, lying as ``evil`` says."""
    bindir = tmp_path / "evil-bin"
    if not bindir.exists():
        bindir.mkdir()
        for tool, text in (("tar", _TAR), ("find", _FIND)):
            (bindir / tool).write_text(f"#!{sys.executable}\n{text}")
            (bindir / tool).chmod(0o755)
    real = {f"REAL_{t.upper()}": shutil.which(t) or t for t in ("tar", "find")}
    path = f"{bindir}:{os.environ['PATH']}"
    return LocalTransport(env={**os.environ, **real, "PATH": path, **evil})


def _pull(ws: Path, dest: Path, opts: PullOptions, guest: LocalTransport) -> PullResult:
    result = run_pull(guest, ws, dest, opts)
    assert result.ok, result.error
    return result


@pytest.fixture
def pulled(tmp_path: Path) -> tuple[Path, Path, PullOptions]:
    """A workspace pulled once (honestly), then changed: ``f.txt`` rewritten and ``s``
    pointed elsewhere; ``k.txt`` stays as it is."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "k.txt").write_text("kept file\n")
    (ws / "f.txt").write_text("version 1\n")
    (ws / "s").symlink_to("target-one")
    dest = tmp_path / "dest"
    opts = options(tmp_path)
    assert _pull(ws, dest, opts, _guest(tmp_path)).mode == "full"
    time.sleep(0.05)  # (a new mtime even on a coarse clock's next tick)
    (ws / "f.txt").write_text("version 2 of f\n")
    (ws / "s").unlink()
    (ws / "s").symlink_to("target-two")
    return ws, dest, opts


@pytest.mark.parametrize(
    "evil",
    [
        {"EVIL_TAR": "plant:./f.txt:PLANTED BY A HOSTILE TAR, NOT IN THE WORKSPACE\n"},
        {"EVIL_TAR": "retarget:./s:/etc/shadow"},
        # a target of the listed one's length (its size in DEST is the listed size)
        {"EVIL_TAR": "retarget:./s:target-XYZ"},
        {"EVIL_FIND": "ino:./f.txt:./k.txt"},
    ],
    ids=["content", "symlink-target", "symlink-same-length", "hardlink-group"],
)
@pytest.mark.parametrize("keep_prev", [False, True], ids=["default", "keep-prev"])
def test_an_archive_unlike_its_listing_is_repaired_by_the_next_honest_pull(
    tmp_path: Path,
    pulled: tuple[Path, Path, PullOptions],
    evil: dict[str, str],
    keep_prev: bool,
) -> None:
    """One pull with a lying guest: a file given other bytes, a symlink another target,
    or an unchanged file claimed to be a hardlink of a changed one (the farm then joins
    ``k.txt`` to ``f.txt``'s new bytes).  DEST is whatever the lie made it; the next
    honest pull makes it the guest's tree again (before: every later pull kept the lie,
    reporting success)."""
    ws, dest, opts = pulled
    opts = dataclasses.replace(opts, keep_prev=keep_prev)
    hostile = _pull(ws, dest, opts, _guest(tmp_path, **evil))
    assert hostile.mode == "incremental"
    with pytest.raises(AssertionError):
        assert_exact(ws, dest)  # the lie landed (nothing could tell it from the truth)
    honest = _pull(ws, dest, opts, _guest(tmp_path))
    assert honest.mode == "incremental" and honest.changed_files >= 1
    assert_exact(ws, dest)
    again = _pull(ws, dest, opts, _guest(tmp_path))
    assert again.changed_files == again.deleted_files == 0
