"""The engine's public surface: options in, progress out, one result.

The CLI, the daemon and the sidecar all drive pulls through these types, so a
``wsync pull --json`` line, a daemon job's ``result`` and a metrics sample are
the same numbers.  Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wsync.engine.excludes import Excludes
from wsync.engine.itemize import strict_text
from wsync.errors import Interrupted, WsyncError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def human_bytes(n: float) -> str:
    """``1.5 MiB``: a size for a message or the progress line."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/wsync``, falling back to ``~/.local/state/wsync``."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "wsync"


@dataclasses.dataclass(frozen=True, slots=True)
class ExtractLimits:
    """Bounds that stop a compression bomb or a hostile archive from filling the host."""

    max_files: int = 5_000_000
    max_bytes: int = 256 * GiB
    #: refuse to write when the destination filesystem would drop below this
    min_free_bytes: int = 256 * MiB


@dataclasses.dataclass(frozen=True, slots=True)
class PullOptions:
    """How one pull behaves.  Defaults suit an interactive ``wsync pull``."""

    state_dir: Path = dataclasses.field(default_factory=default_state_dir)
    #: chunk reads in flight at once
    parallel: int = 4
    #: run guest calls through long-lived guest helpers where the transport has live
    #: channels (ssh, docker, k8s, sprites, e2b, local:): a few execs a pull, not one per call
    helpers: bool = True
    #: overall deadline for the whole pull, seconds (0: none)
    timeout: float = 3600.0
    #: deadline of one exec, seconds
    call_timeout: float = 60.0
    #: attempts per guest call (probe, admit, one read) before giving up
    max_attempts: int = 12
    #: producer chunk size (a multiple of 64 KiB)
    chunk_size: int = 4 * MiB
    #: staging root in the guest, outside the workspace; "" means the per-user
    #: ``/tmp/wsync-UID``, resolved in the guest (the journal keys on this
    #: configured value, so resuming works whatever the guest resolves)
    staging_root: str = ""
    #: stale guest staging older than this is garbage-collected, seconds
    staging_ttl: float = 24 * 3600.0
    #: replace a non-empty DEST that wsync did not write before
    force: bool = False
    #: leave guest staging in place after success (debugging)
    keep_staging: bool = False
    #: forget what an interrupted or failed run of this pull left (its journal; its guest
    #: staging goes in this pull's cleanup) and start from a new snapshot
    restart: bool = False
    #: preferred compressor in the guest: "zstd" or "gzip" (falls back when missing)
    compressor: str = "zstd"
    #: the compression level 1-19, or None to choose it from the link's measured speed
    #: (:mod:`wsync.protocol.level`; gzip stays at 1 then)
    compress_level: int | None = None
    limits: ExtractLimits = dataclasses.field(default_factory=ExtractLimits)
    #: keep the replaced tree beside DEST (``.NAME.wsync-prev``, hard links to DEST's
    #: files) so the next incremental pull starts from it and costs what changed, not what
    #: DEST holds (:mod:`wsync.engine.prevtree`).  Off by default: DEST's files then show
    #: a link count of 2, and removing DEST frees no space until that tree goes too
    keep_prev: bool = False
    #: take files that never stopped changing while read as last read (listed in
    #: ``unstable_files``) instead of failing with exit 24
    best_effort: bool = False
    #: when set, DEST must lie beneath this directory, and DEST's parent is
    #: reached from it without following symlinks at the time of the write
    #: (the daemon sets it to the dest root that DEST was accepted under)
    dest_root: Path | None = None
    #: called on the pull's thread just before DEST is replaced; raising (e.g.
    #: :class:`~wsync.errors.Fenced`) stops the swap.  A daemon fleet uses it so a
    #: daemon whose lease ran out (frozen, cut off from the store) never swaps
    fence: Callable[[], None] | None = None
    #: a full pull even when DEST holds a baseline of this sandbox (issue 8)
    full: bool = False
    #: entries left out in the guest and deleted from DEST (rsync/.gitignore patterns)
    excludes: Excludes = dataclasses.field(default_factory=Excludes.none)
    #: manifest and diff only: report the changes (``PullResult.changes``), write nothing
    dry_run: bool = False


