"""What the last pull left in DEST, and what this pull must change: state and diff in SQLite.

One SQLite file per DEST, ``STATE/incremental/<sha256 of DEST's real path>.sqlite``, holds
the sandbox key of the last successful pull into DEST and, per entry of the tree it left:
the guest's manifest record, the xxh3_128 of the file's bytes as written on the host, and
the host ``lstat`` signature (kind, mode, size, mtime, ctime, inode): for what that pull
wrote, taken after it; for what it kept, the diff's scan.  Linking a kept inode into the new
tree and unlinking the old tree move its ctime and nothing else, so the commit also records
the window of time those moves fell in (:meth:`PullState.window`) instead of scanning DEST
again once the old tree is gone (as long again as the removal, on a large tree).

Why SQLite: a workspace may hold a million entries, and wsync's memory must stay bounded
(issue 8: peak RSS <= 200 MB for a 1M-entry manifest).  The manifest and a scan of DEST are
streamed into tables of a private scratch database (``ATTACH ''``: an on-disk temporary file
behind a bounded page cache), in batches, and the diff is a few joins on primary keys there.
Nothing in Python ever holds the whole tree: results are read back through cursors.

The diff, per entry of the (excluded-filtered) manifest:

- the guest record differs from the one recorded (kind, mode, size, mtime, ctime, inode,
  link target, content digest): **changed**, fetch it;
- it matches but DEST no longer has it: **missing**, fetch;
- DEST's signature differs from the recorded one in kind, mode, size or mtime: **tampered**
  (edited or chmod'ed on the host), fetch;
- only the inode or ctime differ (a pull that failed after building its farm, a kill -9
  between the swap and the commit, a ``touch -r`` edit on the host), the ctime not into the
  last commit's window: **re-hash** the file
  (or re-read the link) and compare with the recorded hash; equal keeps it, else fetch.
  This is what makes an interrupted pull cost a local re-hash, never a wrong tree;
- otherwise it is kept: the farm links it into the new tree.

Entries of DEST that the filtered manifest does not have are **deleted** (they are simply
not linked into the new tree; excluded paths an earlier pull left go away too).  Guest files
sharing an inode (hardlinks) are fetched together: if one is fetched, all are.  Directories
are never fetched: the farm creates every one fresh and their modes and mtimes are set from
the manifest (:func:`wsync.engine.farm.set_dir_meta`); a directory whose record or host
metadata changed still counts as a change, so "nothing changed" means nothing at all.

Without a baseline (first pull, another sandbox, unreadable state) the same diff runs
against an empty state: every file is fetched and every directory created.

Most of a manifest is the last one again, byte for byte.  The state keeps each recorded
entry's record fingerprint (:mod:`wsync.protocol.manifest`, "known records"), and the load
(:mod:`wsync.engine.incload`) copies the rows of the records the parser met unchanged from
the state in one statement instead of parsing and inserting them one by one (a 59k-entry
manifest with 1% changed: 0.5 s down to 0.2 s); the table is the one a parse of every
record gives.  The
records have a table of their own beside ``state``, whose columns stay those every wsync
writes: an older wsync (a rolled-back install) reads and commits the same file, and its
commit, which leaves the records stale, is told by the ``records`` meta key.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import structlog

from wsync.digits import ascii_digits
from wsync.engine import hostscan, incload, incsql
from wsync.engine.excludes import Excludes
from wsync.engine.extract import Written
from wsync.engine.farm import _Parents, _split
from wsync.engine.fsutil import host_io
from wsync.engine.incdiff import Diff
from wsync.engine.incload import ManifestEntry
from wsync.errors import HostIOError
from wsync.protocol.manifest import Known

log = structlog.get_logger("wsync.incstate")

#: rows per executemany while streaming
BATCH = incload.BATCH
#: DEST rows a scan for the next diff holds in memory before it writes them to the scratch
#: table (about 25 MB): a no-op pull (see :meth:`PullState.noop_matches`) never writes them
HOLD = 100_000
SCHEMA_VERSION = "1"
#: the meta keys of the no-op record (see :meth:`PullState.noop_matches`)
_NOOP_KEYS = ("noop_key", "noop_manifest", "noop_host")
#: the meta key of the last listing a pull diffed (see :meth:`PullState.last_listing`)
_LISTING = "listing"
#: the meta key of the options the recorded state was made under (see :meth:`PullState.known`)
_OPTIONS = "options"
#: the meta key of the last commit's ctime window (see :meth:`PullState.window`)
_WINDOW = "ctime_window"
#: no window: an empty range (``hi`` is exclusive)
NO_WINDOW = (1, 0)
#: the meta key naming the listing whose commit wrote the ``records`` table: the records
#: describe the state's rows while it names the last listing (see :meth:`PullState.known`)
_RECORDS = "records"
#: how this wsync reads a record into a row (the parser's bounds, ``check_path``, what is
#: dropped): a wsync that reads one differently bumps it, and records kept under another
#: value are parsed again, never copied
RECORD_RULES = "1"
#: a file of ``s.man m`` that may have been edited unseen in its listing's last second:
#: no content digest, a ctime of whole seconds, in the second of the newest ctime listed
#: (every ctime listed is at or before the listing; one past 64 bits, a BLOB, counts)
_RACY = (
    "m.kind = 'f' AND coalesce(m.digest, '') = '' AND m.ctime % 1000000000 = 0 "
    "AND (typeof(m.ctime) != 'integer' OR m.ctime >= (SELECT max(ctime) - "
    "max(ctime) % 1000000000 FROM s.man WHERE typeof(ctime) = 'integer'))"
)
#: the most recorded records :meth:`PullState.known` hands the parser (about 80 bytes of
#: memory each); a larger state parses every record, as without them
KNOWN_MAX = 300_000


def state_path(state_dir: Path, dest: Path) -> Path:
    real = os.path.realpath(dest)
    key = hashlib.sha256(os.fsencode(real)).hexdigest()
    return state_dir / "incremental" / f"{key}.sqlite"


class PullState:
    """The incremental state of one DEST (see the module docstring)."""

    def __init__(self, path: Path, db: sqlite3.Connection, sandbox_key: str) -> None:
        self.path = path
        self.db = db
        self.sandbox_key = sandbox_key
        self._loaded = False
        self._diffed = False
        #: what :meth:`note_tree` read off the new tree before the swap: "" (nothing: the
        #: commit scans DEST), "scan" (the whole tree, in ``s.host``) or "made" (the rows
        #: of what the pull made, in ``s.made``)
        self._noted = ""
        #: the regular files' bytes in the loaded manifest, in KiB rounded up (what a
        #: whole-tree run needs in the guest staging, before compression)
        self.listed_kb = 0
        #: the digest of the last scan of DEST into the scratch table, and the directory
        #: (device, inode) that :meth:`scan` scanned for the next diff, if any
        self.host_digest = ""
        self._scanned: tuple[int, int] | None = None
        #: rows of that scan not yet in ``s.host`` (at most HOLD), and whether they are
        #: all of it
        self._held: list[hostscan.HostRow] = []
        self._held_whole = False
        #: held while :meth:`scan` publishes its rows and while a diff takes them
        self._publish = threading.Lock()
        #: (path, hash, inode, mode, size, mtime) of files the extractor wrote, not yet stored
        self._hash_batch: list[tuple[object, ...]] = []
        #: this run recorded ctimes of DEST as its scans saw them (a re-hash's verdict, the
        #: no-op record, a refresh) outside a commit: see :meth:`Incremental.settle`
        self.stamped = False

    # -- opening ------------------------------------------------------------------------

    @classmethod
    def open(cls, state_dir: Path, dest: Path, sandbox_key: str) -> PullState:
        """Open (creating) DEST's state; a damaged file is set aside and started afresh."""
        path = state_path(state_dir, dest)
        with host_io(f"creating {path.parent}"):
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            db = incsql.connect(path)
        except sqlite3.OperationalError as exc:  # locked, unreadable: not ours to delete
            raise HostIOError(f"incremental state {path}: {exc}") from exc
        except sqlite3.DatabaseError as exc:  # not a database, or damaged
            log.warning("incremental state unreadable, starting afresh", path=str(path), error=exc)
            incsql.remove_db(path)
            try:
                db = incsql.connect(path)
            except sqlite3.Error as again:
                raise HostIOError(f"incremental state {path}: {again}") from again
        return cls(path, db, sandbox_key)

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.db.close()

    def __enter__(self) -> PullState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _meta(self, key: str) -> str | None:
        found = self.db.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
        return None if found is None else str(found[0])

    def has_baseline(self) -> bool:
        """True when the last successful pull into DEST was of this sandbox and recorded."""
        with self._errors():
            if self._meta("sandbox") != self.sandbox_key:
                return False
            if self._meta("version") != SCHEMA_VERSION:
                return False
            root = self.db.execute("SELECT kind FROM state WHERE path = ?", (b".",)).fetchone()
            return root is not None and root[0] == "d"

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            where = ""
            if isinstance(exc, sqlite3.OperationalError) and "full" in str(exc):
                # the scratch tables and SQLite's sorts live in its temporary directory
                tmp = os.environ.get("SQLITE_TMPDIR") or os.environ.get("TMPDIR") or "/var/tmp"
                where = f" (or SQLite's temporary directory, {tmp}, is full)"
            raise HostIOError(f"incremental state {self.path}: {exc}{where}") from exc

    # -- the manifest -------------------------------------------------------------------

    def known(self, options: str) -> Known:
        """The records of the recorded state, for the parser to skip (see
        :mod:`wsync.protocol.manifest`): every record this state holds, when it is this
        sandbox's baseline made under the same ``options`` (the excludes decide which
        records were kept at all), else none (every record is then parsed, and
        fingerprinted for the next pull)."""
        records: set[bytes] = set()
        with self._errors():
            if not self.has_baseline() or self._meta(_OPTIONS) != options:
                return Known(records)
            if not self._records_current():
                return Known(records)
            for (record,) in self.db.execute(
                "SELECT record FROM main.records LIMIT ?", (KNOWN_MAX + 1,)
            ):
                records.add(bytes(record))
        return Known(records if len(records) <= KNOWN_MAX else set())

    def _records_current(self) -> bool:
        """The ``records`` table describes the state's rows: the commit that wrote it is the
        last one (an older wsync's commit rewrites the rows and the listing, not the records
        or their key).  Between two commits only a no-op record writes the listing, and
        :meth:`record_noop` keeps the two in step."""
        listing = self._meta(_LISTING)
        return listing is not None and self._meta(_RECORDS) == _records_key(listing)

    def load_manifest(
        self,
        entries: Iterable[ManifestEntry],
        excludes: Excludes,
        *,
        max_entries: int | None = None,
        known: Known | None = None,
        min_free: int | None = None,
    ) -> None:
        """Stream the guest's manifest into the scratch table (:func:`incload.load`)."""
        with self._errors():
            self.db.execute("DELETE FROM s.hashes")  # the extractor's, for this manifest
            self._hash_batch.clear()
            self.listed_kb = incload.load(
                self.db, entries, excludes, max_entries=max_entries, known=known, min_free=min_free
            )
            self.db.commit()
        self._loaded = True
        self._diffed = False
        self._noted = ""

    # -- the diff -----------------------------------------------------------------------

    def scan(
        self,
        dest_fd: int,
        check_cancel: Callable[[], None] | None = None,
        *,
        lock: contextlib.AbstractContextManager[object] | None = None,
    ) -> str:
        """Scan DEST (open at ``dest_fd``) for the next :meth:`diff`, and return the scan's
        digest.  A pull runs this while the guest writes its manifest: the two are
        independent, and the walk is most of a host's diff time.  The rows stay in memory
        up to HOLD (the diff writes them); only a larger scan writes to the scratch table
        as it goes, each write under ``lock``: so the manifest's load, which holds the
        lock, runs beside the walk instead of after it.  What the scan found is published
        at its end, and only if ``check_cancel`` lets it then: a scan stopped and left
        running (the pull no longer needs it) never hands its rows to a later diff."""
        return self._scan_host(dest_fd, check_cancel, hold=True, lock=lock)

    def held_scan(self) -> list[hostscan.HostRow] | None:
        """All rows of the last :meth:`scan`, parents before children, while they are
        still in memory only (no more than HOLD, and no diff since): what an early farm
        (:mod:`wsync.engine.prefarm`) links.  The list is never changed afterwards."""
        with self._publish:
            return self._held if self._held_whole and self._scanned is not None else None

    def diff(
        self,
        dest_fd: int,
        own_links: Callable[[bytes], int | None] | None = None,
        *,
        baseline: bool = True,
    ) -> Diff:
        """Compare the loaded manifest and DEST (open at ``dest_fd``) with the state.

        DEST is scanned here unless :meth:`scan` scanned this directory since the last diff.
        ``own_links(path)`` says how many links to DEST's entry this pull made itself (the
        early farm's: :meth:`wsync.engine.prefarm.Prefarm.links_to`), None if unknown.
        ``baseline=False`` diffs against no recorded state even where there is one (what a
        full pull would do: fetch every entry, delete what the guest does not list)."""
        if not self._loaded:
            raise RuntimeError("load_manifest() first")
        st = os.fstat(dest_fd)
        with self._errors():
            with self._publish:
                scanned, self._scanned = self._scanned, None
                held, whole = self._held, self._held_whole
                self._held, self._held_whole = [], False
            if scanned != (st.st_dev, st.st_ino):
                self._scan_host(dest_fd)
            else:
                if whole:  # (else the scan cleared the table at its first write)
                    self.db.execute("DELETE FROM s.host")
                incsql.insert_rows(self.db, incsql.INSERT_HOST, held)
            db = self.db
            # "base" is the recorded state, or an empty one when it is not this sandbox's
            db.execute("DROP VIEW IF EXISTS temp.base")
            based = baseline and self.has_baseline()
            if based:
                db.execute("CREATE TEMP VIEW base AS SELECT * FROM main.state")
            else:
                db.execute("CREATE TEMP VIEW base AS SELECT * FROM s.nostate")
            db.execute("DELETE FROM s.plan")
            lo, hi = self.window()
            db.execute(incsql.PLAN, {"lo": lo, "hi": hi})
            if self._recheck(dest_fd, own_links) and based:
                # verified by their bytes: record where they are now, so the next pull
                # does not hash them again (the hash recorded stays the same)
                self.stamped = True
                db.execute(
                    "UPDATE main.state SET "
                    "hino = (SELECT h.ino FROM s.host h WHERE h.path = main.state.path), "
                    "hctime = (SELECT h.ctime FROM s.host h WHERE h.path = main.state.path) "
                    "WHERE path IN (SELECT path FROM s.verdict WHERE ok = 1)"
                )
            # a fetched guest inode is fetched under every name it has
            db.execute(
                "UPDATE s.plan SET act = 'linked', hash = NULL WHERE act = 'keep' AND kind = 'f' "  # noqa: S608
                "AND ino != 0 AND ino IN (SELECT ino FROM s.plan WHERE kind = 'f' AND ino != 0 "
                f"AND act IN {incsql.FETCHED})"
            )
            db.commit()
            # what to fetch, and the longest of its paths (in the same scan of the plan)
            changed, fetch, longest = db.execute(
                "SELECT coalesce(sum(act != 'keep'), 0), coalesce(sum(f), 0), "  # noqa: S608
                "coalesce(max(f * length(path)), 0) FROM (SELECT act, path, kind != 'd' AND act "
                f"IN {incsql.FETCHED} AS f FROM s.plan)"
            ).fetchone()
            deleted = db.execute(
                "SELECT count(*) FROM s.host h "
                "WHERE NOT EXISTS (SELECT 1 FROM s.man m WHERE m.path = h.path)"
            ).fetchone()[0]
        self._diffed = True
        return Diff(self.db, int(changed), int(deleted), int(fetch), int(longest))

    def racy(self, *, whole: bool) -> bool:
        """A file the content run reads (every file of the loaded manifest with ``whole``,
        else the plan's fetches) may be edited unseen in the listing's last second
        (:data:`_RACY`): its filesystem (or a busybox guest's ``stat``, which gives
        seconds only) cannot tell an edit in the second it is read in from its listing
        (see :meth:`IncrementalRunner.after_listing_second`)."""
        fetched = (
            ""
            if whole
            else f"AND m.path IN (SELECT path FROM s.plan WHERE act IN {incsql.FETCHED})"  # noqa: S608
        )
        with self._errors():
            found = self.db.execute(
                f"SELECT EXISTS (SELECT 1 FROM s.man m WHERE {_RACY} {fetched})"  # noqa: S608
            ).fetchone()
        return bool(found and found[0])

    def forget_racy(self) -> None:
        """Before a commit whose content run read files before the listing was known to
        be a second old: leave every file :data:`_RACY` names out of the new state.  Read
        in the listing's last second, such a file may have been edited again in it after
        the read, unseen by its record; unrecorded, the next pull fetches it."""
        with self._errors():
            self.db.execute(f"DELETE FROM s.man AS m WHERE {_RACY}")  # noqa: S608
            self.db.commit()

    def drop_plan(self) -> None:
        """The content run will not build on the diff (a whole-tree run took the place of
        the ``select`` run): the commit records what the extractor wrote, as after a full
        pull, instead of comparing kept entries the run never linked."""
        self._diffed = False

    def _scan_host(
        self,
        dest_fd: int,
        check_cancel: Callable[[], None] | None = None,
        *,
        hold: bool = False,
        lock: contextlib.AbstractContextManager[object] | None = None,
    ) -> str:
        """Fill ``s.host`` with DEST's entries; return a digest of every field of every row
        in walk order (the same tree, untouched, gives the same digest: see
        :meth:`noop_matches`).  With ``hold`` (:meth:`scan`) the first HOLD rows stay in
        memory until a diff needs them (the table is then cleared by the diff, or by the
        first write of a scan that outgrows them, under ``lock``)."""
        db = self.db
        guard = lock or contextlib.nullcontext()
        stop = check_cancel or (lambda: None)
        if not hold:
            self._held = []
            self._held_whole = False
        batch: list[hostscan.HostRow] = []
        digest = hostscan.ScanDigest()
        limit = HOLD if hold else BATCH
        written = False

        def write() -> None:
            nonlocal written
            with guard, self._errors():
                stop()  # (under the lock: a stopped scan writes nothing a diff meets)
                if not written:
                    db.execute("DELETE FROM s.host")
                    written = True
                incsql.insert_rows(db, incsql.INSERT_HOST, batch)
                if hold:
                    db.commit()  # (the lock's next holder finds no transaction of ours)

        with host_io("reading DEST"):
            for item in hostscan.scan(dest_fd):
                digest.add(item)
                batch.append(item)
                if len(batch) % BATCH == 0:
                    stop()
                    if len(batch) >= limit:
                        write()
                        batch.clear()
                        limit = BATCH
        if not hold:
            write()
            self.host_digest = digest.hexdigest()
            return self.host_digest
        st = os.fstat(dest_fd)
        with self._publish:
            stop()
            self._held, self._held_whole = batch, not written
            self._scanned = (st.st_dev, st.st_ino)
            self.host_digest = digest.hexdigest()
        return self.host_digest

    # -- the no-op shortcut -------------------------------------------------------------

    def noop_matches(self, key: str, manifest: str, host: str) -> bool:
        """True when the last pull that found nothing to do saw this very manifest (its
        verified stream digest) and this very DEST (the digest of a scan: path, kind, mode,
        size, mtime, ctime and inode of every entry), under the same options ``key``, and
        no commit came since.  Then the diff is known to find nothing again: it is a
        function of the manifest, DEST's scan and the state, and all three are the same.
        Any change on the host (an edit with the mtime put back moves the ctime, a chmod,
        a deletion, an addition) changes the scan digest, so the full diff runs."""
        if not (manifest and host) or not self.has_baseline():
            return False
        with self._errors():
            return all(
                self._meta(k) == v for k, v in zip(_NOOP_KEYS, (key, manifest, host), strict=True)
            )

    def last_listing(self) -> str | None:
        """The manifest digest of the last pull that diffed DEST (committed, or found
        nothing to do); None when no pull recorded one.  (A state written before the key
        existed has its no-op record's, if any.)"""
        with self._errors():
            return self._meta(_LISTING) or self._meta(_NOOP_KEYS[1])

    def has_noop_record(self) -> bool:
        with self._errors():
            return self._meta(_NOOP_KEYS[1]) is not None

    def record_noop(self, key: str, manifest: str, host: str) -> None:
        """Remember a diff that found nothing to do (see :meth:`noop_matches`)."""
        if not (manifest and host):
            return
        with self._errors():
            meta = [*zip(_NOOP_KEYS, (key, manifest, host), strict=True), (_LISTING, manifest)]
            if self._records_current():  # the rows the records describe stay as they are
                meta.append((_RECORDS, _records_key(manifest)))
            window = self._window()
            if window is not None:  # and so do the ctimes the window describes
                meta.append((_WINDOW, _window_value(manifest, *window[1:])))
            self.db.executemany("INSERT OR REPLACE INTO main.meta VALUES (?, ?)", meta)
            self.db.commit()
        self.stamped = True

    def refresh_ctimes(self, dest_fd: int) -> str:
        """After this pull linked DEST's inodes into a tree it then removed (an early farm
        the diff did not need): their ctimes moved, and nothing else of them.  DEST is
        scanned again, and where an entry is still the very inode recorded, with the
        recorded kind, mode, size and mtime, its ctime now is recorded (the trust the
        commit gives a kept entry, ``incsql.KEPT_MOVED``); else the next pull re-checks it
        as before.  Returns the scan's digest (for the no-op record).  Without this the
        next pull would re-hash every file of DEST."""
        with self._errors():
            digest = self._scan_host(dest_fd)
            self.db.execute(incsql.REFRESH_CTIMES)
            self.db.commit()
        self.stamped = True
        return digest

    def _recheck(self, dest_fd: int, own_links: Callable[[bytes], int | None] | None = None) -> int:
        """Entries whose host inode or ctime moved: re-hash (re-read the link) and compare.
        Returns how many were verified.  (A file of a guest hardlink group whose host inode
        moved is not checked but fetched, with its group: the plan says ``tampered``.)"""
        db = self.db
        db.execute("DELETE FROM s.verdict")
        rows = db.execute(
            "SELECT p.path, p.kind, h.ino, h.ino IS NOT o.hino, o.hash, m.target FROM s.plan p "
            "JOIN s.host h USING (path) JOIN base o USING (path) JOIN s.man m USING (path) "
            "WHERE p.act = 'check'"
        )
        batch: list[tuple[bytes, int]] = []
        for path, kind, ino, moved, recorded, target in rows:
            if kind == "f":
                # another inode than the one recorded is the guest's file only alone: with a
                # second link the host joined it to another name (in DEST or outside), and
                # linking that inode into the new tree would carry the join over (a link the
                # early farm made is this pull's own, counted; one it cannot vouch for fails)
                links: int | None = None
                if moved:
                    own = 0 if own_links is None else own_links(bytes(path))
                    links = None if own is None else 1 + own
                same = (
                    (not moved or links is not None)
                    and recorded is not None
                    and (
                        hostscan.file_hash(dest_fd, path, incsql.py_int(ino), links=links)
                        == recorded
                    )
                )
            elif kind == "l":
                same = hostscan.link_target(dest_fd, path) == target
            else:
                same = False
            batch.append((path, 1 if same else 0))
            if len(batch) >= BATCH:
                db.executemany("INSERT INTO s.verdict VALUES (?, ?)", batch)
                batch.clear()
        db.executemany("INSERT INTO s.verdict VALUES (?, ?)", batch)
        verified = db.execute("SELECT count(*) FROM s.verdict WHERE ok = 1").fetchone()[0]
        db.execute(
            "UPDATE s.plan SET act = CASE (SELECT ok FROM s.verdict v WHERE v.path = s.plan.path) "
            "WHEN 1 THEN 'keep' ELSE 'tampered' END WHERE act = 'check'"
        )
        return int(verified)

    # -- after the pull -----------------------------------------------------------------

    def note_tree(
        self, tree_fd: int, made: Iterator[tuple[bytes, hostscan.HostRow | None]] | None = None
    ) -> None:
        """Before the swap: what the commit is to record of DEST, read off the finished new
        tree (open at ``tree_fd``), the whole tree or, after a diff, ``made``: the lstat
        rows of every entry the pull made (:func:`wsync.engine.prevtree.restat`; None for
        one that is not there).

        Why before: read after the swap, a change made to DEST in between (a symlink
        pointed elsewhere, a chmod, a same-size rewrite with the mtime put back) was
        recorded as what the pull left, and no later pull looked at that entry again.
        Read here, anything done to DEST from the swap on differs from the rows recorded
        next time, and the pull repairs it."""
        with self._errors():
            db = self.db
            if made is None:
                self._rescan(tree_fd)
                self._noted = "scan"
            else:
                db.execute("DELETE FROM s.made")
                gone = (None,) * 6
                for batch in incload.batches(made):
                    rows = [row or (path, *gone) for path, row in batch]
                    incsql.insert_rows(db, incsql.INSERT_MADE, rows)
                self._unlike_links(tree_fd, "s.made")
                self._noted = "made"
            db.commit()

    def _unlike_links(self, tree_fd: int, table: str) -> None:
        """Leave out of what the commit records each symlink of ``table`` (the rows just
        read off the new tree) that does not point where the listing says: what the
        guest's archive put there is not what it listed (a hostile tar, or a link
        changed between the two reads), and recorded with that listing it would match
        every later honest one for good.  (Files are held to the listed size by the
        commit itself, ``incsql.COMMIT``; a link's own size is its target's length on
        most filesystems but not all, so it is read.)"""
        db = self.db
        rows = db.execute(
            f"SELECT t.path, m.target FROM {table} t JOIN s.man m USING (path) "  # noqa: S608
            "WHERE t.kind = 'l' AND m.kind = 'l' ORDER BY t.path"
        )
        unlike = []
        parents = _Parents(tree_fd)  # (one open per directory, not per link: in path order)
        try:
            for path, target in rows:
                parent, leaf = _split(bytes(path))
                try:
                    now: bytes | None = os.readlink(leaf, dir_fd=parents.get(parent))
                except OSError:
                    now = None
                if now is None or target is None or now != bytes(target):
                    unlike.append((path,))
        finally:
            parents.close()
        if table == "s.made":
            db.executemany("UPDATE s.made SET kind = NULL WHERE path = ?", unlike)
        else:
            db.executemany("DELETE FROM s.host WHERE path = ?", unlike)

    def _rescan(self, tree_fd: int) -> None:
        """``s.host`` from a scan of the tree at ``tree_fd`` for the commit to record (its
        symlinks held to their listed targets), after a diff with its scan of the entries
        the farm linked as they are set aside first (``incsql.KEPT``: what
        ``KEPT_MOVED`` compares the new scan with)."""
        if self._diffed:
            self.db.execute("DELETE FROM s.kept")
            self.db.execute(incsql.KEPT)
        self._scan_host(tree_fd)
        self._unlike_links(tree_fd, "s.host")

    def commit(
        self,
        dest_fd: int,
        file_hashes: Mapping[bytes, str] | Iterable[tuple[bytes, str, Written]],
        *,
        listing: str = "",
        options: str = "",
        window_lo: int | None = None,
    ) -> None:
        """Record the tree now in DEST (open at ``dest_fd``) as this sandbox's baseline.

        Call it after the swap and after the old tree was removed or pruned.
        ``file_hashes`` are the extractor's xxh3_128 of every file it wrote (on top of
        those given to :meth:`add_hash` since :meth:`load_manifest`); kept files carry
        their recorded hash.  An entry is recorded only where DEST holds it with the
        manifest's kind, so anything the pull did not leave (vanished in the guest,
        refused) is fetched next time.

        DEST is scanned again, unless :meth:`note_tree` read the new tree before the swap:
        the whole of it, or the rows of every entry this pull made, and then every other
        row is the one of the scan the diff used.  An older signature is never a missed
        change: anything done to an entry since that scan differs from it next time.
        Scanned again, a kept entry the host changed during the pull (see
        ``incsql.KEPT_MOVED``) is left out.
        ``listing`` is the manifest's stream digest (:meth:`last_listing`), ``options``
        what the pull's options key was (:meth:`known`), ``window_lo`` when the pull began
        (in ns, before its first scan of DEST): it opens the ctime window that
        :meth:`close_window` closes once the old tree is gone (see :meth:`window`).
        """
        if not self._loaded:
            raise RuntimeError("load_manifest() first")
        if isinstance(file_hashes, Mapping):
            records: Iterable[tuple[bytes, str, Written | None]] = (
                (path, digest, None) for path, digest in file_hashes.items()
            )
        else:
            records = file_hashes
        with self._errors():
            db = self.db
            noted, self._noted = self._noted, ""
            if noted == "made" and self._diffed:
                db.execute("DELETE FROM s.host WHERE path IN (SELECT path FROM s.made)")
                db.execute("INSERT INTO s.host SELECT * FROM s.made WHERE kind IS NOT NULL")
            else:
                if noted != "scan":
                    self._rescan(dest_fd)
                if self._diffed:
                    db.execute(incsql.KEPT_MOVED)
            for path, digest, written in records:
                self.add_hash(path, digest, written)
            self._flush_hashes()
            if not self._diffed:
                db.execute("DELETE FROM s.plan")
            db.commit()
            with incsql.immediate(db):
                db.execute("DELETE FROM main.state")
                db.execute("DELETE FROM main.records")
                keys = [(k,) for k in (*_NOOP_KEYS, _LISTING, _OPTIONS, _RECORDS, _WINDOW)]
                db.executemany("DELETE FROM main.meta WHERE k = ?", keys)
                db.execute(incsql.COMMIT)
                meta = [("sandbox", self.sandbox_key), ("version", SCHEMA_VERSION)]
                if listing:
                    meta.append((_LISTING, listing))
                    db.execute(incsql.COMMIT_RECORDS)
                    meta.append((_RECORDS, _records_key(listing)))
                    if window_lo is not None:
                        meta.append((_WINDOW, _window_value(listing, window_lo, None)))
                if options:
                    meta.append((_OPTIONS, options))
                db.executemany("INSERT OR REPLACE INTO main.meta VALUES (?, ?)", meta)

    def window(self) -> tuple[int, int]:
        """The ctime window of the last commit, ``(lo, hi)`` in ns, ``hi`` exclusive, read
        off DEST's filesystem's own clock: from before that pull first scanned DEST to
        after its old tree was gone.  Its farm's links and the old tree's unlinks move the
        ctime of every inode it kept and nothing else of them; a kept entry's row is the
        diff's scan, taken before, so its ctime now differs from the one recorded, within
        the window.  Such an entry is kept without a re-hash (the
        plan's ``:lo``/``:hi``).  What the window also hides, an edit during that pull with
        the size kept and the mtime put back, a rescan after the removal hid too (the link
        and unlink move the same ctime after the edit).  Empty (:data:`NO_WINDOW`) when
        there is none, it is still open (killed before the old tree was gone: every moved
        ctime is then re-hashed, as before), or another commit came since (an older wsync's:
        its rows are a rescan's, and it leaves this key as it was)."""
        with self._errors():
            window = self._window()
        if window is None or window[2] is None:
            return NO_WINDOW
        return window[1], window[2]

    def _window(self) -> tuple[str, int, int | None] | None:
        """The current listing and the window recorded for it, closed or not (``hi``
        None); None if none."""
        value, listing = self._meta(_WINDOW), self._meta(_LISTING)
        if value is None or listing is None:
            return None
        parts = value.rsplit(":", 2)  # (a listing's digest has colons of its own)
        if len(parts) != 3 or parts[0] != listing or not ascii_digits(parts[1].lstrip("-")):
            return None
        hi = int(parts[2]) if ascii_digits(parts[2].lstrip("-")) else None
        return listing, int(parts[1]), hi

    def close_window(self, hi: int) -> None:
        """Close the window the last :meth:`commit` opened, at ``hi`` ns: after the old
        tree was removed (or kept), and after the commit."""
        with self._errors():
            window = self._window()
            if window is None or window[2] is not None:
                return
            value = _window_value(window[0], window[1], hi)
            self.db.execute("INSERT OR REPLACE INTO main.meta VALUES (?, ?)", (_WINDOW, value))
            self.db.commit()

    def add_hash(self, path: bytes, digest: str, written: Written | None = None) -> None:
        """Note the xxh3_128 of a file the extractor wrote (``on_file`` can be this method),
        and what it wrote (inode, mode, size, mtime): the commit records the hash only where DEST
        still holds that.  Kept in the scratch database, not in memory, so a million files
        cost no RSS."""
        ino, mode, size, mtime = written if written is not None else (None, None, None, None)
        self._hash_batch.append((path, digest, ino, mode, size, mtime))
        if len(self._hash_batch) >= BATCH:
            with self._errors():
                self._flush_hashes()

    def _flush_hashes(self) -> None:
        incsql.insert_rows(
            self.db, "INSERT OR REPLACE INTO s.hashes VALUES (?, ?, ?, ?, ?, ?)", self._hash_batch
        )
        self._hash_batch.clear()

    def tree_bytes(self) -> int:
        """Bytes of the regular files recorded (after :meth:`commit`: the tree now in DEST)."""
        with self._errors():
            found = self.db.execute(
                # total(): a float that never overflows (sparse files can pass 2**63 bytes)
                "SELECT total(hsize) FROM main.state WHERE kind = 'f'"
            ).fetchone()
        return int(found[0])

    def forget(self) -> None:
        """Drop the baseline: the next pull into DEST is a full one."""
        self.close()
        incsql.remove_db(self.path)


def _window_value(listing: str, lo: int, hi: int | None) -> str:
    """The ``ctime_window`` meta value: the listing it belongs to, then its bounds."""
    return f"{listing}:{lo}:{'' if hi is None else hi}"


def _records_key(listing: str) -> str:
    """The ``records`` meta value of a commit (or no-op) of ``listing``."""
    return f"{RECORD_RULES}:{listing}"
