"""Host-side incremental cycle for tests: a guest tree's manifest, and an apply that uses the
real state, diff and farm with a plain copy standing in for the transfer and extractor."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from wsync.engine import hostscan
from wsync.engine.excludes import Excludes
from wsync.engine.farm import build_farm, set_dir_meta
from wsync.engine.fsutil import remove_tree_at, swap_at
from wsync.engine.hostscan import kind_of
from wsync.engine.incdiff import Diff
from wsync.engine.incremental import read_manifest
from wsync.engine.incstate import PullState
from wsync.engine.prefarm import Prefarm


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """Same fields as wsync.protocol.manifest.Entry (the interface in the design)."""

    path: bytes
    kind: str
    mode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    target: bytes
    digest: str = ""
    record: bytes = b""  # no fingerprint: the state keeps none, the next load parses all


def manifest(root: Path) -> Iterator[Entry]:
    """What the guest's manifest says of ``root``: one lstat per entry, root first."""
    base = os.fsencode(root)
    st = os.lstat(base)
    yield Entry(b".", "d", stat.S_IMODE(st.st_mode), 0, st.st_mtime_ns, st.st_ctime_ns, 0, b"")
    for dirpath, dirnames, filenames in os.walk(base):
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, base)
            st = os.lstat(full)
            kind = kind_of(st.st_mode)
            target = os.readlink(full) if kind == "l" else b""
            size = st.st_size if kind in "fl" else 0
            yield Entry(
                rel,
                kind,
                stat.S_IMODE(st.st_mode),
                size,
                st.st_mtime_ns,
                st.st_ctime_ns,
                st.st_ino,
                target,
            )


#: the options key the helpers' pulls run under when they read a listing (see ``listing``)
OPTIONS = "test-options"
#: what the guest's producer runs for a manifest, with GNU find (wsync.protocol.producer)
FIND_FORMAT = "%y %m %s %T@ %C@ %i:%D\\0%p\\0%l\\0"


def listing(root: Path) -> bytes:
    """The guest's manifest of ``root`` as its producer writes it (GNU find)."""
    return subprocess.run(
        ["find", ".", "-printf", FIND_FORMAT], cwd=root, capture_output=True, check=True
    ).stdout


def hash_file(path: bytes) -> str:
    with open(path, "rb") as f:
        return xxhash.xxh3_128(f.read()).hexdigest()


def _copy_entry(src: bytes, dst: bytes) -> None:
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    else:
        shutil.copyfile(src, dst)
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


@dataclasses.dataclass
class Applied:
    diff: Diff  # its iterators are closed with the state: use lines and fetched
    fetched: list[bytes]
    farm: int
    lines: list[str]


def pull(
    state_dir: Path,
    guest: Path,
    dest: Path,
    *,
    key: str = "local:guest",
    excludes: Excludes | None = None,
    during: Callable[[], None] | None = None,
    parse: bool = False,
) -> Applied:
    """One pull of ``guest`` into ``dest``: manifest, diff, farm, copy, dir meta, swap, commit.
    ``during`` runs after the farm and the copy, before the swap (the host at work in DEST
    while the pull transfers).  With ``parse`` the manifest is the guest's listing, read
    as a pull reads it (known records and all: :func:`listing`), else lstat entries."""
    excludes = excludes or Excludes.none()
    dest.mkdir(exist_ok=True)
    with PullState.open(state_dir, dest, key) as state:
        digest = ""
        if parse:
            data = listing(guest)
            digest = hashlib.sha256(data).hexdigest()
            read_manifest(io.BytesIO(data), state, excludes, 10**9, OPTIONS)
        else:
            state.load_manifest(manifest(guest), excludes)
        dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        found = os.fstat(dest_fd)
        try:
            diff = state.diff(dest_fd)
        finally:
            os.close(dest_fd)
        fetched = list(diff.fetch_paths())
        lines = list(diff.itemize())
        if diff.nothing_to_do:
            return Applied(diff, fetched, 0, lines)
        parent = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
        tmp_name = f".{dest.name}.tmp"
        os.mkdir(tmp_name, 0o700, dir_fd=parent)
        tmp_fd = os.open(tmp_name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent)
        dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        hashes: dict[bytes, str] = {}
        try:
            made = build_farm(dest_fd, tmp_fd, diff.keep(), lambda: None)
            tmp_path = os.fsencode(dest.parent / tmp_name)
            for path in fetched:
                src = os.fsencode(guest) + b"/" + path
                if not os.path.lexists(src):
                    continue
                _copy_entry(src, tmp_path + b"/" + path)
                if os.path.isfile(src) and not os.path.islink(src):
                    if len(path) % 2:  # both ways of handing hashes over
                        state.add_hash(path, hash_file(src))
                    else:
                        hashes[path] = hash_file(src)
            set_dir_meta(tmp_fd, diff.dirs())
            if during is not None:
                during()
        finally:
            os.close(tmp_fd)
            os.close(dest_fd)
        old = swap_at(parent, tmp_name, dest.name, str(dest), (found.st_dev, found.st_ino))
        if old is not None:
            remove_tree_at(parent, old)
        os.close(parent)
        dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            state.commit(dest_fd, hashes, listing=digest, options=OPTIONS if parse else "")
        finally:
            os.close(dest_fd)
        return Applied(diff, fetched, made, lines)


class EarlyFarms:
    """Counts the early farm's builds and finishes (wsync.engine.prefarm; the real
    methods run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.built = self.finished = 0
        build, finish = Prefarm.build, Prefarm.finish

        def built(farm: Prefarm, *args: object) -> None:
            self.built += 1
            build(farm, *args)  # type: ignore[arg-type]

        def finished(farm: Prefarm, *args: object) -> int:
            self.finished += 1
            return finish(farm, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(Prefarm, "build", built)
        monkeypatch.setattr(Prefarm, "finish", finished)


class Rehashes:
    """Counts the files the diff re-hashes (a moved ctime or inode costs one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = hostscan.file_hash

        def counted(*args: object, **kwargs: object) -> str | None:
            self.count += 1
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(hostscan, "file_hash", counted)
