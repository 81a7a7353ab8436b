"""``wsync pull sprites://NAME/PATH`` through the engine, against the lossy emulator.

The emulator runs in a background thread with its own event loop (as in
``wsync demo``); each pull runs in the test's ``asyncio.run`` through the
registry, exactly as the CLI does.  The invariant everywhere: exact tree, or
a clear :class:`WsyncError` with DEST untouched — never a wrong tree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_exact, make_tree, options
from wsync.emulators.sprites import EmulatorThread, SpritesFaults
from wsync.engine.api import PullOptions, PullResult
from wsync.engine.pull import pull_uri
from wsync.errors import IntegrityFailed, WsyncError
from wsync.transports.registry import open_transport
from wsync.transports.sprites import SpritesTransport
from wsync.treediff import snapshot

KiB = 1024
MiB = 1024 * KiB
FAULT_STATS = ("zero_frames", "data_after_exit", "no_exit_frame", "severed")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorThread]:
    with EmulatorThread(tmp_path_factory.mktemp("sprites")) as emu:
        yield emu


def sprite_workspace(emu: EmulatorThread, name: str) -> Path:
    """A fresh sprite with an empty workspace directory inside it."""
    ws = emu.create_sprite(name) / "work"
    ws.mkdir()
    return ws


def pull_sprite(
    emu: EmulatorThread, name: str, ws: Path, dest: Path, opts: PullOptions
) -> PullResult:
    return asyncio.run(pull_uri(f"sprites://{name}{ws}", dest, opts, emu.transport_options()))


def faults_fired(emu: EmulatorThread) -> int:
    return sum(emu.stats[k] for k in FAULT_STATS)


@pytest.mark.parametrize("helpers", [True, False], ids=["helpers", "exec-per-call"])
def test_small_workspace_is_exact_with_every_fault_on(
    emulator: EmulatorThread, tmp_path: Path, helpers: bool
) -> None:
    name = f"small-{str(helpers).lower()}"
    ws = make_tree(sprite_workspace(emulator, name) / "t", big=300 * KiB, small=20)
    faults = SpritesFaults.all_on(seed=11)
    if helpers:
        # a pull through helpers is two or three execs: data after the exit drawn for
        # each of them, so the fault a channel meets surely happens
        faults = dataclasses.replace(faults, data_after_exit=1.0)
    emulator.set_faults(faults)
    before = faults_fired(emulator)
    released = emulator.stats["held_released"]
    dest = tmp_path / "out"
    opts = options(tmp_path, chunk_size=128 * KiB, helpers=helpers)
    result = pull_sprite(emulator, name, ws, dest, opts)
    assert result.ok
    assert_exact(ws, dest)
    if helpers:
        assert emulator.stats["held_released"] > released  # answers held for the exit, let go
    else:
        assert faults_fired(emulator) > before  # the faults really happened on the wire


@pytest.mark.parametrize("helpers", [True, False], ids=["helpers", "exec-per-call"])
def test_multi_mb_workspace_is_exact_with_every_fault_on(
    emulator: EmulatorThread, tmp_path: Path, helpers: bool
) -> None:
    """Random (incompressible) and zero (compressible) files, several chunks, reads in flight.
    (Through helpers few of the faults meet a channel: held frames, a severed socket.)"""
    name = f"big-{str(helpers).lower()}"
    ws = make_tree(sprite_workspace(emulator, name) / "t", big=5 * MiB, small=40)
    (ws / "more-random.bin").write_bytes(os.urandom(3 * MiB))
    emulator.set_faults(SpritesFaults.all_on(seed=12))
    dest = tmp_path / "out"
    opts = options(tmp_path, chunk_size=1 * MiB, parallel=4, helpers=helpers)
    result = pull_sprite(emulator, name, ws, dest, opts)
    assert_exact(ws, dest)
    assert result.chunks >= 3


def test_empty_workspace_is_an_empty_dest(emulator: EmulatorThread, tmp_path: Path) -> None:
    ws = sprite_workspace(emulator, "empty")
    emulator.set_faults(SpritesFaults.all_on(seed=13))
    dest = tmp_path / "out"
    pull_sprite(emulator, "empty", ws, dest, options(tmp_path))
    assert dest.is_dir()
    assert list(dest.iterdir()) == []
    assert_exact(ws, dest)


def test_naive_cat_loses_the_head_but_wsync_pull_is_exact(
    emulator: EmulatorThread, tmp_path: Path
) -> None:
    """The issue's acceptance test: same data, same emulator, two very different results."""
    ws = sprite_workspace(emulator, "report")
    data = os.urandom(1 * MiB)
    (ws / "f1024").write_bytes(data)
    emulator.set_faults(SpritesFaults.report_table())

    async def naive() -> tuple[bytes, int | None]:
        _, transport = open_transport(f"sprites://report{ws}", emulator.transport_options())
        assert isinstance(transport, SpritesTransport)
        async with transport:
            result = await transport.exec(["cat", str(ws / "f1024")], timeout=30)
            return result.stdout, result.exit_status

    received, status = asyncio.run(naive())
    assert status == 0
    assert len(received) == 65536
    assert received == data[-65536:]

    # the exec path's stdin gate beats the ring, and so does a helper (it prints nothing
    # before its first request, which it reads once attached)
    for helpers in (False, True):
        dest = tmp_path / f"out-{helpers}"
        opts = options(tmp_path / f"o-{helpers}", chunk_size=256 * KiB, helpers=helpers)
        pull_sprite(emulator, "report", ws, dest, opts)
        assert (dest / "f1024").read_bytes() == data
        assert_exact(ws, dest)


