"""Compare two directory trees exactly: what "exact" means, in one place.

Used by ``wsync demo`` to show a naive copy's damage and by the test suite to
assert that a pull came back exact.  Compares entry types, regular-file
contents, permission bits, symlink targets and (optionally) mtimes; never
follows symlinks.  Mtimes compare to the whole second: the guest's ``tar``
writes ustar headers (GNU and busybox alike), which carry seconds.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def snapshot(root: Path, *, mtimes: bool = True) -> dict[str, tuple[object, ...]]:
    """Relative path (bytes-safe str) → comparable description of the entry."""
    out: dict[str, tuple[object, ...]] = {}
    base = os.fspath(root)
    for dirpath, dirnames, filenames in os.walk(base):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, base)
            st = os.lstat(full)
            mode = stat.S_IMODE(st.st_mode)
            mt = st.st_mtime_ns // 1_000_000_000 if mtimes else 0
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(full))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", mode, mt)
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", mode, st.st_size, _digest(full), mt)
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode))
    return out


def diff(expected: Path, actual: Path, *, mtimes: bool = True) -> list[str]:
    """Human-readable differences; empty when the trees are identical."""
    a = snapshot(expected, mtimes=mtimes)
    b = snapshot(actual, mtimes=mtimes)
    problems = [f"missing: {p!r}" for p in sorted(a.keys() - b.keys())]
    problems += [f"unexpected: {p!r}" for p in sorted(b.keys() - a.keys())]
    problems += [f"differs: {p!r}" for p in sorted(a.keys() & b.keys()) if a[p] != b[p]]
    return problems