@dataclasses.dataclass(slots=True)
class Progress:
    """A snapshot of a running pull, emitted often; cheap to copy."""

    #: probe | manifest | diff | admit | pull | extract | apply | swap | cleanup | done
    phase: str = "probe"
    snapshot: str = ""
    bytes_fetched: int = 0
    #: total archive bytes once the guest producer finished, else None
    archive_bytes: int | None = None
    #: archive bytes the guest has produced so far
    archive_produced: int = 0
    chunks_done: int = 0
    chunks_total: int | None = None
    resumed_chunks: int = 0
    #: archive bytes of those chunks (on disk from an earlier run, not fetched in this one)
    bytes_resumed: int = 0
    #: entries the extractor has created so far, counted as ``PullResult.files`` is
    #: (regular files, symlinks, hardlinks); it grows while chunks still arrive, and
    #: is what moves during a resume, whose chunks are already on disk
    files: int = 0
    retries: int = 0
    transferred_bytes: int = 0
    #: integrity faults detected, by kind ("no-envelope", "truncated", "hash-mismatch", ...)
    faults: dict[str, int] = dataclasses.field(default_factory=dict)


ProgressCallback = Callable[[Progress], None]


@dataclasses.dataclass(slots=True)
class PullResult:
    """The outcome of a pull: what ``--json`` prints and the daemon stores."""

    ok: bool
    sandbox: str
    dest: str
    snapshot: str = ""
    reconciled: bool = False
    files: int = 0
    #: archive bytes (compressed stream length)
    bytes: int = 0
    #: bytes read over the transport in this run, retries included
    transferred_bytes: int = 0
    #: commands run in the guest in this run (retries included)
    execs: int = 0
    chunks: int = 0
    resumed_chunks: int = 0
    retries: int = 0
    faults: dict[str, int] = dataclasses.field(default_factory=dict)
    elapsed_s: float = 0.0
    warnings: list[str] = dataclasses.field(default_factory=list)
    #: files that changed every time they were read (only with ``best_effort``)
    unstable_files: list[str] = dataclasses.field(default_factory=list)
    #: "full" (the whole workspace was archived) or "incremental" (only changes)
    mode: str = "full"
    #: entries fetched or changed in DEST, and entries of DEST deleted (issue 8)
    changed_files: int = 0
    deleted_files: int = 0
    #: bytes of regular files in the tree DEST holds now (0 when not known)
    tree_bytes: int = 0
    #: ``rsync -i`` style lines of a ``dry_run``
    changes: list[str] = dataclasses.field(default_factory=list)
    #: the level the archive was compressed at in the guest (0: not known, as no archive
    #: was admitted this run or it adopted one an earlier run started)
    compress_level: int = 0
    #: bytes per second the link carried this run's reads (0: too few to tell)
    link_bytes_per_s: int = 0
    error: str | None = None
    error_kind: str | None = None
    exit_code: int = 0

    @classmethod
    def from_error(
        cls, sandbox: str, dest: Path | str, error: BaseException, elapsed: float
    ) -> PullResult:
        """The ``--json`` shape of a failed pull, with what it did so far where the engine
        told (``so_far`` on the error: retries, faults, execs, bytes read, snapshot)."""
        so_far = getattr(error, "so_far", None) or {}
        if isinstance(error, asyncio.CancelledError):
            error = Interrupted("cancelled")
        code = error.exit_code if isinstance(error, WsyncError) else 1
        kind = error.kind if isinstance(error, WsyncError) else "internal"
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(
            ok=False,
            sandbox=sandbox,
            dest=str(dest),
            elapsed_s=elapsed,
            error=str(error),
            error_kind=kind,
            exit_code=code,
            **{k: v for k, v in so_far.items() if k in known},
        )

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["elapsed_s"] = round(self.elapsed_s, 3)
        if self.ok:
            for key in ("error", "error_kind"):
                data.pop(key)
        return {key: _strict(value) for key, value in data.items()}


def _strict(value: Any) -> Any:
    """``value`` with every string made strict UTF-8 (:func:`strict_text`): paths and
    messages from the command line may be raw bytes."""
    if isinstance(value, str):
        return strict_text(value)
    if isinstance(value, dict):
        return {strict_text(k) if isinstance(k, str) else k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value