def test_a_backend_that_never_answers_fails_clearly_and_leaves_dest(
    emulator: EmulatorThread, tmp_path: Path
) -> None:
    ws = make_tree(sprite_workspace(emulator, "mute") / "t", big=10 * KiB, small=2)
    emulator.set_faults(SpritesFaults(zero_frames=1.0, fast_threshold=5.0))
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "previous").write_text("the old tree\n")
    before = snapshot(dest)
    # (one exec per call: a guest helper is no fast command, it answers once it is seen
    # running past the threshold)
    opts = options(tmp_path, max_attempts=3, force=True, call_timeout=10, helpers=False)
    with pytest.raises(IntegrityFailed):
        pull_sprite(emulator, "mute", ws, dest, opts)
    assert snapshot(dest) == before


@pytest.fixture(scope="module")
def prop_workspace(emulator: EmulatorThread) -> Path:
    return make_tree(sprite_workspace(emulator, "prop") / "t", big=200 * KiB, small=8)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 2**16),
    ring=st.booleans(),
    merge=st.floats(0.0, 1.0),
    after_exit=st.floats(0.0, 1.0),
    no_exit=st.floats(0.0, 0.6),
    zero=st.floats(0.0, 0.6),
    sever=st.floats(0.0, 0.4),
    split=st.floats(0.0, 1.0),
    helpers=st.booleans(),
)
def test_random_fault_schedules_never_produce_a_wrong_tree(
    tmp_path_factory: pytest.TempPathFactory,
    emulator: EmulatorThread,
    prop_workspace: Path,
    seed: int,
    ring: bool,
    merge: float,
    after_exit: float,
    no_exit: float,
    zero: float,
    sever: float,
    split: float,
    helpers: bool,
) -> None:
    emulator.set_faults(
        SpritesFaults(
            seed=seed,
            ring=ring,
            attach_delay=(0.005, 0.05),
            merge_stderr=merge,
            data_after_exit=after_exit,
            no_exit_frame=no_exit,
            zero_frames=zero,
            sever=sever,
            sever_max_bytes=64 * KiB,
            split_frames=split,
        )
    )
    tmp = tmp_path_factory.mktemp("prop")
    dest = tmp / "out"
    dest.mkdir()
    (dest / "previous").write_text("the old tree\n")
    before = snapshot(dest)
    opts = options(
        tmp, chunk_size=64 * KiB, max_attempts=6, force=True, timeout=120, helpers=helpers
    )
    try:
        pull_sprite(emulator, "prop", prop_workspace, dest, opts)
    except WsyncError:
        assert snapshot(dest) == before  # untouched
    else:
        assert_exact(prop_workspace, dest)
    shutil.rmtree(tmp, ignore_errors=True)
