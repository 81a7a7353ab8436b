"""The Sprites emulator reproduces field report 1, driven by a naive client.

The naive client is what the report's ``repro.mjs`` did: one exec per file,
read frames until the exit frame, trust the exit code.  Against the emulator
it must see exactly the report's table — and each other fault the report
describes must be observable on the wire.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from wsync.emulators.sprites import SpritesEmulator, SpritesFaults
from wsync.transports.sprites_protocol import (
    STDERR,
    STDOUT,
    Control,
    Data,
    Exit,
    decode,
    encode_data,
    encode_stdin_eof,
    exec_url,
)

KiB = 1024


@dataclasses.dataclass
class NaiveResult:
    stdout: bytes
    stderr: bytes
    exit_code: int
    controls: list[Control]
    stdout_frames: list[bytes]


async def naive_exec(
    emu: SpritesEmulator, name: str, argv: list[str], stdin: bytes | None = None
) -> NaiveResult:
    """Read frames until the exit frame; a close counts as exit 0 (the public SDK's bug)."""
    url = exec_url(emu.url, name, argv, stdin=True)
    headers = {"Authorization": f"Bearer {emu.token}"}
    out, err, controls, frames = bytearray(), bytearray(), [], []
    code = 0
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        if stdin is not None:
            await ws.send(encode_data(0, stdin))
            await ws.send(encode_stdin_eof())
        while True:
            try:
                frame = decode(await ws.recv())
            except ConnectionClosed:
                break
            if isinstance(frame, Exit):
                code = frame.code
                break
            if isinstance(frame, Control):
                controls.append(frame)
            elif isinstance(frame, Data) and frame.stream == STDOUT:
                out += frame.data
                frames.append(frame.data)
            elif isinstance(frame, Data) and frame.stream == STDERR:
                err += frame.data
    return NaiveResult(bytes(out), bytes(err), code, controls, frames)


def test_naive_client_reproduces_the_report_table(tmp_path: Path) -> None:
    sizes = [16, 64, 256, 1024, 4096]
    table: dict[int, tuple[int, int, bool, bool, bool]] = {}

    async def main() -> None:
        async with SpritesEmulator(tmp_path, faults=SpritesFaults.report_table()) as emu:
            sprite = emu.create_sprite("exec-stream-repro")
            for size in sizes:
                data = os.urandom(size * KiB)
                (sprite / f"f{size}").write_bytes(data)
                got = await naive_exec(emu, "exec-stream-repro", ["cat", f"f{size}"])
                table[size] = (
                    got.exit_code,
                    len(got.stdout),
                    got.stdout == data,
                    got.stdout == data[-64 * KiB :],
                    data.endswith(got.stdout),
                )

    asyncio.run(main())
    print("size exit bytes-received intact received==last-64KB tail")
    for size, row in table.items():
        print(f"{size}KB", *row)
    assert all(row[0] == 0 for row in table.values()), "exit code is 0 in every case"
    assert table[16][1:4] == (16 * KiB, True, True)
    assert table[64][1:4] == (64 * KiB, True, True)
    # the key row: exactly the last 64 KiB of a 1 MiB file
    assert table[1024][1:4] == (65536, False, True)
    # 4 MiB: head missing, what arrives is a contiguous tail (ring + live output)
    size4, intact4, _, tail4 = table[4096][1], table[4096][2], table[4096][3], table[4096][4]
    assert not intact4
    assert tail4
    assert 64 * KiB < size4 < 4096 * KiB
    # 256 KiB: produced entirely before attach in this deterministic model
    assert table[256][4]


def test_stdin_gate_defeats_the_ring(tmp_path: Path) -> None:
    """A reader that waits for one stdin byte before printing loses nothing."""
    data = os.urandom(1024 * KiB)

    async def main() -> NaiveResult:
        async with SpritesEmulator(tmp_path, faults=SpritesFaults.report_table()) as emu:
            (emu.create_sprite("s") / "f").write_bytes(data)
            return await naive_exec(emu, "s", ["sh", "-c", "head -c1 >/dev/null; cat f"], b"x")

    got = asyncio.run(main())
    assert got.stdout == data
    assert got.exit_code == 0


def test_merged_stderr_arrives_inside_one_stdout_frame(tmp_path: Path) -> None:
    faults = SpritesFaults(merge_stderr=1.0)
    # (half a second apart: three reads of the pipes even on a loaded machine)
    script = "printf AAAA; sleep 0.5; printf BBBB 1>&2; sleep 0.5; printf CCCC"

    async def main() -> NaiveResult:
        async with SpritesEmulator(tmp_path, faults=faults) as emu:
            emu.create_sprite("s")
            return await naive_exec(emu, "s", ["sh", "-c", script])

    got = asyncio.run(main())
    assert got.stdout == b"AAAACCCCBBBB"
    assert b"CCCCBBBB" in got.stdout_frames
    assert got.stderr == b""


def test_naive_client_loses_data_after_the_exit_frame(tmp_path: Path) -> None:
    faults = SpritesFaults(data_after_exit=1.0, seed=3)
    data = os.urandom(200 * KiB)

    async def main() -> NaiveResult:
        async with SpritesEmulator(tmp_path, faults=faults) as emu:
            (emu.create_sprite("s") / "f").write_bytes(data)
            return await naive_exec(emu, "s", ["cat", "f"])

    got = asyncio.run(main())
    assert got.exit_code == 0
    assert len(got.stdout) < len(data)
    assert data.startswith(got.stdout)


def test_no_exit_frame_and_zero_frames_look_like_exit_0_to_the_naive_client(
    tmp_path: Path,
) -> None:
    async def main() -> tuple[NaiveResult, NaiveResult, dict[str, int]]:
        async with SpritesEmulator(tmp_path, faults=SpritesFaults(no_exit_frame=1.0)) as emu:
            emu.create_sprite("s")
            no_exit = await naive_exec(emu, "s", ["sh", "-c", "echo hi; exit 9"])
            emu.faults = SpritesFaults(zero_frames=1.0)
            zero = await naive_exec(emu, "s", ["sh", "-c", "echo hi; exit 9"])
            return no_exit, zero, dict(emu.stats)

    no_exit, zero, stats = asyncio.run(main())
    assert (no_exit.stdout, no_exit.exit_code) == (b"hi\n", 0)  # the real status was 9
    assert (zero.stdout, zero.exit_code, zero.controls) == (b"", 0, [])
    assert stats["no_exit_frame"] == 1
    assert stats["zero_frames"] == 1


def test_session_info_and_debug_messages(tmp_path: Path) -> None:
    async def main() -> NaiveResult:
        async with SpritesEmulator(tmp_path) as emu:
            emu.create_sprite("s")
            return await naive_exec(emu, "s", ["true"])

    got = asyncio.run(main())
    kinds = [c.type for c in got.controls]
    assert kinds.count("debug") == 2
    info = next(c for c in got.controls if c.type == "session_info")
    assert info.payload["is_owner"] is False
    assert info.payload["tty"] is False


def test_auth_and_unknown_sprite_are_rejected_at_the_handshake(tmp_path: Path) -> None:
    async def status(emu: SpritesEmulator, name: str, token: str) -> int:
        url = exec_url(emu.url, name, ["true"], stdin=False)
        try:
            async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}):
                return 101
        except InvalidStatus as err:
            return err.response.status_code

    async def main() -> list[int]:
        async with SpritesEmulator(tmp_path, token="right") as emu:
            emu.create_sprite("s")
            return [
                await status(emu, "s", "wrong"),
                await status(emu, "nope", "right"),
                await status(emu, "s", "right"),
            ]

    assert asyncio.run(main()) == [401, 404, 101]


@pytest.mark.parametrize("seed", [1, 2])
def test_fault_schedule_is_reproducible_from_the_seed(seed: int) -> None:
    faults = SpritesFaults.field_report(seed)
    plans = [faults.plan(random.Random(f"{seed}/{n}")) for n in range(20)]
    again = [faults.plan(random.Random(f"{seed}/{n}")) for n in range(20)]
    strip = [(p.merged, p.after_exit, p.no_exit, p.zero_frames, p.attach_delay) for p in plans]
    assert strip == [
        (p.merged, p.after_exit, p.no_exit, p.zero_frames, p.attach_delay) for p in again
    ]
    assert any(p.merged for p in plans)
    assert any(p.zero_frames for p in plans)
