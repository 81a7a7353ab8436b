"""``wsync doctor``: does this backend lose bytes?  Measure it like the field report.

For each size (16 KiB … 4 MiB) it writes a random file in the guest's staging
area, reads it back with **one plain exec** (``cat``, no stdin, exit code
trusted — what naive tools do) and compares what arrived with the file, as the
Sprites report's table does.  Then it reads the same file through wsync's
verified path.  Sizes that arrive short, long, or with the head missing mean
the backend is lossy; the last column shows wsync reading them exactly anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import sys
from collections.abc import Mapping
from typing import Any

from wsync.engine.api import PullOptions
from wsync.engine.guest import GuestSession
from wsync.engine.guestcall import CallStats
from wsync.errors import UsageError, WsyncError
from wsync.protocol import scripts
from wsync.protocol.records import printable
from wsync.transports.base import Transport
from wsync.transports.registry import open_transport

SIZES = (16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024, 4096 * 1024)


async def _measure(transport: Transport, workspace: str, staging_root: str) -> dict[str, Any]:
    options = PullOptions(staging_root=staging_root, max_attempts=12, call_timeout=60)
    stats = CallStats()
    session = GuestSession(transport, options, stats)
    report: dict[str, Any] = {"sandbox": transport.description}
    try:
        plan = await session.probe(workspace, free=True)
    except UsageError as exc:
        report["workspace_problem"] = str(exc)
        session.algorithm = None
        raise
    probe = plan.probe
    report["probe"] = {
        "tar": probe.tar_version,
        "compressor": plan.compressor,
        "hash": plan.algorithm.name,
        "tools": sorted(probe.tools),
        "stage_free_kb": probe.stage_free_kb,
        "stage_root": probe.stage_root,
        "uid": probe.uid,
    }
    rows = []
    token = secrets.token_hex(4)
    for size in SIZES:
        snapshot = f"doctor-{token}-{size}"
        folder = scripts.snapshot_dir(session.staging_root, snapshot)
        session.snapshot = snapshot
        row: dict[str, Any] = {"size": size}
        try:
            truth = await _make_file(transport, session, folder, size)
        except WsyncError as exc:
            row["verified"] = f"failed: {exc}"
            rows.append(row)
            continue
        try:
            naive = await transport.exec(["cat", f"{folder}/data"], timeout=60)
            got = naive.stdout
            row.update(
                exit=naive.exit_status,
                received=len(got),
                intact=got == truth,
                tail_match=bool(got) and truth.endswith(got),
            )
        except WsyncError as exc:
            row.update(exit=None, received=0, intact=False, tail_match=False, error=str(exc))
        row["verified"] = "intact" if len(truth) == size else "short"
        rows.append(row)
        with contextlib.suppress(WsyncError):
            await transport.exec(["rm", "-rf", folder], timeout=60)
    report["rows"] = rows
    report["verified_retries"] = stats.retries
    report["faults"] = dict(stats.faults)
    report["lossy"] = any(not r.get("intact", False) for r in rows)
    return report


async def _make_file(transport: Transport, session: GuestSession, folder: str, size: int) -> bytes:
    """Create a random file in the guest and read it back verified (the truth).

    The creating exec's own result is not evidence (its exit code may be made
    up), so success is judged only by the verified read that follows.
    """
    make = 'umask 077; mkdir -p "$1" && head -c "$2" /dev/urandom > "$1/data"'
    last: WsyncError | None = None
    for _ in range(5):
        with contextlib.suppress(WsyncError):
            await transport.exec(["sh", "-c", make, "sh", folder, str(size)], timeout=60)
        try:
            return await session.read("data", 0, size)
        except WsyncError as exc:
            last = exc
    assert last is not None
    raise last


def _print(report: dict[str, Any]) -> None:
    out = sys.stdout
    probe = report["probe"]
    out.write(f"sandbox      {report['sandbox']}\n")
    out.write(f"tar          {probe['tar']}\n")
    out.write(f"compressor   {probe['compressor']}    hash {probe['hash']}\n")
    free = probe["stage_free_kb"]
    out.write(f"staging root {printable(probe['stage_root'])}\n")
    out.write(f"staging free {free // 1024 if free is not None else '?'} MiB\n\n")
    out.write("plain exec (one `cat`, exit code trusted) vs wsync verified read\n")
    out.write(f"{'size':>8} {'exit':>5} {'received':>10} {'intact':>7} {'==tail':>7}  wsync\n")
    for r in report["rows"]:
        exit_s = "none" if r.get("exit") is None else str(r["exit"])
        out.write(
            f"{r['size'] // 1024:>7}K {exit_s:>5} {r.get('received', 0):>10} "
            f"{r.get('intact', False)!s:>7} {r.get('tail_match', False)!s:>7}  {r['verified']}\n"
        )
    verdict = (
        "this backend LOSES BYTES on plain exec; wsync's verified reads were exact"
        if report["lossy"]
        else "plain exec was intact for every size"
    )
    out.write(f"\n{verdict} ({report['verified_retries']} verified-read retries)\n")


def run_doctor(args: argparse.Namespace, transport_options: Mapping[str, Any]) -> int:
    uri, transport = open_transport(args.sandbox, transport_options)

    async def go() -> dict[str, Any]:
        try:
            return await _measure(transport, uri.path, args.staging_dir)
        finally:
            await transport.aclose()

    report = asyncio.run(go())
    if args.json:
        print(json.dumps(report))
    else:
        _print(report)
        for key in ("workspace_problem",):
            if key in report:
                print(printable(report[key]), file=sys.stderr)
    return 0
