"""The guest's tar reads the workspace in name order where it can (GNU tar 1.28 and later).

In name order a module sits beside its compiled forms and a package's files beside each
other: the standard library's archive is 7% smaller at the same level (48.4 MB -> 44.9 MB
at ``-3 --long=25``) for the same CPU, which is link time on a slow link (issue 13).  The
probe learns ``--sort`` from the ``tar --version`` it already runs (no program more per
pull); busybox's tar has no ``--sort``, and a GNU tar older than 1.28 keeps the
directories' own order.  Each test reads the archive a real producer staged.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest
import zstandard

from helpers import assert_exact, guest_shell_path, local, make_tree, options, run_pull
from wsync.engine.guest import GuestSession
from wsync.engine.guestcall import CallStats
from wsync.protocol import records
from wsync.transports.local import LocalTransport

#: names made in an order that is not theirs (and a directory's own order on ext4 and
#: tmpfs is neither): a tar in name order lists them sorted in every directory
NAMES = ["m", "b", "z", "a", "k", "q", "c", "y", "d", "x", "e", "w", "f", "v", "g", "u"]


def _workspace(root: Path) -> Path:
    for name in NAMES:
        (root / "pkg" / name).mkdir(parents=True)
        for leaf in reversed(NAMES):
            (root / "pkg" / name / f"{leaf}.py").write_text(f"{name}/{leaf}\n")
        (root / f"{name}.txt").write_text(name)
    return root


def _tar_wrapper(directory: Path, version: str) -> str:
    """A PATH whose tar says it is GNU tar ``version`` and refuses ``--sort`` as a tar
    before 1.28 would (exit 64); otherwise the real tar runs."""
    directory.mkdir()
    real = Path("/bin/tar") if Path("/bin/tar").exists() else Path("/usr/bin/tar")
    (directory / "tar").write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" --version "*) echo "tar (GNU tar) {version}"; exit 0 ;; esac\n'
        'case " $* " in *" --sort="*) echo "tar: unrecognized option" >&2; exit 64 ;; esac\n'
        f'exec {real} "$@"\n'
    )
    (directory / "tar").chmod(0o755)
    return f"{directory}:{os.environ['PATH']}"


def _staged_members(tmp_path: Path, ws: Path, path: str) -> tuple[list[str], bool]:
    """Probe and admit a whole-tree run on a guest with ``path``; wait for its end and
    return the member names of the archive it staged, and whether the probe saw --sort."""

    async def run() -> tuple[str, str, bool]:
        env = {"PATH": path, "HOME": str(tmp_path)}
        session = GuestSession(LocalTransport(env=env), options(tmp_path), CallStats())
        plan = await session.probe(str(ws))
        assert not await session.admit("s-order", str(ws), plan.compressor, level=1)
        for _ in range(1200):
            status = await session.status()
            if status.done is not None:
                break
            await asyncio.sleep(0.05)
        assert status.done is not None
        return session.staging_root, plan.compressor, plan.probe.has("tar_sort")

    root, compressor, sorts = asyncio.run(run())
    data = Path(root, "s-order", "data").read_bytes()
    if compressor.startswith("zstd"):
        raw = zstandard.ZstdDecompressor(max_window_size=1 << 27).stream_reader(data).read()
    else:
        raw = gzip.decompress(data)
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as archive:
        return [m.name for m in archive.getmembers()], sorts


def _in_name_order(names: list[str]) -> bool:
    """Every directory's children come in name order (the first time each is met: a
    later archive round may list one again)."""
    children: dict[str, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rstrip("/").rpartition("/")
        seen = children.setdefault(parent, [])
        if leaf not in seen:
            seen.append(leaf)
    return all(kids == sorted(kids) for kids in children.values())


def test_gnu_tar_archives_each_directory_in_name_order(tmp_path: Path) -> None:
    ws = _workspace(tmp_path / "ws")
    names, sorts = _staged_members(tmp_path, ws, os.environ["PATH"])
    assert sorts
    assert len([n for n in names if n.endswith(".py")]) == len(NAMES) ** 2
    assert _in_name_order(names), names[:20]


@pytest.mark.parametrize("version", ["1.27.1", "1.2", "0.99"])
def test_an_older_gnu_tar_is_never_asked_to_sort(tmp_path: Path, version: str) -> None:
    """A tar that says 1.27 (or older) would refuse ``--sort``: the probe does not see it,
    the producer does not pass it, and the run archives everything as before."""
    ws = _workspace(tmp_path / "ws")
    names, sorts = _staged_members(tmp_path, ws, _tar_wrapper(tmp_path / "old", version))
    assert not sorts
    assert len([n for n in names if n.endswith(".py")]) == len(NAMES) ** 2


@pytest.mark.parametrize(
    ("line", "sorts"),
    [
        ("tar (GNU tar) 1.34", True),
        ("tar (GNU tar) 1.28", True),
        ("tar (GNU tar) 10.0", True),
        ("tar (GNU tar) 1.27.1", False),
        ("tar (GNU tar) 1.9", False),
        ("tar (GNU tar) 1.", False),
        ("tar (GNU tar) 99999.1", False),
        ("bsdtar 3.6.2 - libarchive 3.6.2", False),
        ("tar (busybox) 1.36.1", False),
        ("ERROR: ld.so: object 'x.so' from LD_PRELOAD cannot be preloaded", False),
        ("", False),
    ],
)
def test_the_version_line_decides(line: str, sorts: bool) -> None:
    assert records.tar_sorts(line) is sorts


@pytest.mark.parametrize("version", ["1.28", "1.34", "2.0"])
def test_a_gnu_tar_of_1_28_or_later_is_asked_to_sort(tmp_path: Path, version: str) -> None:
    """The version gate itself (the wrapper refuses ``--sort`` whatever it says, so a run
    that passed it would fail): the probe sees ``--sort`` from 1.28 on."""

    async def probe() -> bool:
        env = {"PATH": _tar_wrapper(tmp_path / "new", version), "HOME": str(tmp_path)}
        session = GuestSession(LocalTransport(env=env), options(tmp_path), CallStats())
        plan = await session.probe(str(_workspace(tmp_path / "ws")))
        return plan.probe.has("tar_sort")

    assert asyncio.run(probe())


def test_a_busybox_guest_has_no_sort_and_pulls_exactly(tmp_path: Path) -> None:
    ws = make_tree(tmp_path / "ws", big=64 * 1024, small=10)
    path = guest_shell_path("busybox", tmp_path / "bb")
    names, sorts = _staged_members(tmp_path, ws, path)
    assert not sorts and names
    run_pull(local({"PATH": path}), ws, tmp_path / "out", options(tmp_path / "p"))
    assert_exact(ws, tmp_path / "out")


def test_a_pull_in_name_order_is_exact_with_changes_and_rounds(tmp_path: Path) -> None:
    """The odd tree of the other tests, whole and again after a change (an incremental
    select run reads its list in the list's order, untouched by ``--sort``)."""
    ws = make_tree(tmp_path / "ws", big=256 * 1024, small=40)
    dest = tmp_path / "out"
    opts = options(tmp_path)
    run_pull(local(), ws, dest, opts)
    assert_exact(ws, dest)
    (ws / "src" / "f3.txt").write_text("changed\n")
    (ws / "src" / "new-b").write_text("b\n")
    (ws / "src" / "new-a").write_text("a\n")
    result = run_pull(local(), ws, dest, opts)
    assert result.mode == "incremental" and result.changed_files == 4  # and src/
    assert_exact(ws, dest)
