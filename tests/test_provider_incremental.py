"""Incremental pulls through ``e2b://``, ``daytona://`` and ``cloudflare://`` with every
fault of the provider's emulator on (issue 9 x issue 8).

The incremental path sends different commands from a full pull — a manifest walk, a list
of paths in stdin or argv parts, a tar of just those paths — so the faults a provider
injects (cut streams, made-up exit codes, truncated results, hangs) meet new code.  Each
case: a full pull with faults on, every kind of change the guest can make, then an
incremental pull with faults on; DEST must be exact and the run must be incremental.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from helpers import assert_exact, make_tree, options
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.pull import pull_uri

KiB = 1024


class Emulator(Protocol):
    """What the three emulator threads have in common."""

    stats: Any

    def create_sandbox(self, name: str) -> Path: ...
    def set_faults(self, faults: Any) -> None: ...
    def transport_options(self) -> Any: ...


def _e2b(root: Path) -> tuple[Any, Any]:
    from wsync.emulators.e2b import E2BFaults, EmulatorThread

    return EmulatorThread(root), E2BFaults.all_on(seed=91)


def _daytona(root: Path) -> tuple[Any, Any]:
    from wsync.emulators.daytona import DaytonaEmulatorThread, DaytonaFaults

    return DaytonaEmulatorThread(root), DaytonaFaults.all_on(seed=92)


def _cloudflare(root: Path) -> tuple[Any, Any]:
    from wsync.emulators.cloudflare import CloudflareFaults, EmulatorThread

    return EmulatorThread(root), CloudflareFaults.all_on(seed=93)


#: the emulators' counters of faults that fired (their stats also count plain requests)
FAULT_STATS: dict[str, tuple[str, ...]] = {
    "e2b": (
        "bad_gateway", "cut_clean", "cut_reset", "silence", "login_noise", "dropped_data",
        "duplicated_data", "deadline_race", "file_short", "file_cut", "file_ignored_range",
    ),
    "daytona": (
        "bad_gateway", "truncated_result", "minus_one", "early_timeout", "late_partial",
        "short_download",
    ),
    "cloudflare": (
        "early_exit", "zero_exit", "no_exit", "severed", "http_503", "error_event", "hangs",
        "dropped_fragments", "lost_tail", "file_truncated", "file_short", "file_refused",
    ),
}  # fmt: skip

PROVIDERS: dict[str, Callable[[Path], tuple[Any, Any]]] = {
    "e2b": _e2b,
    "daytona": _daytona,
    "cloudflare": _cloudflare,
}


@pytest.fixture(params=sorted(PROVIDERS))
def provider(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Emulator, Any]]:
    """A fresh emulator per case: its fault schedule starts from the fixed seed."""
    name: str = request.param
    emu, faults = PROVIDERS[name](tmp_path / "emu")
    with emu:
        yield name, emu, faults


def prepare(ws: Path) -> None:
    make_tree(ws, big=192 * KiB, small=24)
    (ws / "link").symlink_to("src/f1.txt")
    (ws / "exe").write_bytes(b"#!/bin/sh\necho x\n")
    (ws / "exe").chmod(0o644)


def change(ws: Path) -> None:
    """Append, same-size rewrite with the mtime put back, delete, a new file with a
    non-UTF-8 name, chmod, symlink retarget — the changes an agent makes between pulls."""
    src = ws / "src"
    with (src / "f2.txt").open("ab") as f:
        f.write(b"appended by the agent\n")
    # a big append to a hard-linked file: the changed bytes span several chunks
    with (ws / "blob.bin").open("ab") as f:
        f.write(os.urandom(256 * KiB))
    victim = src / "f3.txt"
    st = victim.stat()
    data = victim.read_bytes()
    victim.write_bytes(bytes(b ^ 0x20 for b in data[:8]) + data[8:])
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    (src / "f4.txt").unlink()
    Path(os.fsdecode(os.fsencode(ws) + b"/new-\xff\xfe-caf\xe9.bin")).write_bytes(b"\x00\x01" * 999)
    (ws / "exe").chmod(0o755)
    (ws / "link").unlink()
    (ws / "link").symlink_to("src/f5.txt")


def test_incremental_pull_is_exact_with_every_fault_on(
    provider: tuple[str, Emulator, Any], tmp_path: Path
) -> None:
    name, emu, faults = provider
    ws = emu.create_sandbox("incr") / "work"
    ws.mkdir()
    prepare(ws)
    dest = tmp_path / "out"
    # short chunks: more calls, so more of them meet a fault
    opts: PullOptions = options(tmp_path, chunk_size=64 * KiB, parallel=3)
    uri = f"{name}://incr{ws}"

    def once() -> PullResult:
        return asyncio.run(pull_uri(uri, dest, opts, emu.transport_options()))

    emu.set_faults(faults)
    first = once()
    assert first.mode == "full"
    assert_exact(ws, dest)

    change(ws)
    fired_before = sum(emu.stats[k] for k in FAULT_STATS[name])
    second = once()
    assert second.mode == "incremental"
    assert_exact(ws, dest)
    assert second.changed_files >= 4 and second.deleted_files >= 1
    # the faults really fired on the wire during the incremental pull
    assert sum(emu.stats[k] for k in FAULT_STATS[name]) > fired_before

    # and nothing changed: still incremental, nothing fetched, still exact
    third = once()
    assert third.mode == "incremental" and third.changed_files == 0
    assert_exact(ws, dest)
