"""What a pull does after its swap: DEST is final, and nothing here may fail the pull.

Three pieces of work, each a warning when it fails, run side by side where they are
independent: the guest's staging is removed (a round trip, :meth:`FinishRunner.finish`);
the old tree is removed, or kept for the next pull (``--keep-prev``) minus what the new
DEST does not share (its prune, before the commit: it reads the diff's tables, which the
commit changes); and the incremental state is committed.

Why side by side: on a large tree the old tree's removal takes as long as everything
before it (one ``unlink`` per entry, one ``rmdir`` per directory: the kernel's time), and
the commit no longer has to wait for it.  The commit records what the pull kept from the
diff's scan and a ctime window that the removal's unlinks fall in
(:meth:`wsync.engine.incstate.PullState.window`), closed once the removal is done.
(Pruning a kept tree beside the commit, from a list read first, was tried: a 1% pull of
59k entries ended no sooner, median 2.61 s against 2.62 s over 8 interleaved rounds.)
"""

from __future__ import annotations

import asyncio
import os

from wsync.engine.incphases import IncrementalRunner
from wsync.engine.incremental import Incremental
from wsync.engine.linkmemo import remember
from wsync.engine.winddown import in_thread
from wsync.errors import HostIOError, WsyncError
from wsync.protocol import level


class FinishRunner(IncrementalRunner):
    """The phases after the swap (see the module docstring)."""

    @property
    def keeps_prev(self) -> bool:
        """This pull starts from, and leaves, a previous tree (``--keep-prev``, and a diff
        against DEST to say what in it to keep)."""
        return self.options.keep_prev and self.inc is not None and self.inc.reuses

    async def finish(self, old: str | None) -> None:
        """The old tree removed, the guest staging cleaned up and the journal forgotten;
        problems become warnings."""
        self.emit("cleanup")
        # the guest's staging goes while the host removes the old tree and commits: the
        # two are independent, and a remote backend's round trip need not add to the pull
        staging = None if self.options.keep_staging else asyncio.create_task(self.clean_staging())
        try:
            await self.finish_host(old)
            if staging is not None:
                await staging
        finally:
            if staging is not None and not staging.done():
                staging.cancel()
        rate = self.session.link.rate()
        if rate is not None and self.session.link.meter.bytes >= level.TRUSTED:
            key, state_dir = self.transport.description, self.options.state_dir
            await in_thread(lambda: remember(state_dir, key, rate))
        try:
            self.journal.remove()
        except WsyncError as exc:
            self.warnings.append(f"journal not removed: {exc}")

    async def clean_staging(self) -> None:
        """The staging of every run this pull admitted, in one call."""
        if self.snapshots:
            await self.clean_snapshot(*dict.fromkeys(self.snapshots))

    async def finish_host(self, old: str | None) -> None:
        """The old tree removed (or kept, and pruned first) while the state is committed,
        then the commit's ctime window closed."""
        inc = self.inc
        kept = False
        if old is not None and inc is not None and self.keeps_prev and self.swapped:
            old = await self.keep_prev(inc, old)
            kept = old is None
        removal = None if old is None else asyncio.ensure_future(self.remove_old(old))
        try:
            committed = False
            if inc is not None and self.swapped:
                try:
                    committed = await in_thread(
                        lambda: inc.locked(lambda: inc.commit(kept_prev=kept))
                    )
                    self.tree_bytes = await in_thread(lambda: inc.locked(inc.tree_bytes))
                except (WsyncError, OSError) as exc:
                    self.warnings.append(
                        f"incremental state not recorded (next pull re-checks): {exc}"
                    )
            if removal is not None:
                await removal
            if inc is not None and committed:
                try:
                    await in_thread(lambda: inc.locked(inc.close_window))
                except (WsyncError, OSError) as exc:  # the next pull re-hashes what moved
                    self.warnings.append(f"incremental state not fully recorded: {exc}")
        finally:
            if removal is not None and not removal.done():
                removal.cancel()

    async def keep_prev(self, inc: Incremental, old: str) -> str | None:
        """Keep the old tree for the next pull (:mod:`wsync.engine.prevtree`), minus what
        the new DEST does not share; returns the name still to remove (None: kept)."""
        prev_fd = self.target.keep_prev(old)
        if prev_fd is None:
            return old

        def prune() -> None:
            # the thread owns the fd: a cancelled wait must not close it under the thread
            # (a reused fd number would point its removals at another directory)
            try:
                inc.locked(lambda: inc.prune_prev(prev_fd))
            finally:
                os.close(prev_fd)

        try:
            await in_thread(prune)
        except (WsyncError, OSError) as exc:
            # what stays is removed by the next pull's reuse, or with the tree
            self.warnings.append(f"the previous tree was not fully pruned: {exc}")
        except BaseException:
            # given up while the prune goes on: no later pull may start from that tree
            self.target.set_aside(self.target.prev_name)
            raise
        return None

    async def remove_old(self, old: str) -> None:
        try:
            await in_thread(self.target.removal(old))
        except (HostIOError, OSError) as exc:
            self.warnings.append(f"the previous tree was not fully removed: {exc}")
