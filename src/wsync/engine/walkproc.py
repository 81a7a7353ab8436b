"""DEST's scan, the kept tree's walk and the old tree's removal, in a worker process.

Why a process: both are Python loops over every entry (an ``lstat`` or a directory entry
each: 0.24 s and 0.2 s of CPU for a 59k-entry tree), and they ran in threads while the
manifest loaded.  Threads of one process take turns on the GIL: a traced 1% ``--keep-prev``
pull's scan took 0.97 s of wall time for its 0.24 s of work, the walk 0.86 s, and the load
beside them 0.43 s for 0.25 s; the diff waited for the scan.  wsync's process spent one
CPU-second per second of the pull while the second core stood idle.  In a worker process
each walk has a core and an interpreter of its own; the pull's process only unpickles the
rows (0.04 s for 59k).  Small trees (fewer than :data:`MIN_ENTRIES` recorded) are walked
in the thread as before: an interpreter's start costs more than their walk.

The child runs the very functions the thread would (:func:`wsync.engine.hostscan.scan`,
:func:`wsync.engine.prevtree.walk_ahead`), on the directory fds it inherits: confinement
and every check are theirs.  What it sends back is pickled plain data (lists, tuples,
dicts, bytes, str, int); the parent's unpickler refuses any class or function reference,
so no byte of it can make the parent run code.

The old tree's removal after an incremental pull's swap goes to a worker too (one
``unlink`` per entry, which in a thread waited for the GIL each time while the commit ran:
1.1 s for 59k entries where ``rm -rf`` takes 0.76 s).

Protocol: argv is ``scan FD``, ``walk PARENT_FD SINCE LIMIT DEST_NAME NAME...`` or ``remove
PARENT_FD NAME SHOWN``.  stdout is a stream of messages, each an 8-byte little-endian
length and a pickled tuple: a scan sends ``("rows", [row, ...])`` per batch of
:data:`BATCH` rows, then ``("end", digest)``; a walk sends ``("walked", root, rows,
listed, since, until)`` or ``("none",)``; a removal ``("done",)`` or ``("failed",
message)``.  Any may end with ``("error", errno, strerror)`` (an OSError stopped it) or
``("crash", text)``.  The parent stops a scan or a walk by killing it; they stop by
themselves when the parent is gone (a scan's next write fails; a walk looks at its parent
between entries).  A removal is never stopped: what is set aside for removal goes whole.

A worker that cannot start or ends without its answer costs the pull time, never a
result: the scan and the removal are done in the thread instead, and a walk not taken
ahead is taken by the reuse itself.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn

from wsync.engine import hostscan
from wsync.engine.hostscan import HostRow, ScanDigest
from wsync.errors import HostIOError

if TYPE_CHECKING:
    from wsync.engine.prevtree import Walked

#: rows per message of a scan
BATCH = 4096
#: entries a recorded tree must have for its walks to go to a worker process
MIN_ENTRIES = 2048
#: the largest message a parent accepts (a batch of 4096 rows of 4 KiB paths is 17 MB; a
#: walk is at most HOLD rows)
_MAX_MESSAGE = 1 << 30
#: seconds between two looks at the caller's ``check`` while a child is silent
_POLL = 0.05


class WorkerLost(Exception):
    """The worker could not start, or ended without its answer."""


class _PlainData(pickle.Unpickler):
    """An unpickler of plain data only: any class or function reference is refused."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise pickle.UnpicklingError(f"a reference to {module}.{name} in a worker's answer")


