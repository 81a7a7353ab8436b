"""stdout and stderr that a command never dies of.

A pull's outcome is DEST and its exit code; what it prints about it is a
courtesy to whoever reads.  Two ways the reader can be gone, both seen by a red
team as an "internal error" (exit 1):

* a pipe whose reader exited: ``wsync pull --json | true`` swapped DEST in,
  then died of ``BrokenPipeError`` printing the result, and exited 1 after a
  success; ``2>&1 >/dev/null | head -1`` aborted the pull itself on a
  progress line;
* a stream closed before the start (``2>&-``): Python sets ``sys.stderr`` to
  None, the first progress line raised ``AttributeError``, and every
  ``print(..., file=sys.stderr)`` wrote to *stdout* (``print`` takes
  ``file=None`` for stdout), into the ``--json`` object.

And one way the reader cannot be reached: a write that fails otherwise (``2>>log`` on a
full disk, ``EIO`` from a terminal that hung up) aborted a pull on a progress line, or
made a finished one "internal error".

:func:`tame` makes each of the two a stream that swallows what cannot be
delivered: a missing one writes to ``/dev/null``; a write to a gone reader, and any
failed write to stdout, points the file descriptor at ``/dev/null`` (the recipe of
Python's signal documentation, so the interpreter's own last flush cannot fail either)
and the text is dropped; any other failed write to stderr drops that text only (a disk
full for a moment must not silence a daemon's log for good).  The exit code stays the
command's, with one exception: stdout that failed other than by a gone reader holds a
truncated result (a ``--json`` object cut short in a file), which :func:`lost_stdout`
tells, and the command then exits 8 (guarantee 6: truncated output is reported as
truncated).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import TextIO


def _mute(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null: the reader is gone for good."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, stream.fileno())
        finally:
            os.close(null)


class _Tolerant:
    """A text stream delegating to ``inner`` whose writes never raise."""

    def __init__(self, inner: TextIO, *, mute_on_error: bool) -> None:
        self._inner = inner
        #: stdout goes quiet at its first failure (its loss is reported: :func:`lost_stdout`);
        #: stderr only when its reader is gone: a disk that was full for a moment must not
        #: silence a daemon's log for good, so there a failed line is dropped, no more
        self._mute_on_error = mute_on_error
        #: the first failure that was not a gone reader (EPIPE), if any
        self.lost: OSError | None = None

    def _failed(self, exc: OSError) -> None:
        if exc.errno != errno.EPIPE and self.lost is None:
            self.lost = exc
        if exc.errno == errno.EPIPE or self._mute_on_error:
            _mute(self._inner)

    def write(self, text: str) -> int:
        try:
            return self._inner.write(text)
        except OSError as exc:
            self._failed(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._inner.flush()
        except OSError as exc:
            self._failed(exc)
            with contextlib.suppress(OSError):
                self._inner.flush()  # to /dev/null if muted, else one more try

    def __getattr__(self, name: str) -> object:  # isatty, fileno, encoding, ...
        return getattr(self._inner, name)


def tame() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` tolerant (see the module docstring); once
    per process, at the command's entry point, before anything opens a file.

    A closed descriptor 0, 1 or 2 is first given ``/dev/null``: otherwise the next file
    opened takes its number, and whatever writes to "stderr" by number (a ``local:``
    guest's scripts, a C library) writes into that file, a journal chunk say."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:  # the lowest free number: fd itself, unless a lower one is free too
                os.dup2(null, fd)
                os.close(null)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = getattr(sys, name)
        if isinstance(stream, _Tolerant):
            continue
        if stream is None:
            stream = open(fd, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
        setattr(sys, name, _Tolerant(stream, mute_on_error=name == "stdout"))


def lost_stdout() -> str | None:
    """Why stdout lost text other than to a gone reader (a full disk, an I/O error), if it
    did: what the command printed there is cut short.  Flushes it first."""
    stream = sys.stdout
    if not isinstance(stream, _Tolerant):
        return None
    stream.flush()
    if stream.lost is None:
        return None
    return stream.lost.strerror or str(stream.lost)
