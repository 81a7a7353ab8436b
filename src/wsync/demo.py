"""``wsync demo``: the field reports, reproduced and beaten, in one command.

It builds a sample workspace, then copies it twice through a backend that
lies the way the field reports say backends lie:

1. the naive way every broken tool does it: one exec of
   ``tar -cf - . | zstd``, exit code trusted, output extracted;
2. with ``wsync pull``.

The naive copy comes back corrupt (or fails); wsync's comes back exact.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import zstandard

from wsync.engine.api import PullOptions, human_bytes
from wsync.engine.pull import pull_uri
from wsync.errors import UsageError, WsyncError
from wsync.transports.registry import open_transport
from wsync.treediff import diff


def make_workspace(root: Path, *, seed: int = 7, small_files: int = 1500) -> None:
    """A small agent workspace: sources, a binary blob, many small files, links."""
    rng = random.Random(seed)  # noqa: S311 - sample data
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "build" / "empty").mkdir(parents=True)
    (root / "data").mkdir()
    for i in range(small_files):
        words = " ".join(rng.choice(("agent", "tool", "call", "result", "ok")) for _ in range(40))
        (root / "src" / "pkg" / f"mod_{i:04d}.py").write_text(f"# module {i}\nTEXT = {words!r}\n")
    (root / "data" / "model.bin").write_bytes(rng.randbytes(3 * 1024 * 1024))
    (root / "data" / "log.jsonl").write_text(
        "".join(
            json.dumps({"turn": i, "msg": "x" * rng.randrange(200)}) + "\n" for i in range(3000)
        )
    )
    run = root / "run.sh"
    run.write_text("#!/bin/sh\necho hello from the agent\n")
    run.chmod(0o755)
    (root / "latest").symlink_to("data/log.jsonl")
    (root / "odd name with spaces.txt").write_text("spaces\n")


async def naive_exec(uri: str, options: Mapping[str, Any]) -> tuple[bytes, int | None, str]:
    """One long exec, exit code trusted: how workspaces get silently corrupted."""
    parsed, transport = open_transport(uri, options)
    try:
        script = 'tar -cf - -C "$1" . | zstd -q -c'
        result = await transport.exec(["sh", "-c", script, "sh", parsed.path], timeout=120)
    except WsyncError as exc:
        return b"", None, f"exec failed: {exc}"
    finally:
        await transport.aclose()
    return result.stdout, result.exit_status, ""


def naive_extract(data: bytes, status: int | None, dest: Path) -> str:
    """Extract what the naive exec returned, as a naive tool would."""
    dest.mkdir(parents=True)
    received = f"exit status {status}, {human_bytes(len(data))} received"
    try:
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
        with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
            tf.extractall(dest, filter="data")
    except (zstandard.ZstdError, tarfile.TarError, OSError, EOFError) as exc:
        return f"{received}, archive unreadable ({type(exc).__name__})"
    return received


@contextlib.contextmanager
def backend(kind: str, workdir: Path, workspace: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (uri, transport options) for a lossy backend serving ``workspace``."""
    if kind == "local":
        yield f"local:{workspace}", {"chaos": "all,seed=11"}
        return
    if kind == "e2b":
        from wsync.emulators.e2b import E2BFaults
        from wsync.emulators.e2b import EmulatorThread as E2BThread

        with E2BThread(workdir / "e2b", faults=E2BFaults.all_on(seed=11)) as envd:
            envd.create_sandbox("demo")
            yield f"e2b://demo{workspace}", envd.transport_options()
        return
    if kind == "daytona":
        from wsync.emulators.daytona import DaytonaEmulatorThread, DaytonaFaults

        with DaytonaEmulatorThread(workdir / "daytona", faults=DaytonaFaults.all_on(11)) as emu:
            emu.create_sandbox("demo")
            yield f"daytona://demo{workspace}", emu.transport_options()
        return
    if kind == "cloudflare":
        from wsync.emulators.cloudflare import CloudflareFaults
        from wsync.emulators.cloudflare import EmulatorThread as Bridge

        with Bridge(workdir / "cloudflare", faults=CloudflareFaults.all_on(seed=11)) as bridge:
            bridge.create_sandbox("demo")
            yield f"cloudflare://demo{workspace}", bridge.transport_options()
        return
    if kind == "docker":
        from wsync.emulators.docker import DockerFaults
        from wsync.emulators.docker import EmulatorThread as DockerThread

        # seed 14: the first start (the naive copy's) draws the dropped final frame
        with DockerThread(workdir / "docker", faults=DockerFaults.all_on(seed=14)) as daemon:
            daemon.create_container("demo")
            yield f"docker://demo{workspace}", daemon.transport_options()
        return
    if kind == "k8s":
        from wsync.emulators.k8s import K8sEmulatorThread, K8sFaults

        # seed 13: the naive tar (the emulator's 2nd exec) loses its tail behind a Success
        with K8sEmulatorThread(workdir / "k8s", faults=K8sFaults.all_on(seed=13)) as cluster:
            cluster.create_pod("demo")
            yield f"k8s://default/demo{workspace}", cluster.transport_options()
        return
    from wsync.emulators.sprites import EmulatorThread, SpritesFaults

    # seed 12: the first exec (the naive copy's) is severed after 39,674 bytes, whatever
    # the timing (the ring's lost head, its other fault here, needs a fast guest)
    with EmulatorThread(workdir / "sprites", faults=SpritesFaults.all_on(seed=12)) as emu:
        emu.create_sprite("demo")
        yield f"sprites://demo{workspace}", emu.transport_options()