class _Child:
    """One worker process and the reading of its messages."""

    def __init__(self, args: list[str], fds: tuple[int, ...]) -> None:
        if not sys.executable:
            raise WorkerLost("no Python interpreter to run it")
        try:
            self.proc = subprocess.Popen(
                # -P: nothing from the current directory is imported
                [sys.executable, "-P", "-m", "wsync.engine.walkproc", *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                pass_fds=fds,
                env=_worker_env(),
            )
        except OSError as exc:
            raise WorkerLost(f"it could not start: {exc.strerror or exc}") from exc
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()

    def message(self, check: Callable[[], None]) -> tuple[object, ...]:
        """The child's next message; ``check`` is called while it is awaited (it raises
        to give up).  Its ``error`` is raised as the OSError it was."""
        size = int.from_bytes(self._read(8, check), "little")
        if size > _MAX_MESSAGE:
            raise WorkerLost(f"it sent a message of {size} bytes")
        try:
            msg = _PlainData(io.BytesIO(self._read(size, check))).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
            raise WorkerLost(f"it sent what is not a message: {exc}") from exc
        if not isinstance(msg, tuple) or not msg or not isinstance(msg[0], str):
            raise WorkerLost("it sent what is not a message")
        if msg[0] == "error" and len(msg) == 3:
            raise OSError(msg[1], msg[2])
        if msg[0] == "crash":
            raise WorkerLost(f"it failed: {msg[1:]}")
        return msg

    def _read(self, size: int, check: Callable[[], None]) -> bytes:
        got = bytearray()
        while len(got) < size:
            check()
            ready, _, _ = select.select([self.fd], [], [], _POLL)
            if not ready:
                continue
            chunk = os.read(self.fd, min(size - len(got), 1 << 20))
            if not chunk:
                raise WorkerLost(f"it ended with {self.proc.wait()} before its answer")
            got += chunk
        return bytes(got)

    def close(self) -> None:
        """Kill the child if it still runs, and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _worker_env() -> dict[str, str]:
    """What the worker needs of our environment to find its interpreter and wsync; no
    more (a daemon's environment may hold tokens, and the worker needs none)."""
    keep = ("PATH", "PYTHONPATH", "PYTHONHOME")
    return {name: os.environ[name] for name in keep if name in os.environ}


class Scan:
    """DEST's scan (:func:`wsync.engine.hostscan.scan`) as batches of rows, in a worker
    process or in this thread; :attr:`digest` is the scan's digest once every batch was
    taken.  Use it as a context manager: leaving it stops a worker still running."""

    def __init__(self, root_fd: int, *, worker: bool) -> None:
        self.root_fd = root_fd
        self.worker = worker
        self.digest = ""
        self._child: _Child | None = None

    def __enter__(self) -> Scan:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None

    def batches(self, check: Callable[[], None]) -> Iterator[list[HostRow]]:
        """Every row of the scan, a batch at a time, the root first.  In a worker:
        WorkerLost when it cannot give them all (the rows given so far stand; the caller
        scans again in its thread)."""
        if not self.worker:
            yield from self._here()
            return
        self._child = child = _Child(["scan", str(self.root_fd)], (self.root_fd,))
        while True:
            msg = child.message(check)
            if msg[0] == "end" and len(msg) == 2 and isinstance(msg[1], str):
                self.digest = msg[1]
                return
            if msg[0] != "rows" or len(msg) != 2 or not isinstance(msg[1], list):
                raise WorkerLost(f"it sent a message of kind {msg[0]!r}")
            yield msg[1]

    def _here(self) -> Iterator[list[HostRow]]:
        digest = ScanDigest()
        batch: list[HostRow] = []
        for item in hostscan.scan(self.root_fd):
            digest.add(item)
            batch.append(item)
            if len(batch) >= BATCH:
                yield batch
                batch = []
        yield batch
        self.digest = digest.hexdigest()


def remove(parent_fd: int, name: str, shown: str) -> None:
    """:func:`wsync.engine.fsutil.remove_tree_at` in a worker process: its HostIOError
    as it raised it, WorkerLost when the worker gave no answer (what it removed is gone;
    the caller removes the rest).  Not stopped from here: a tree set aside for removal
    goes whole, even after the pull gave up its wait."""
    child = _Child(["remove", str(parent_fd), name, shown], (parent_fd,))
    try:
        msg = child.message(lambda: None)
    finally:
        child.close()
    if msg[0] == "failed" and len(msg) == 2 and isinstance(msg[1], str):
        raise HostIOError(msg[1])
    if msg != ("done",):
        raise WorkerLost(f"it sent a message of kind {msg[0]!r}")


def walk_ahead(
    parent_fd: int,
    names: list[str],
    check: Callable[[], None],
    limit: int,
    since: int,
    dest_name: str,
) -> Walked | None:
    """:func:`wsync.engine.prevtree.walk_ahead` in a worker process: its answer, or None.
    WorkerLost when the worker gave none."""
    from wsync.engine.prevtree import Walked  # (the scan's child imports this module too)

    args = ["walk", str(parent_fd), str(since), str(limit), dest_name, *names]
    child = _Child(args, (parent_fd,))
    try:
        msg = child.message(check)
    finally:
        child.close()
    if msg[0] == "none":
        return None
    if msg[0] != "walked" or len(msg) != 6:
        raise WorkerLost(f"it sent a message of kind {msg[0]!r}")
    _, root, rows, listed, since_, until = msg
    if not (
        isinstance(root, tuple)
        and isinstance(rows, list)
        and isinstance(listed, dict)
        and isinstance(since_, int)
        and isinstance(until, int)
    ):
        raise WorkerLost("it sent a walk of other types")
    return Walked(root, rows, listed, since_, until)


# -- the child ------------------------------------------------------------------------


def _send(*msg: object) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    out = sys.stdout.buffer
    out.write(len(data).to_bytes(8, "little") + data)
    out.flush()


def _child_scan(root_fd: int) -> None:
    digest = ScanDigest()
    batch: list[HostRow] = []
    for item in hostscan.scan(root_fd):
        digest.add(item)
        batch.append(item)
        if len(batch) >= BATCH:
            _send("rows", batch)  # (a parent gone: the write fails, and the child ends)
            batch = []
    _send("rows", batch)
    _send("end", digest.hexdigest())


def _child_walk(args: list[str]) -> None:
    from wsync.engine import prevtree  # (a scan's child needs none of it)

    parent_fd, since, limit, dest_name, *names = args
    parent = os.getppid()

    def check() -> None:
        if os.getppid() != parent:
            raise OSError(errno.ECHILD, "the pull that started it is gone")

    walked = prevtree.walk_ahead(int(parent_fd), names, check, int(limit), int(since), dest_name)
    if walked is None:
        _send("none")
    else:
        _send("walked", *walked)


def _child_remove(parent_fd: int, name: str, shown: str) -> None:
    from wsync.engine.fsutil import remove_tree_at

    try:
        remove_tree_at(parent_fd, name, shown=shown)
    except HostIOError as exc:
        _send("failed", str(exc))
    else:
        _send("done")


_USAGE = "usage: scan FD | walk PARENT_FD SINCE LIMIT DEST NAME... | remove PARENT_FD NAME SHOWN"


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["scan"] and len(argv) == 2:
            _child_scan(int(argv[1]))
        elif argv[:1] == ["walk"] and len(argv) >= 6:
            _child_walk(argv[1:])
        elif argv[:1] == ["remove"] and len(argv) == 4:
            _child_remove(int(argv[1]), argv[2], argv[3])
        else:
            _send("crash", f"{_USAGE}: {argv}")
            return 2
    except BrokenPipeError:
        return 1  # the parent is gone, or stopped reading
    except OSError as exc:
        _send("error", exc.errno or errno.EIO, exc.strerror or str(exc))
    except Exception as exc:  # (told to the parent, which falls back)
        _send("crash", f"{type(exc).__name__}: {exc}"[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
