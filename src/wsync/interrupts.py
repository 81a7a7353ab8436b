"""How the ``wsync`` command stops on SIGINT and SIGTERM: soon, with exit 130, every time.

The rule the user sees: the first signal stops the pull (the task is cancelled,
the extractor and journal writers wind down, the journal stays for the next
run) and the process exits 130 within :data:`DEFAULT_GRACE` seconds; a second
signal exits 130 at once; a signal before the pull has started (imports,
argument parsing) exits 130 at once with one line and nothing changed.

Why not Python's ``KeyboardInterrupt`` or :func:`asyncio.run`'s own SIGINT
handler, which is what wsync used before: both raise or cancel *in the main
thread, at whatever bytecode it is running*, and only when it runs bytecode.

* A ``KeyboardInterrupt`` during start-up imports is a raw traceback with the
  process killed by SIGINT (exit -2).
* asyncio's second-Ctrl-C ``KeyboardInterrupt`` can land anywhere, between a
  lock's ``__enter__`` and its block included (the extractor then blocks on
  the feed's lock for good), and :func:`asyncio.run` then joins the default
  executor's threads, and the interpreter joins every executor thread at exit,
  all without a bound: one shutdown hung for more than ten minutes.
* A signal arriving while the main thread sits in a blocking call is not seen
  until that call returns.

So the Python-level handlers here do nothing, and the decision is taken on a
watcher thread fed by :func:`signal.set_wakeup_fd`: the C-level handler writes
the signal number to a pipe at once, whatever the main thread is doing.  The
watcher asks the registered target (the CLI's event loop) to cancel the pull,
and exits the process itself with :func:`os._exit` when a second signal comes
or the grace period passes.  An immediate exit is safe for the journal: every
journal file is written to a temporary name, fsynced and renamed
(:func:`wsync.engine.fsutil.write_atomic`), a temporary left behind is deleted
by the next run, and DEST is only ever replaced by one rename; this is the
same state ``kill -9`` leaves, which the resume tests cover.

This module is imported before anything heavy (``wsync/__main__.py`` imports
it first), so it uses only the standard library's cheapest modules.  Only the
CLI installs it; the daemon has its own signal handling and the library none.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

#: the signals that stop a pull
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: seconds a stopping pull may spend winding down before the process exits anyway
DEFAULT_GRACE = 2.0
#: overrides DEFAULT_GRACE (seconds; tests and slow disks)
GRACE_ENV = "WSYNC_STOP_GRACE"
#: exit status of every signal stop (128 + SIGINT, the shell convention)
EXIT_INTERRUPTED = 130
#: commands that run their own signal handling (the daemon) or none (its clients)
UNGUARDED_COMMANDS = frozenset({"daemon", "status", "jobs"})

_NAMES: dict[int, str] = {int(signal.SIGINT): "SIGINT", int(signal.SIGTERM): "SIGTERM"}


def _grace_from_env() -> float:
    try:
        return max(0.0, float(os.environ.get(GRACE_ENV, "")))
    except ValueError:
        return DEFAULT_GRACE


#: what a terminal needs before a line of ours while a live status line is drawn on it
#: (the line is cleared), and before an immediate exit (its hidden cursor shown again:
#: os._exit skips the display's own restore); set by :mod:`wsync.liveline`
_terminal: tuple[bytes, bytes] = (b"", b"")


def set_terminal(before_line: bytes, before_exit: bytes) -> None:
    """What the live status line needs written before a line of ours and before an
    immediate exit; ``b"", b""`` once it is gone."""
    global _terminal
    _terminal = (before_line, before_exit)


def _say(line: str, *, exiting: bool = False) -> None:
    """One line on stderr, straight to the fd: no buffer another thread may hold."""
    before_line, before_exit = _terminal
    prefix = before_line + (before_exit if exiting else b"")
    with contextlib.suppress(OSError):
        os.write(2, prefix + f"wsync: {line}\n".encode("utf-8", "replace"))


class Stopper:
    """The process-wide signal policy of one ``wsync`` command (see the module doc)."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        #: signals received so far (read by the CLI to turn any failure into 130)
        self.received = 0
        self._target: Callable[[], None] | None = None
        self._deadline: float | None = None
        self._lock = threading.Lock()
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_handlers: dict[int, object] = {}
        self._old_wakeup = -1
        self._thread = threading.Thread(target=self._watch, name="wsync-signals", daemon=True)

    # -- lifecycle (main thread) -----------------------------------------------

    def install(self) -> None:
        # the pipe first: from the moment the handlers are in place every signal must
        # reach the watcher (a handler without the pipe drops it).  The watcher thread
        # last: a signal before it runs waits in the pipe for it, whereas a start before
        # the handlers (a start waits for the new thread to run: long on a loaded
        # machine) left Python's default in place, a KeyboardInterrupt traceback
        self._old_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signum in STOP_SIGNALS:
            # a signal ignored when we started stays ignored, as Python itself does
            # for SIGINT: a shell without job control starts background commands
            # so that the terminal's Ctrl-C does not reach them
            if signal.getsignal(signum) != signal.SIG_IGN:
                self._old_handlers[signum] = signal.signal(signum, _ignore)
        try:
            self._thread.start()
        except BaseException:  # (no thread: the signals would go nowhere)
            self._restore()
            raise

    def _restore(self) -> None:
        signal.set_wakeup_fd(self._old_wakeup)
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def uninstall(self) -> None:
        """Give the process its previous handlers back (for in-process callers of ``main``)."""
        self._restore()
        os.write(self._stop_w, b"x")
        self._thread.join(timeout=5)
        for fd in (self._read_fd, self._write_fd, self._stop_r, self._stop_w):
            os.close(fd)

    # -- what a signal does ----------------------------------------------------

    def set_target(self, cancel: Callable[[], None] | None) -> None:
        """What the first signal does from now on: ``cancel`` (thread-safe), or, with
        None, exit at once (nothing is running that could need winding down)."""
        with self._lock:
            self._target = cancel

    def _on_signal(self, signum: int) -> None:
        name = _NAMES.get(signum, f"signal {signum}")
        with self._lock:
            self.received += 1
            target = self._target
            if self.received > 1:
                self.exit_now(f"stopped at once by a second {name}; run the same command again")
            if target is None:
                self.exit_now(f"interrupted by {name}")
            self._deadline = time.monotonic() + self.grace
        again = "Ctrl-C" if signum == signal.SIGINT else name
        _say(f"stopping on {name}; {again} again stops at once")
        try:
            target()
        except Exception:  # e.g. the loop closed just now: nothing left to wind down
            self.exit_now(f"interrupted by {name}")

    @staticmethod
    def exit_now(line: str) -> NoReturn:
        """Exit 130 now, skipping every cleanup (safe: see the module doc)."""
        _say(line, exiting=True)
        os._exit(EXIT_INTERRUPTED)

    # -- the watcher thread ----------------------------------------------------

    def _watch(self) -> None:
        while True:
            timeout = None
            if self._deadline is not None:
                timeout = max(0.0, self._deadline - time.monotonic())
            ready, _, _ = select.select([self._read_fd, self._stop_r], [], [], timeout)
            if self._stop_r in ready:
                return
            if self._read_fd in ready:
                try:
                    data = os.read(self._read_fd, 64)
                except BlockingIOError:
                    data = b""
                for signum in data:
                    if signum in _NAMES:
                        self._on_signal(signum)
            elif self._deadline is not None and time.monotonic() >= self._deadline:
                self.exit_now(
                    f"winding down took more than {self.grace:g}s; stopped at once "
                    "(the journal is intact; run the same command again to resume)"
                )