def run_demo(args: argparse.Namespace) -> int:
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="wsync-demo-"))
    workdir = workdir.resolve()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file of that name, a parent that cannot be made
        raise UsageError(f"--dir {workdir}: {err.strerror or err}") from None
    workspace = workdir / "workspace"
    naive_dest, wsync_dest = workdir / "naive-copy", workdir / "wsync-copy"
    for path in (workspace, naive_dest, wsync_dest):
        if path.exists():
            print(f"wsync demo: {path} already exists; use an empty --dir", file=sys.stderr)
            return 2

    def say(text: str) -> None:
        if not args.json:
            print(text, file=sys.stderr)

    say(f"sample workspace: {workspace}")
    make_workspace(workspace)
    files = sum(len(f) + len(d) for _, d, f in os.walk(workspace))
    say(f"  {files} entries; backend: {args.backend} with every field-report fault on")
    options = PullOptions(state_dir=workdir / "state", staging_root=str(workdir / "staging"))
    with backend(args.backend, workdir, workspace) as (uri, topts):
        data, status, failure = asyncio.run(naive_exec(uri, topts))
        naive_note = failure or naive_extract(data, status, naive_dest)
        naive_problems = diff(workspace, naive_dest)
        started = time.monotonic()
        try:
            result = asyncio.run(pull_uri(uri, wsync_dest, options, topts))
        except WsyncError as exc:
            print(f"wsync demo: wsync pull failed: {exc}", file=sys.stderr)
            return exc.exit_code
    wsync_problems = diff(workspace, wsync_dest)
    outcome = {
        "workspace": str(workspace),
        "backend": args.backend,
        "naive": {
            "dest": str(naive_dest),
            "exact": not naive_problems,
            "problems": len(naive_problems),
            "note": naive_note,
        },
        "wsync": {
            "dest": str(wsync_dest),
            "exact": not wsync_problems,
            "problems": len(wsync_problems),
            "retries": result.retries,
            "faults": result.faults,
            "elapsed_s": round(time.monotonic() - started, 2),
        },
    }
    if args.json:
        print(json.dumps(outcome))
    else:
        verdict = "EXACT" if not naive_problems else f"CORRUPT ({len(naive_problems)} differences)"
        say(f"\nnaive single-stream copy: {verdict}\n  {naive_note}\n  -> {naive_dest}")
        for line in naive_problems[:5]:
            say(f"     {line}")
        faults = ", ".join(f"{k} {v}" for k, v in sorted(result.faults.items())) or "none"
        verdict = "EXACT" if not wsync_problems else f"WRONG ({len(wsync_problems)} differences)"
        say(f"\nwsync pull: {verdict}\n  {result.retries} retries; faults detected: {faults}")
        say(f"  -> {wsync_dest}")
    return 0 if not wsync_problems else 6
