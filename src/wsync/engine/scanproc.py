"""DEST's scan in a child process, beside the manifest's load instead of taking turns with it.

Why: an incremental pull scans DEST (an ``lstat`` of every entry, :func:`hostscan.scan`)
while the guest writes its manifest, then loads that manifest into the state.  Both are
Python loops over every entry, and threads of one process take turns on one interpreter
lock: on a 59k-entry tree the scan (~0.5 s, then ~0.25 s to insert its rows) was added to
the load (~0.8 s) instead of running beside it.  A child process runs it on another core,
writes its rows to a SQLite file, and the parent copies them in one statement (~0.03 s).

What crosses, and why it can be trusted: the child is this same wsync (``sys.executable -m
wsync.engine.scanproc``), handed DEST's directory *fd* (inherited: it walks the very
directory the parent opened, never a path that could be swapped) and the path of an empty
file in the private state directory.  It answers on stdout with one line::

    scanned DIGEST       the walk is done: DIGEST as hostscan.ScanDigest gives it
    error MESSAGE        the walk failed (what the in-process scan would raise)

then reads one command on stdin: ``rows`` makes it write the rows it still holds into the
file (table ``host``, the scratch ``s.host`` layout) and answer ``written``; end of input
makes it exit without writing, because a no-op pull needs only the digest (the in-process
scan's ``HOLD`` rule: the first 100,000 rows stay in memory until a diff needs them).

A child that cannot be started or ends before its first line (no interpreter, a wsync it
cannot import) is not an error: :class:`ScanProcess` says so and the caller scans in its
own process, as before.  The child runs in its own session, so the terminal's Ctrl-C goes
to the parent only, which stops it with :meth:`ScanProcess.kill`; a parent that dies closes
the child's stdin, which ends it.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from wsync.engine import hostscan, incsql
from wsync.errors import HostIOError

#: rows the child holds before it starts writing them (the in-process scan's HOLD)
HOLD = 100_000
#: rows per executemany beyond that
BATCH = 4096
SUFFIX = ".scan"
_LINE = 4096
#: the package's parent directory, for the child's import path (a wsync imported from a
#: source tree must be the one the child runs)
_ROOT = str(Path(__file__).resolve().parents[2])


class ScanProcess:
    """The parent's end of one child scan (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes], path: Path) -> None:
        self.proc = proc
        self.path = path

    @classmethod
    def start(cls, dest_fd: int, state_dir: Path, prefix: str) -> ScanProcess | None:
        """Start scanning the directory open at ``dest_fd``; None if no child can run."""
        if not sys.executable:
            return None
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=SUFFIX, dir=state_dir)
        os.close(fd)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (_ROOT, env.get("PYTHONPATH"))))
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "wsync.engine.scanproc", str(dest_fd), name, str(HOLD)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                pass_fds=(dest_fd,),
                start_new_session=True,
                env=env,
            )
        except (OSError, subprocess.SubprocessError):
            with contextlib.suppress(OSError):
                os.unlink(name)
            return None
        return cls(proc, Path(name))

    def digest(self) -> str | None:
        """Wait for the walk: its digest, or None when the child gave no answer (it could
        not start, or was killed); HostIOError for the walk's own error."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline(_LINE)
        word, _, rest = line.rstrip(b"\n").partition(b" ")
        if word == b"scanned" and rest:
            return rest.decode("ascii", "replace")
        if word == b"error":
            self.close()
            raise HostIOError(f"reading DEST: {rest.decode('utf-8', 'replace')}")
        self.close()
        return None

    def copy_into(self, db: sqlite3.Connection, table: str) -> None:
        """Have the child write the rows it holds, then copy the file's table into
        ``table`` (of the same layout) and end the child.  Any transaction of ``db`` must be
        committed first: SQLite attaches only outside one."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(b"rows\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline(_LINE)
        except OSError:
            line = b""
        if line != b"written\n":
            self.close()
            word, _, rest = line.rstrip(b"\n").partition(b" ")
            why = rest.decode("utf-8", "replace") if word == b"error" else "the scan ended early"
            raise HostIOError(f"reading DEST: {why}")
        try:
            db.execute("ATTACH DATABASE ? AS scanned", (str(self.path),))
            try:
                db.execute(f"INSERT OR REPLACE INTO {table} SELECT * FROM scanned.host")  # noqa: S608 - a table name of ours
                db.commit()
            finally:
                db.execute("DETACH DATABASE scanned")
        finally:
            self.close()

    def kill(self) -> None:
        """Stop the child now (from any thread): a waiting :meth:`digest` returns None."""
        with contextlib.suppress(OSError):
            self.proc.kill()

    def close(self) -> None:
        """End the child (end of input, then a kill if it does not go) and remove its file."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def remove_stale(state_dir: Path, prefix: str) -> None:
    """Remove files of children that a killed pull left (the DEST lock is held)."""
    for stale in state_dir.glob(f"{prefix}*{SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()


# -- the child ----------------------------------------------------------------------------


def _write(db: sqlite3.Connection, rows: list[hostscan.HostRow]) -> None:
    incsql.insert_rows(db, "INSERT OR REPLACE INTO host VALUES (?,?,?,?,?,?,?)", rows)


def _scan(
    dest_fd: int, path: str, hold: int
) -> tuple[str, list[hostscan.HostRow], sqlite3.Connection]:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = OFF")
    db.execute("PRAGMA synchronous = OFF")
    db.execute(f"CREATE TABLE host ({incsql.HOST_COLUMNS}) WITHOUT ROWID")
    db.execute("BEGIN")
    digest = hostscan.ScanDigest()
    held: list[hostscan.HostRow] = []
    limit = hold
    for item in hostscan.scan(dest_fd):
        digest.add(item)
        held.append(item)
        if len(held) >= limit:
            _write(db, held)
            held.clear()
            limit = BATCH
    return digest.hexdigest(), held, db


def _say(line: str) -> None:
    sys.stdout.buffer.write(line.replace("\n", " ").encode("utf-8", "replace") + b"\n")
    sys.stdout.buffer.flush()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or not (args[0].isdigit() and args[2].isdigit()):
        _say("error usage: python -m wsync.engine.scanproc FD DBFILE HOLD")
        return 2
    try:
        digest, held, db = _scan(int(args[0]), args[1], max(1, int(args[2])))
    except (OSError, sqlite3.Error) as exc:
        _say(f"error {getattr(exc, 'strerror', None) or exc}")
        return 1
    _say(f"scanned {digest}")
    if sys.stdin.buffer.readline(_LINE).strip() != b"rows":
        return 0
    try:
        _write(db, held)
        db.execute("COMMIT")
    except sqlite3.Error as exc:
        _say(f"error {exc}")
        return 1
    _say("written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
