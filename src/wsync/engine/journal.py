"""The durable host journal of one pull: which verified chunks are on disk.

Layout under ``STATE/pulls/KEY/`` (KEY is a hash of the sandbox URI and the
real DEST path, so the same command finds the same journal; a dry run's has
``dry-run`` hashed in too, so that it never touches a real pull's)::

    lock              flock'ed while a wsync process works on this pull
    meta.json         snapshot id and the parameters it was admitted with
    chunks/SEQ.HASH   one file per verified chunk, written durably
    done.json         (a manifest phase) the whole stream is here and verified

A chunk counts only after its file is fsynced and renamed into ``chunks/``
and the directory is fsynced: ``kill -9`` at any moment loses at most the
reads in flight.  On resume a chunk is reused only when the guest's index
names the same hash and the file has the indexed length.

The journal also carries the pull's :class:`~wsync.engine.destdir.DestDir`
(DEST's parent fd and the DEST lock), so both locks are released together on
every path that closes the journal.

``STATE/dests/`` remembers which destination directories wsync wrote, so a
pull refuses to replace a non-empty directory it did not create (unless
``--force``): one typo must not wipe a home directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from wsync.digits import ascii_digits
from wsync.engine.api import human_bytes
from wsync.engine.destdir import DestDir
from wsync.engine.fsutil import free_bytes, fsync_dir, host_io, rmtree, write_atomic
from wsync.errors import Busy, DiskLow, HostIOError, WsyncError
from wsync.protocol.records import DoneRecord

log = structlog.get_logger("wsync.journal")


def _key(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8", "surrogateescape") + b"\x00")
    return h.hexdigest()[:32]


#: journals of pulls nobody resumed for this long are removed
STALE_AFTER = 7 * 24 * 3600.0


#: what reading a journal file may raise when it is unreadable, damaged or not JSON, or
#: JSON nested past the parser's depth (RecursionError): each is no record
_UNREADABLE = (OSError, ValueError, RecursionError)

#: the wait before the third fresh start of a run of refused snapshots, doubled for each
#: later one (see Journal.may_start_afresh), and the longest wait
AFRESH_FIRST_WAIT_S = 60.0
AFRESH_MAX_WAIT_S = 3600.0


class Journal:
    def __init__(
        self,
        state_dir: Path,
        sandbox: str,
        dest: Path,
        min_free: int = 0,
        dest_dir: DestDir | None = None,
        *,
        dry_run: bool = False,
    ) -> None:
        #: DEST's parent fd and lock, closed with the journal (also when open fails)
        self.dest_dir = dest_dir
        # a dry run journals apart: it writes nothing, so it must neither resume nor
        # remove the journal (and the guest staging it names) of a pull that was stopped,
        # which the real rerun finishes
        self.key = _key(sandbox, str(dest), *(["dry-run"] if dry_run else []))
        self.min_free = min_free
        self.dir = state_dir / "pulls" / self.key
        self.chunks_dir = self.dir / "chunks"
        self._lock_fd: int | None = None
        self.meta: dict[str, Any] | None = None

    # -- lifecycle -------------------------------------------------------------

    def open(self) -> Journal:
        try:
            return self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> Journal:
        with host_io(f"opening the journal in {self.dir}"):
            self.chunks_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.utime(fd)  # the lock's mtime says when this pull last ran
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Busy("another wsync pull of this sandbox into this DEST is running") from None
        self._lock_fd = fd
        self._collect_stale()
        try:
            self.meta = json.loads((self.dir / "meta.json").read_text("utf-8"))
        except FileNotFoundError:
            self.meta = None
        except _UNREADABLE:
            self.meta = None  # a damaged meta only costs a fresh start
        return self

    def _collect_stale(self) -> None:
        """Remove other pulls' journals untouched for a week (failed, never resumed)."""
        now = time.time()
        for other in self.dir.parent.iterdir():
            if other == self.dir:
                continue
            with contextlib.suppress(OSError, HostIOError):
                if now - (other / "lock").stat().st_mtime < STALE_AFTER:
                    continue
                fd = os.open(other / "lock", os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    rmtree(other)
                except BlockingIOError:
                    pass  # in use right now
                finally:
                    os.close(fd)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.dest_dir is not None:
            self.dest_dir.close()

    def start(self, meta: dict[str, Any]) -> None:
        """Begin a new snapshot: forget old chunks, record the parameters durably."""
        self.clear_chunks()
        self._unlink("done.json")  # an older snapshot's
        write_atomic(self.dir / "meta.json", json.dumps(meta, sort_keys=True).encode())
        self.meta = meta

    def record_done(self, snapshot: str, done: DoneRecord) -> None:
        """Record durably that ``snapshot``'s whole stream is journaled and verified
        (``done``), so that a later run can replay it without asking the guest."""
        record = {"snapshot": snapshot, **dataclasses.asdict(done)}
        write_atomic(self.dir / "done.json", json.dumps(record, sort_keys=True).encode())

    def has_done(self) -> bool:
        """Whether a :meth:`record_done` record is here, usable or not."""
        return (self.dir / "done.json").exists()

    def recorded_done(self, snapshot: str) -> DoneRecord | None:
        """What :meth:`record_done` recorded for ``snapshot`` (None: nothing, or another
        snapshot's, or unreadable)."""
        try:
            record = json.loads((self.dir / "done.json").read_text("utf-8"))
            if not isinstance(record, dict) or record.pop("snapshot", None) != snapshot:
                return None
            done = DoneRecord(**record)
        except (*_UNREADABLE, TypeError):
            return None
        ok = isinstance(done.chunks, int) and isinstance(done.length, int)
        return done if ok and isinstance(done.digest, str) else None

    def forget(self) -> None:
        """Drop the snapshot and its chunks (it failed for good): the next run starts afresh."""
        self.clear_chunks()
        self._unlink("meta.json", "done.json")  # a listing is never left without its id
        with host_io("clearing the journal"):
            fsync_dir(self.dir)
        self.meta = None

    def restart(self) -> None:
        """Forget every snapshot this pull's journal holds, its phases' too (``--restart``):
        the run starts from a new one.  Their ids are kept for the guest's cleanup
        (:meth:`forgotten`) until the journal goes."""
        ids = []
        for journal in self._journals():
            if journal.meta is not None and isinstance(journal.meta.get("snapshot"), str):
                ids.append(journal.meta["snapshot"])
            journal.forget()
        # only now: killed in between, a snapshot both resumable and listed for cleanup
        # could have its staging removed under the run that resumes it (killed after the
        # forgetting, the ids are lost: the guest's GC takes them a day later)
        self.note_forgotten(*ids)

    def _journals(self) -> list[Journal]:
        """This journal and its phases'."""
        with host_io("reading the journal"):
            phases = sorted(p for p in self.dir.iterdir() if p.name.startswith("phase-"))
        return [self, *(self.phase(p.name.removeprefix("phase-")) for p in phases)]

    def held(self) -> set[str]:
        """The snapshots this journal and its phases' hold: what a rerun resumes."""
        metas = [journal.meta for journal in self._journals()]
        return {m["snapshot"] for m in metas if m and isinstance(m.get("snapshot"), str)}

    def record_refusal(self) -> None:
        """Record that a host limit (``--max-bytes``, ``--max-files``) refused the
        snapshots held now: a later run refused them again under its limits gives them
        up for a fresh one (see :func:`wsync.engine.pull.pull`); one refused for the
        first time (an interrupted pull rerun under a limit lowered by mistake) keeps
        its chunks for the rerun under the limit put right."""
        record = self._refusals()
        record["snapshots"] = sorted(self.held())
        write_atomic(self.dir / "refused.json", json.dumps(record).encode())

    def refused(self) -> set[str]:
        """The snapshots :meth:`record_refusal` recorded (an earlier run's refusal)."""
        ids = self._refusals()["snapshots"]
        return {i for i in ids if isinstance(i, str)} if isinstance(ids, list) else set()

    def give_way(self, refused: set[str], now: float) -> bool:
        """After a host limit refused what this run resumed: whether those snapshots
        give way to a fresh one, and if so forget them (as :meth:`restart`).  Only
        snapshots an earlier run's limit refused already (``refused``, read when the
        run began): one refused for the first time (an interrupted pull rerun under a
        limit lowered by mistake) keeps its chunks for the rerun with the limit put
        right; and not too soon after the last fresh start (:meth:`may_start_afresh`)."""
        try:
            held = self.held()
        except WsyncError:
            return False
        if not held or not held <= refused or not self.may_start_afresh(now):
            return False
        self.restart()
        with contextlib.suppress(WsyncError):  # (unrecorded: no wait before the next)
            self.started_afresh(now)
        return True

    def may_start_afresh(self, now: float) -> bool:
        """Whether a refused snapshot may give way to a fresh one at ``now`` (epoch s).

        Why a wait: a fresh snapshot of a workspace still over the limits costs the
        guest's whole archive and the reads up to the limit, and is refused again.  A
        daemon pulling such a workspace every minute would do that every minute.  So
        the first two fresh starts of a run of them (none succeeding between: success
        removes the journal) are at once (a user who deleted what was too big, maybe
        after one more refused try), and each later one waits twice as long as the
        last: 1, 2, 4 ... minutes after it, at most :data:`AFRESH_MAX_WAIT_S`."""
        record = self._refusals()
        streak, at = record["afresh"], record["at"]
        if not isinstance(streak, int) or not isinstance(at, int | float) or streak <= 1:
            return True
        wait = min(AFRESH_FIRST_WAIT_S * 2.0 ** min(streak - 2, 32), AFRESH_MAX_WAIT_S)
        try:
            elapsed = now - float(at)
        except OverflowError:  # (an int no float holds: a clock far ahead, as below)
            return True
        # (a clock set back since: no wait that long)
        return bool(not 0 <= elapsed < wait)

    def started_afresh(self, now: float) -> None:
        """A refused snapshot gave way to a fresh one at ``now`` (see
        :meth:`may_start_afresh`)."""
        record = self._refusals()
        streak = record["afresh"] if isinstance(record["afresh"], int) else 0
        record.update(snapshots=[], afresh=streak + 1, at=now)
        write_atomic(self.dir / "refused.json", json.dumps(record).encode())

    def _refusals(self) -> dict[str, object]:
        record: dict[str, object] = {"snapshots": [], "afresh": 0, "at": 0}
        try:
            read = json.loads((self.dir / "refused.json").read_text("utf-8"))
        except _UNREADABLE:
            return record
        if isinstance(read, dict):
            record.update((k, read[k]) for k in record if k in read)
        streak = record["afresh"]
        # (a count that is not a plain count, a negative one say, would put off the
        # backoff for as many fresh starts: it counts as none)
        if type(streak) is not int or streak < 0:
            record["afresh"] = 0
        return record

    def note_forgotten(self, *snapshots: str) -> None:
        """Name ``snapshots`` for the guest's cleanup (:meth:`forgotten`): earlier runs'
        snapshots no run resumes now (``--restart``, other options, another listing),
        whose staging (a whole archive, perhaps) would else stay in the guest until its
        GC."""
        ids = set(self.forgotten())
        if not ids.issuperset(snapshots):
            listed = json.dumps(sorted(ids.union(snapshots)))
            write_atomic(self.dir / "forgotten.json", listed.encode())

    def forgotten(self) -> list[str]:
        """Snapshots a ``--restart`` forgot whose guest staging may still be there: every
        run of this pull names them in its cleanup, until one succeeds and the journal
        is removed (a failed run keeps the list for the next)."""
        try:
            ids = json.loads((self.dir / "forgotten.json").read_text("utf-8"))
        except _UNREADABLE:
            return []
        return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []

    def _unlink(self, *names: str) -> None:
        with host_io("clearing the journal"):
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.dir / name)

    def remove(self) -> None:
        """Forget this pull entirely (after success)."""
        with host_io("removing the journal"):
            rmtree(self.dir)

    def phase(self, name: str) -> Journal:
        """The journal of one phase of this pull (``manifest``, ``select``): its own
        snapshot and chunks in ``KEY/phase-NAME/``, under this journal's lock, removed
        with it.  A kill -9 during any phase resumes that phase's chunks."""
        sub = Journal.__new__(Journal)
        sub.dest_dir = None
        sub.key = self.key
        sub.min_free = self.min_free
        sub.dir = self.dir / f"phase-{name}"
        sub.chunks_dir = sub.dir / "chunks"
        sub._lock_fd = None
        with host_io(f"opening the journal in {sub.dir}"):
            sub.chunks_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            sub.meta = json.loads((sub.dir / "meta.json").read_text("utf-8"))
        except _UNREADABLE:
            sub.meta = None
        return sub

    def clear_chunks(self) -> None:
        with host_io("clearing the journal"):
            for entry in os.scandir(self.chunks_dir):
                if entry.is_file(follow_symlinks=False):
                    os.unlink(entry.path)
            fsync_dir(self.chunks_dir)

    # -- chunks ----------------------------------------------------------------

    def chunks(self) -> dict[int, tuple[str, Path]]:
        """Journaled chunks: seq → (hash, path)."""
        found: dict[int, tuple[str, Path]] = {}
        with host_io("reading the journal"):
            for entry in os.scandir(self.chunks_dir):
                seq, dot, digest = entry.name.partition(".")
                if dot and ascii_digits(seq) and digest.isascii() and digest.isalnum():
                    found[int(seq)] = (digest, Path(entry.path))
                else:  # temp files of a killed run
                    os.unlink(entry.path)
        return found

    @staticmethod
    def intact(
        found: dict[int, tuple[str, Path]], digest: Callable[[bytes], str]
    ) -> dict[int, tuple[str, Path]]:
        """The chunks of ``found`` (from :meth:`chunks`) whose bytes still hash to their
        names (worker thread, once a run: a resume reads its chunks back anyway).  A chunk
        damaged on disk since it was journaled would otherwise reach the decompressor,
        which can only call the stream undecodable: the pull ended as a hostile archive
        and threw the whole snapshot away.  A damaged one is removed here and fetched
        again."""
        found = dict(found)
        with host_io("reading the journal"):
            for seq, (want, path) in list(found.items()):
                if digest(path.read_bytes()) != want:
                    log.warning("journaled chunk damaged on disk; fetching it again", seq=seq)
                    os.unlink(path)
                    del found[seq]
        return found

    def chunk_path(self, seq: int, digest: str) -> Path:
        return self.chunks_dir / f"{seq:08d}.{digest}"

    def store(self, seq: int, digest: str, data: bytes) -> Path:
        """Write one verified chunk durably; only then does it count."""
        path = self.chunk_path(seq, digest)
        free = free_bytes(self.chunks_dir, "checking free space in the state directory")
        if free - len(data) < self.min_free:
            raise DiskLow(
                "the state directory's filesystem would drop below its "
                f"{human_bytes(self.min_free)} free-space reserve ({human_bytes(free)} free, "
                f"journal in {self.chunks_dir})"
            )
        try:
            write_atomic(path, data)
        except HostIOError:
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        return path


class DestRegistry:
    """Which DEST directories wsync has written (to refuse clobbering others)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "dests"

    def _marker(self, dest: Path) -> Path:
        return self.dir / _key(str(dest))

    def owns(self, dest: Path) -> bool:
        return self._marker(dest).exists()

    def record(self, dest: Path) -> None:
        with host_io("recording DEST in the state directory"):
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(self._marker(dest), os.fsencode(dest) + b"\n")

    def forget(self, dest: Path) -> None:
        """DEST is not wsync's tree (another program put its own there): the next pull
        must not replace it without ``--force``."""
        with host_io("forgetting DEST in the state directory"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._marker(dest))
            fsync_dir(self.dir)
