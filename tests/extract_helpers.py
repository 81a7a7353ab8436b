"""Archive builders, tree snapshots and the watched extraction root shared by the extractor tests.

The extraction root sits two levels below ``tmp_path`` so that an escape via ``..`` would land
in a directory the tests watch (:func:`outside`).  Fixtures stay in the test modules (a fixture
imported by name would be shadowed by the test's parameter); they call :func:`make_root` and
:func:`small_archive` here.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

from wsync.engine.api import ExtractLimits
from wsync.engine.extract import ExtractStats, extract_tar_stream

T0 = 1_600_000_000  # whole seconds: GNU and busybox formats store seconds only
LIMITS = ExtractLimits(min_free_bytes=0)

DIR = tarfile.DIRTYPE
SYM = tarfile.SYMTYPE
LNK = tarfile.LNKTYPE


def walk(top: bytes) -> list[bytes]:
    """Every path under ``top`` (itself first), parents before children, links not followed.

    Iterative: ``os.walk`` recurses in this Python (3.11) and a 1,000-deep tree exceeds the
    recursion limit.
    """
    out = [top]
    stack = [top]
    while stack:
        here = stack.pop()
        with os.scandir(here) as entries:
            children = sorted(e.path for e in entries)
        out.extend(children)
        stack.extend(c for c in reversed(children) if stat.S_ISDIR(os.lstat(c).st_mode))
    return out


def snapshot(root: Path) -> dict[bytes, tuple[object, ...]]:
    """Type, mode, mtime_ns, content hash, link target and hardlink group of every entry."""
    out: dict[bytes, tuple[object, ...]] = {}
    first_name: dict[int, bytes] = {}
    base = os.fsencode(root)
    for path in walk(base):
        rel = os.path.relpath(path, base)
        st = os.lstat(path)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", os.readlink(path), st.st_mtime_ns)
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ("dir", mode, st.st_mtime_ns)
        else:
            assert stat.S_ISREG(st.st_mode), rel
            digest = hashlib.sha256(Path(os.fsdecode(path)).read_bytes()).hexdigest()
            group = first_name.setdefault(st.st_ino, rel)
            out[rel] = ("file", mode, st.st_mtime_ns, digest, group)
    return out


def make_root(tmp_path: Path) -> Path:
    """An empty extraction root two levels deep, with files outside it to watch."""
    (tmp_path / "sentinel").write_text("outside")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "passwd").write_text("secret")
    root = tmp_path / "stage" / "root"
    root.mkdir(parents=True)
    return root


def outside(root: Path) -> dict[bytes, tuple[object, ...]]:
    """Snapshot of everything around ``root``'s staging directory (must never change)."""
    snap = snapshot(root.parent.parent)
    return {k: v for k, v in snap.items() if not k.startswith(b"stage")}


def extract(data: bytes, root: Path, limits: ExtractLimits = LIMITS) -> ExtractStats:
    """Extract an in-memory archive through a buffered reader, as the pull feeds it."""
    return extract_tar_stream(io.BufferedReader(io.BytesIO(data)), root, limits)  # type: ignore[arg-type]


def member(
    name: str,
    kind: bytes = tarfile.REGTYPE,
    data: bytes = b"",
    *,
    mode: int = 0o644,
    link: str = "",
    pax: dict[str, str] | None = None,
) -> tuple[tarfile.TarInfo, bytes]:
    """One member for :func:`build`, mtime ``T0``; only regular files carry ``data``."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = T0
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    if pax:
        info.pax_headers = pax
    return info, data


def build(*members: tuple[tarfile.TarInfo, bytes], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    """An archive of ``members`` written by ``tarfile``, which writes hostile names as given."""
    buf = io.BytesIO()
    with tarfile.open(
        fileobj=buf, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape"
    ) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def gnu_tar(src: Path, *args: str) -> bytes:
    """``src`` archived by GNU tar, as the guest would send it (uncompressed)."""
    return subprocess.run(
        ["tar", *args, "-cf", "-", "-C", str(src), "."], check=True, capture_output=True
    ).stdout


def restore_writable(path: Path) -> None:
    """Let pytest remove read-only directories when tests run as a normal user."""
    for entry in walk(os.fsencode(path)):
        if stat.S_ISDIR(os.lstat(entry).st_mode):
            os.chmod(entry, 0o755)


def small_archive() -> bytes:
    """A directory, two files and a symlink: small enough to cut at every interesting offset."""
    return build(
        member("d", DIR),
        member("d/a", data=b"A" * 5000),
        member("d/b", data=b"B" * 700),
        member("d/l", SYM, link="a"),
    )