def exit_process(code: int) -> NoReturn:
    """End the ``wsync`` process with ``code``, its signal policy in force to the last.

    Normal interpreter finalization puts the default action back on every
    signal that had a Python handler before the process is gone: a Ctrl-C in
    that window kills the process silently (status -2) after a pull that had
    finished.  Everything wsync must keep is already on disk (journal and DEST
    are written with fsync, the pool threads are idle or abandoned on purpose),
    so after flushing stdout and stderr nothing is lost by exiting here.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _ignore(signum: int, frame: object) -> None:
    """The Python-level handler: the watcher thread acts (see the module doc)."""


_current: Stopper | None = None


def current() -> Stopper | None:
    """The installed stopper, if this process is the ``wsync`` command."""
    return _current


def install_for_cli(argv: Sequence[str]) -> Stopper | None:
    """Install the stop policy for the command in ``argv`` (idempotent).

    Returns the new :class:`Stopper` when this call installed it (the caller
    uninstalls it when it returns to a caller of its own), else None.  Nothing
    is installed for the daemon and its clients, nor off the main thread.
    """
    global _current
    if _current is not None or (argv and argv[0] in UNGUARDED_COMMANDS):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    stopper = Stopper(_grace_from_env())
    stopper.install()
    _current = stopper
    return stopper


def uninstall(stopper: Stopper) -> None:
    global _current
    if _current is stopper:
        stopper.uninstall()
        _current = None
