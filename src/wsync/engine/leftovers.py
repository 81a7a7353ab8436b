"""What a pull leaves behind and picks up again: its tree beside DEST, its runs' snapshots.

A pull's work outlives it on purpose: a failed or killed run leaves its tmp tree beside DEST
and its chunks in the journal, and the next run of the same pull finds both again (the tree
under the same name, the snapshot when the journal says it was admitted for the same run).
What no run will resume goes: stale trees of earlier runs, the guest staging of a snapshot
that failed for a reason a retry cannot fix.  :class:`LeftoverRunner` holds those steps,
apart from the producer runs themselves (:mod:`wsync.engine.phases`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Mapping
from typing import Any

import structlog

from wsync.engine.destdir import TMP_HEX, tmp_name
from wsync.engine.guest import GuestPlan
from wsync.engine.journal import Journal
from wsync.engine.phases import _WIND_DOWN_S, StreamRunner, new_snapshot_id
from wsync.engine.winddown import await_thread, in_thread
from wsync.errors import HostIOError, WsyncError
from wsync.protocol.records import CHUNK_SCHEDULE
from wsync.protocol.scripts import SNAPSHOT_ID

log = structlog.get_logger("wsync.pull")


class LeftoverRunner(StreamRunner):
    """A pull's tmp tree and its runs' snapshots (see the module docstring)."""

    # -- the tree beside DEST ------------------------------------------------------

    @property
    def tmp_name(self) -> str:
        """The name beside DEST of this pull's tree (a rerun of it finds it again)."""
        return tmp_name(self.dest.name, self.journal.key[:TMP_HEX])

    async def make_tmp(self, *, reuse: bool) -> tuple[str, int, bool]:
        """The tree beside DEST that becomes DEST (stale ones of earlier runs go): its
        name, fd, and whether it is a reused earlier tree (``reuse``: an incremental pull)."""
        tmp = self.tmp_name
        tmp_fd, warnings, reused, stale = self.target.make_tmp(tmp, reuse=reuse)
        self.warnings.extend(warnings)
        await self._remove_leftovers(stale)
        return tmp, tmp_fd, reused

    async def sweep_leftovers(self) -> None:
        """A pull that builds no tree (nothing changed) removes what killed or failed runs
        left beside DEST, its own included (it is done: no rerun takes that tree up):
        without this, a partial copy of DEST from a killed ``--full`` pull stayed until a
        pull that changed something."""
        try:
            found = await in_thread(self.target.leftovers)
        except (HostIOError, OSError) as exc:
            self.warnings.append(f"the left-overs of earlier pulls were not looked for: {exc}")
            return
        # never the previous tree (--keep-prev's, or one the next pull that changes
        # something removes)
        stale = [name for name in found if name != self.target.prev_name]
        if self.options.keep_prev and self.target.prev_name not in found:
            # a killed --keep-prev run renamed the kept tree to this pull's name: the
            # next pull that changes something starts from it (with the kept tree still
            # there, this name holds something else: a killed whole-tree run's copy)
            stale = [name for name in stale if name != self.tmp_name]
        await self._remove_leftovers(stale)

    async def _remove_leftovers(self, names: list[str]) -> None:
        for name in names:
            try:
                await in_thread(self.target.removal(name))
            except (HostIOError, OSError) as exc:
                self.warnings.append(f"a left-over of an earlier pull was not removed: {exc}")

    async def remove_tmp(self, tmp: str) -> None:
        """Remove the partial tree beside DEST (bounded; the next run removes what stays).

        It gets a stale name first, here: a worker that could not be stopped (``stuck``)
        or a removal that outlives its bound then works in a tree no later pull takes for
        its own."""
        self.target.close_tmp()
        try:
            work = self.target.removal(tmp)
        except OSError as exc:
            log.warning("tmp tree not removed", tmp=str(tmp), error=str(exc))
            return
        if self.stuck:
            return

        def remove() -> None:
            try:
                work()
            except (WsyncError, OSError) as exc:  # the pull's own error is what is reported
                log.warning("tmp tree not removed", tmp=str(tmp), error=str(exc))

        remover = threading.Thread(target=remove, name="wsync-cleanup", daemon=True)
        remover.start()
        if not await await_thread(remover, _WIND_DOWN_S):
            log.info("partial tree not removed yet; the next run removes it", tmp=str(tmp))

    # -- the runs' snapshots ----------------------------------------------------------

    def choose_snapshot(
        self, plan: GuestPlan, journal: Journal, mode: str, extra: Mapping[str, Any]
    ) -> str:
        """The snapshot of ``journal`` to resume when it was admitted for the same run
        (same mode, and for a select run the same list), else a fresh one."""
        wanted = {
            "sandbox": self.transport.description,
            "workspace": self.workspace,
            "staging_root": self.options.staging_root,
            "chunk_size": self.options.chunk_size,
            # chunks that grow: a journal of another schedule (an older wsync's fixed
            # chunks) is not resumed, its guest index would not parse
            "chunk_schedule": CHUNK_SCHEDULE,
            "algorithm": plan.algorithm.name,
            "compressor": plan.compressor,
            **({"mode": mode} if mode != "tar" else {}),
            **extra,
        }
        meta = journal.meta
        fresh = meta is not None and (
            time.time() - float(meta.get("created", 0)) < self.options.staging_ttl
        )
        if meta and fresh and all(meta.get(k) == v for k, v in wanted.items()):
            snapshot = str(meta["snapshot"])
            log.info("resuming", snapshot=snapshot)
            return snapshot
        snapshot = new_snapshot_id()
        journal.start({**wanted, "snapshot": snapshot, "created": time.time()})
        # (only now, as --restart does: killed in between, a snapshot both resumable and
        # named for cleanup could lose its staging under the run that resumes it)
        self.abandon(meta)
        return snapshot

    def give_up(self, *journals: Journal) -> None:
        """Forget the runs ``journals`` hold, then name their snapshots for the guest's
        cleanup (:meth:`abandon`): in that order, as ``--restart`` does, so that a run
        killed in between leaves no snapshot both resumable and named for removal."""
        metas = [journal.meta for journal in journals]
        for journal in journals:
            journal.forget()
        for meta in metas:
            self.abandon(meta)

    def abandon(self, meta: Mapping[str, Any] | None) -> None:
        """The snapshot an earlier run journaled in ``meta``, which no run resumes now: its
        guest staging goes in this pull's last cleanup (and in every later run's, until one
        succeeds: :meth:`Journal.note_forgotten`).  Without this a killed pull rerun with
        another chunk size, exclude or compressor, or after a new listing, left the killed
        run's whole archive in the guest until the staging's GC, a day later."""
        old = meta.get("snapshot") if meta else None
        if not isinstance(old, str) or not SNAPSHOT_ID.fullmatch(old):
            return
        if self.options.keep_staging or self.options.dry_run:
            return  # kept on request; a dry run's journal is its own (no content run)
        self.journal.note_forgotten(old)
        if old not in self.snapshots:
            self.snapshots.append(old)

    async def clean_guest(self, *snapshots: str) -> WsyncError | TimeoutError | None:
        """Remove ``snapshots`` (by default the session's) from the guest staging, in one
        call within two call timeouts, and never more than a second past the pull's
        overall deadline (the cleanup after the swap runs outside the timeout around the
        rest of the pull: a hung backend must not hold a finished pull for minutes past
        ``--timeout``); the error if it could not (the guest's GC removes what stays)."""
        bound = self.options.call_timeout * 2
        if self.deadline is not None:
            bound = min(bound, max(1.0, self.deadline - time.monotonic()))
        try:
            async with asyncio.timeout(bound):
                await self.session.cleanup(*snapshots)
        except TimeoutError:
            return TimeoutError(f"the cleanup call gave up after {bound:.1f}s")
        except WsyncError as exc:
            return exc
        return None

    async def clean_snapshot(self, *snapshots: str) -> None:
        """:meth:`clean_guest` of ``snapshots``, a failure a warning of the pull."""
        error = await self.clean_guest(*snapshots)
        if error is not None:
            self.warnings.append(f"guest staging not removed (GC removes it later): {error}")

    async def clean_other_runs(self) -> None:
        """Remove the staging of this pull's runs but the one it stopped in, now: for a
        pull that keeps that run for the next (a host limit), whose listing is replayed
        from the journal, not from the guest."""
        current = self.session.snapshot
        others = [s for s in dict.fromkeys(self.snapshots) if s != current]
        if others and self.session.algorithm and not self.options.keep_staging:
            self.snapshots = [s for s in self.snapshots if s == current]
            await self.clean_snapshot(*others)

    async def discard(self) -> None:
        """Forget a snapshot that failed for a reason a retry of it cannot fix: remove the
        guest staging now (a full guest disk must not stay full until the GC) and the
        journal's chunks, so that the next run starts a fresh snapshot."""
        if self.session.snapshot and self.session.algorithm and not self.options.keep_staging:
            # (with a manifest run's staging this pull left for its last cleanup)
            error = await self.clean_guest(*dict.fromkeys([*self.snapshots, self.session.snapshot]))
            if error is not None:
                log.warning("failed snapshot not removed from the guest", error=str(error))
        with contextlib.suppress(WsyncError):
            self.chunk_journal.forget()
            if self.manifest_journal is not None:
                # no run of that listing is left to resume: the next run lists afresh
                self.manifest_journal.forget()
